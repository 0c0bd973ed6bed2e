#pragma once
// The planner: from a model's dataflow graph to a sharding decision for every layer.
//
// A layer whose input is replicated starts a *region* as a column layer (its output features
// sharded). The sharded axis is followed through reshapes (a feature axis becoming heads x
// head_dim), transposes, elementwise ops, batched matmuls and fused splits; a layer that
// contracts the sharded axis closes the region as a row layer (one all-reduce). Every region
// splits its axis into the same number of units (the gcd of the sizes it passes through, so
// heads stay whole, and KV heads for grouped-query attention). A region whose axis reaches
// something that would need it whole (a norm over features, an op autoshard cannot follow)
// is replicated; one that reaches a model output gathers there. Decisions repeat until stable.
//
// KV heads meet query heads through a repeat (repeat_kv's expand and reshape) or a grouped
// attention; the two sides are kept as a coarse and a fine region. Where their common units
// cover the ranks they become one region, as before; otherwise the query heads are split alone
// and each rank holds the KV heads its query heads use (LayerDecision::repeat), whose
// gradients the holders sum in backward (one all-reduce per KV projection, in the plan's count).
#include <string>
#include <vector>

#include "plan/graph.h"
#include "plan/records.h"

namespace autoshard::plan {

// Batch: an einsum layer split on a letter its input, weight and output share (a grouped
// convolution's groups): its input arrives split there, its output leaves split alike, and it
// needs no collective.
enum class Style { Replicate, Column, ColumnGather, Row, Vocab, Batch };

struct LayerDecision {
  int node = -1;
  Style style = Style::Replicate;
  int region = -1;
  int64_t units = 0;           // the region's units (heads, or features)
  std::vector<int64_t> parts;  // fused output layout, if the output is split into parts
  // Parts held whole on every rank (indices into parts): the smaller parts of a fused layer
  // whose split the attention cannot follow (one KV head beside the query heads). With
  // summed_parts their gradient is partial on each rank, summed over the ranks in backward.
  std::vector<int64_t> whole_parts;
  bool summed_parts = false;
  int copy_group = -1;         // column layers reading the same input share one input copy
  // Its input copy sums nothing in backward: a replicated layer upstream sums the gradient
  // where it returns its output (constructs/summed_outputs.cpp).
  bool deferred_copy = false;
  int64_t letter = 0;          // einsum layers: the weight letter split (a character code)
  // A KV projection whose KV heads are fewer than the ranks need: each of its `units` serves
  // `repeat` consecutive units of its region, and a rank holds the units its share uses.
  int64_t repeat = 0;
  std::string reason;          // a code saying why, when it is not the obvious choice (see settle.cpp)
  std::string note;            // the same, in words
  int64_t whole_units = 0;     // reason "too_few_units": the units there were
  // Sequence parallelism (sequence.cpp): "reduce_scatter" (its output's tokens are split
  // instead of all-reduced), "gather" (its input's tokens are gathered instead of copied), or "".
  std::string sequence;
  int sequence_dim = -1;       // the token axis of that output or input
  int sequence_region = -1;
  std::string sequence_note;   // why a layer that could start a sequence region does not
};

struct RegionSummary {
  int id = -1;
  int64_t units = 0;
  std::vector<int64_t> localize;  // global sizes, seen on the sharded axis, that become local
  // With KV heads replicated where needed: the KV projections' repeat and units, and the
  // sizes seen on their side (KV heads, their features), which become local per KV run.
  int64_t repeat = 0;
  int64_t coarse_units = 0;
  std::vector<int64_t> coarse_localize;
  // The smallest module holding the region's layers, whose attributes become local; and, for
  // a region spanning several attentions (a position bias passed on from the first ties their
  // heads together), the smallest module holding each one's layers (region_modules.cpp).
  std::string module;
  std::vector<std::string> part_modules;
};

struct CommCount {
  std::string phase;  // "forward" or "backward"
  std::string kind;   // "all_reduce", "all_gather" or "reduce_scatter"
  int64_t count = 0;
  int64_t elements = 0;  // summed over collectives, at the graph's example shapes
};

// Replicated parameters whose gradient is a partial sum on each rank (read inside a sharded
// region), summed over the ranks in backward: one all-reduce per bucket.
struct PartialBucket {
  std::vector<int64_t> params;  // parameter indices, in the order backward produces them
  int64_t elements = 0;
};

// Where a sharded tensor of the graph is split: its axis `axis` is `outer` x `size`, and
// `size` is split like the region's units (or like its KV heads, for `coarse` tensors).
struct TensorLayout {
  int tensor = -1;
  int region = -1;
  bool coarse = false;
  int axis = -1;
  int64_t outer = 1;
  int64_t size = 0;
  bool sequence = false;  // split on tokens: `size` tokens split by split_sizes over the ranks
  int64_t whole = 0;      // elements of the axis held whole (a fused output's whole parts); the rest is split
  // A coarse (KV) tensor broadcast for its query heads (repeat_kv): the axis after the split
  // one repeats each KV head for the query heads it serves; its local size on a rank is that
  // rank's query heads per KV head, not the global count. -1: none.
  int repeat_axis = -1;
};

struct Plan {
  std::vector<LayerDecision> layers;
  std::vector<RegionSummary> regions;
  std::vector<CommCount> comm;
  std::vector<PartialBucket> partial;
  std::vector<TensorLayout> tensors;  // every sharded tensor; the others are replicated
  // The constructs' records by kind, every registered kind present (constructs/registry.h).
  RecordsByKind records;
};

// One settled plan of `graph` (settle.cpp).
Plan make_plan(const Graph& graph, int64_t world_size);

// The planner's answer: make_plan, planned again while the rules judging its sequence regions
// from the module calls around them ask for it (replan.cpp).
Plan plan_model(Graph graph, int64_t world_size);

// The plan as a versioned JSON document with named fields (see emit_json.cpp).
std::string plan_to_json(const Plan& plan);

}  // namespace autoshard::plan
