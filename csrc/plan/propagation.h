#pragma once
// One pass of the planner over the graph: which tensors are sharded (and on which axis, in
// which region), what role each layer takes, given the decisions forced so far. settle.cpp
// repeats passes until no decision changes; emit.cpp turns the last pass into a Plan.
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "plan/graph.h"
#include "plan/planner.h"
#include "plan/reshape.h"

namespace autoshard::plan {

// WholeSmallParts: a fused layer (its output split into parts of different sizes) whose
// smaller parts are held whole on every rank, its largest split.
enum class Force { None, Replicate, Gather, WholeSmallParts };

// The source of a tensor of one value throughout made at this rank's size (a node cut of zeros):
// it holds nothing that depends on where a feature lies, so it follows any layer's layout.
constexpr int kAnySource = -2;

// A tensor of one value throughout (zeros, ones, full): made at this rank's size, it holds this
// rank's part of it.
bool is_uniform_source(const Node& node);

struct Layout {
  bool sharded = false;
  AxisFactor factor;
  int region = -1;
  int source = -1;  // the column layer whose output this is, unchanged (for fused splits); or kAnySource
  // The size the axis right after the sharded one was broadcast to from 1 (repeat_kv's
  // expand), so that a reshape merging the two repeats each unit that many times.
  int64_t repeat_next = 0;
  // Sharded on a token axis (sequence parallelism): factor.axis holds the tokens, split like
  // split_sizes(factor.size, ranks); the region is a sequence region.
  bool sequence = false;
  // Elements of the sharded axis held whole on every rank: a fused layer's output whose smaller
  // parts stay whole. Only views that keep the axis, and the split into its parts, may read it.
  int64_t whole = 0;
};

// How a layer meets a sequence region (sequence.cpp).
enum class SequenceRole { None, ReduceScatter, Gather };

// A coarse region (KV heads) whose units each feed `ratio` consecutive units of a fine region
// (the query heads that share a KV head), met through a repeat or a grouped attention.
struct Link {
  int coarse = -1;
  int fine = -1;
};

struct Region {
  int parent = 0;
  int64_t units = 0;  // gcd of every sharded size the region passes through
  bool conflict = false;
  bool reaches_output = false;
  std::string reason;
  std::vector<int64_t> localize;
  bool sequence = false;  // a sequence region: the residual stream split on its token axis
};

bool is_layer(const Node& node);

class Propagation {
 public:
  Propagation(const Graph& graph, const std::vector<Force>& forced);

  // `cuts` (graph entry -> the factor of its tensor's axis holding heads): tensors held whole
  // that are cut to this rank's heads where a module receives them (constructs/head_cuts.cpp).
  void run(const std::set<int>& vocab_embeddings, const std::map<int, AxisFactor>& cuts = {},
           const std::map<int, AxisFactor>& node_cuts = {});
  int find(int r);
  // Whether a gradient flows to `tensor` (a parameter's, or one computed from a layer's output).
  bool carries_grad(int tensor) const { return carries_grad_.at(tensor); }
  // Decides every KV link once the pass has run (links.cpp).
  void settle_links(int64_t world_size);
  // Follows gradients backward (gradients.cpp): finds the replicated parameters whose
  // gradient is a partial sum on each rank, and refuses regions that would make a gradient
  // partly whole and partly partial.
  void settle_gradients();
  // One backward walk of settle_gradients, outputs that must not be summed given: the conflicts it
  // finds (applied once no summed output leaks) and the summed outputs that leak.
  void gradients_pass(const std::set<int>& unsummable, std::vector<std::pair<int, std::string>>& refused,
                      std::set<int>& leaked);
  // Splits the token axis between the layers that end a tensor-parallel region (row layers,
  // vocabulary-parallel embeddings) and those that start the next (column layers), where
  // every op in between is per token (sequence.cpp); `refused` layers start no such region.
  // `entries` (tensor -> token axis) are tensors held whole that are cut to this rank's tokens
  // where a module receives them; tensors found to need it are left in wanted_entries.
  void run_sequence(const std::set<int>& refused, const std::map<int, int>& entries);
  int find_entry(int tensor) const;
  bool narrowed_parameter(int tensor, int depth = 0) const;
  // Marks a region (and, for KV heads kept apart, the query heads' region) as conflicting.
  void conflict(int region, const std::string& why);

  std::vector<Layout> layouts;
  std::vector<Style> roles;
  std::vector<int> node_region;
  std::map<int, std::vector<int64_t>> parts;
  // Layers forced to WholeSmallParts: their parts as the pass that forced them found them (in);
  // the indices of the parts held whole, found again by this pass (out).
  std::map<int, std::vector<int64_t>> known_parts;
  std::map<int, std::vector<int64_t>> whole_parts;
  // Layers whose whole parts get a partial gradient on each rank (read by this rank's heads
  // only), with the elements to sum (weight rows and bias), set by settle_gradients.
  std::map<int, int64_t> summed_parts;
  std::map<int, int64_t> letters;  // einsum layers: the weight letter split
  std::vector<Region> regions;
  std::vector<Link> links;
  // Coarse region root -> its fine region root, for links kept apart by settle_links: the
  // KV heads are then replicated on the ranks whose query heads use them.
  std::map<int, int> kv_fine;
  // Parameters (by index) whose gradient is partial on every rank, with their number of
  // elements, set by settle_gradients.
  std::map<int64_t, int64_t> partial_params;
  // Replicated Linear layers whose output's gradient is partial on every rank, set by
  // settle_gradients: all of its readers either meet heads-split tensors (MLA's k_pe broadcast to
  // the split heads) or are column layers whose input copy then sums nothing (deferred_copies).
  // The gradient is all-reduced where the layer returns its output: node -> its output's elements.
  std::map<int, int64_t> summed_outputs;
  std::set<int> deferred_copies;
  // Layers meeting a sequence region: their role there, the token axis (of the output for
  // ReduceScatter and Slice, of the input for Gather) and the region.
  std::map<int, SequenceRole> sequence_roles;
  std::map<int, int> sequence_axis;
  std::map<int, int> sequence_region;
  std::map<int, int> entry_of;        // cut tensor -> its graph entry
  std::map<int, int> wanted_entries;  // tensor -> token axis, to cut in the next pass
  std::map<int, int> gather_entry;    // column layers' input -> the entry gathering it
  // Head cuts: entries found to need one (to cut in the next pass), and this pass's cuts with
  // the region each began.
  std::map<int, AxisFactor> wanted_cuts;
  std::map<int, int> cut_region;
  std::map<int, AxisFactor> cut_factor;
  // Node cuts: the output of a replicated embedding (T5's relative position bias, whose
  // embedding dim is the heads) cut to this rank's heads as it leaves the layer, or a tensor of
  // one value throughout (zeros, ones, full) made at this rank's size: node -> the factor of its
  // output's heads axis.
  std::map<int, AxisFactor> wanted_node_cuts;
  // Cuts found not to work (passes/settle_cuts.cpp): never asked for again, their bias meets the scores whole.
  std::set<int> dropped_cuts, dropped_node_cuts;
  std::map<int, int> node_cut_region;
  std::map<int, AxisFactor> node_cut_factor;
  // Head parameters (constructs/head_params.cpp): a parameter over the heads (a per-head scale, a
  // bias of all_head_size) split with them, by its tensor. Set before run: the splits to make and
  // those found not to work, with why; found by run: the splits wanted, and this pass's regions.
  std::map<int, AxisFactor> head_params;
  std::map<int, std::string> dropped_head_params;
  std::map<int, AxisFactor> wanted_head_params;
  std::map<int, int> head_param_region;
  // The layer whose output each head parameter meets (-1: none), set with head_params and
  // found with wanted_head_params. A parameter per feature of a fused layer's output (a
  // depthwise convolution's taps over fused q/k/v) is split part by part, as that layer is.
  std::map<int, int> head_param_sources, wanted_head_param_sources;

  // The attention weights of an nn.MultiheadAttention whose heads are split (node -> its
  // region, and whether the model reads them): averaged, each rank's sum over its heads is
  // summed over the ranks (one all-reduce in forward); never read, they are not returned.
  struct ReturnedWeights {
    int region = -1;
    bool read = false;
  };
  std::map<int, ReturnedWeights> returned_weights;

  // Norms over a layer's output whose features are split by heads: node -> region
  // (constructs/norms.cpp).
  std::map<int, int> split_norms;
  // Refuses split norms over KV heads that several ranks hold (settle_links kept them apart):
  // each holder would count their squares again.
  void refuse_shared_norms();

  static bool uniform_groups(int64_t units, int64_t ratio, int64_t world_size);

 private:
  bool only_plain_columns(int coarse);
  int new_region(int64_t size);
  void constrain(int region, int64_t size);
  void unite(int a, int b);
  const std::vector<int64_t>& shape(int id) const { return graph_.tensor(id).shape; }
  void block(const Node& node, const std::string& why);
  void set_sharded(int id, AxisFactor factor, int region, int source = -1, int64_t repeat_next = 0);
  void link(int coarse, int fine) { links.push_back({coarse, fine}); }
  bool merge_elementwise(const Node& node, Layout& merged, int skip_axis_check = -1);
  bool cat_parts(const Node& node);
  // The cat node whose parts `tensor` is laid out in (cat_parts), or -1.
  int concatenated_parts(int tensor) const;
  void visit_kind(int n, const Node& node, const std::set<int>& vocab_embeddings);
  // Whether `tensor`, held whole and read by the current node on `axis` against a tensor
  // sharded like `merged`, can be cut to this rank's heads where a module receives it; if so
  // the cut is wanted for the next pass.
  bool request_cut(int tensor, int axis, const AxisFactor& wanted);
  void open_cuts(int n, const std::map<int, AxisFactor>& cuts);
  // Whether `tensor`, held whole and read by the current node on `axis` against a tensor
  // sharded like `merged`, is a parameter (or views of one) that can be split with the heads;
  // if so the split is wanted for the next pass, else `why` may say why not.
  bool request_head_param(int tensor, int axis, const AxisFactor& merged, int source, std::string& why);
  void open_head_params();

  // Head cuts and head parameters both follow a whole tensor back from its read against the
  // heads, through the ops that keep each head's elements apart (heads_walk.cpp); each stops
  // the walk where it finds what it can cut or split.
  struct HeadsTrace {
    int tensor = -1;
    AxisFactor heads;  // the heads' factor on the axis of `tensor` holding them
    int before = -1;   // `tensor` as written before this node
  };
  enum class WalkVerdict { Further, Found, Refused };
  struct HeadsWalk {
    // A cut is made on the heads as the scores count them: a view may not merge or split them.
    bool views_keep_heads = false;
    // A parameter is split whole: a reduction over its other axes still keeps each head apart.
    bool through_reductions = false;
    // Asked at every tensor the walk reaches, with the node that wrote it (-1: none).
    std::function<WalkVerdict(const HeadsTrace& at, int producer)> at_step;
  };
  bool walk_heads_back(int tensor, int axis, const AxisFactor& heads, const HeadsWalk& walk);

  void visit(int n, const std::set<int>& vocab_embeddings);
  void visit_linear(int n, const Node& node);
  void visit_einsum(int n, const Node& node);
  void visit_embedding(int n, const Node& node, bool vocab_parallel);
  void visit_view(const Node& node);
  // The number of pieces an unbind takes `axis` of tensor `id` apart into, through permutes
  // alone (qkv.reshape(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)); 0 if it is not so read.
  int64_t unbound_parts(int id, int axis) const;
  int64_t selected_parts(int id, int axis) const;
  void visit_permute(const Node& node);
  void visit_expand(const Node& node);
  void visit_pointwise(const Node& node);
  void visit_reduce(const Node& node);
  void visit_matmul(const Node& node);
  void visit_attention(const Node& node);
  void visit_attention_weights(int n, const Node& node);
  void visit_norm(int n, const Node& node);
  void visit_split(const Node& node);
  void visit_cat(const Node& node);
  void visit_slice(const Node& node);
  void slice_part(const Node& node, const Layout& x);
  // A part of a fused output with whole parts: replicated if whole, else sharded in its region.
  void set_part(int id, const Layout& x, const std::vector<int64_t>& partition, size_t part);
  void sequence_visit(int n, const Node& node, const std::set<int>& refused);
  void sequence_layer(int n, const Node& node, const std::set<int>& refused);

  // The node that wrote `tensor` last before node `before`: an op writing in place (copy_ into a
  // buffer of zeros) keeps its destination's id, so producer_ alone would name the op itself.
  int producer_before(int tensor, int before) const;

  const Graph& graph_;
  const std::vector<Force>& forced_;
  int current_node_ = -1;
  std::vector<int> producer_;       // tensor -> the node computing it, or -1
  std::vector<std::vector<int>> consumers_;  // tensor -> the nodes reading it
  std::vector<bool> carries_grad_;  // tensor -> whether a gradient flows to it (a parameter's, a layer's)
  std::set<int64_t> called_again_;  // weights of Linear layers called more than once (run_sequence)
  std::vector<bool> read_;          // tensor -> whether a node reads it or it is a model output
};

}  // namespace autoshard::plan
