#pragma once
// The dataflow graph the planner reads: tensors with their shapes, and the ops between them,
// reduced to the few kinds that matter for deciding where a sharded axis can travel. The
// Python side records it (on meta tensors) and writes it as the versioned JSON document
// parsed here (see parse_graph).
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace autoshard::plan {

enum class Kind {
  Linear,     // a Linear-like layer: in_features, out_features, weight_param, bias_param
  Embedding,  // num_embeddings, embedding_dim, weight_param
  Einsum,     // an einsum layer: weight_param, bias_param, letters
  View,       // any reshape; the axis mapping follows from the two shapes
  Permute,    // permutation
  Expand,     // broadcast of size-1 dims (and new leading dims)
  Pointwise,  // elementwise with broadcasting; narrowing (optional): a cast to a narrower dtype
  Reduce,     // axes: the reduced input axes (softmax and norms count as reductions)
  Matmul,     // inputs {a, b}: [..., m, k] @ [..., k, n]
  Attention,  // inputs {q, k, v, ...}: heads on axis -3
  // The attention weights an nn.MultiheadAttention returns (inputs {weights}, heads on axis
  // `dim`): averaged over the heads (`average`), or per head.
  AttentionWeights,
  // An RMS norm over the last axis of a layer's output, with a weight of that axis's size
  // (inputs {x, weight}, weight_param): OLMo 2's q_norm and k_norm over every head's features.
  Norm,
  Split,      // dim, drop_dim (unbind: each piece one long, without the axis); one output per piece
  Cat,        // dim
  Slice,      // dim, start, stop, drop_dim
  Source,     // no tensor inputs
  Opaque,     // anything else: a sharded tensor cannot pass through it
};

// One weight letter of an einsum layer, as the C++ equation parser describes it
// (autoshard.ops.einsum_weight_axes): its role and its dims in the input and output (-1: absent).
struct EinsumLetter {
  enum Role : int64_t { Output = 0, Contracted = 1, Batch = 2 };
  int64_t letter = 0;  // character code
  Role role = Output;
  int64_t input_dim = -1;
  int64_t output_dim = -1;
  // A batch letter's extent where its input axis holds more than the letter (a grouped
  // convolution's groups, each a run of channels): a split keeps these runs whole. 0: the axis.
  int64_t size = 0;
};

// A LoRA adapter's factors beside a Linear layer: A ([rank, in]) and B ([out, rank]) as
// parameter indices, with their shapes and whether they are trained.
struct AdapterFactors {
  int64_t a = -1, b = -1;
  std::vector<int64_t> a_shape, b_shape;
  bool a_trainable = true, b_trainable = true;
};

struct TensorInfo {
  std::vector<int64_t> shape;
  int param = -1;  // index of the parameter this tensor is, or -1
  bool is_output = false;
  bool known = false;
  bool floating = true;   // floating-point or complex: a gradient can reach it
  bool trainable = true;  // a parameter: whether it requires a gradient
};

struct Node {
  Kind kind;
  std::string label;  // for messages: the module or op it came from
  std::vector<int> inputs;
  std::vector<int> outputs;
  // Layers.
  int64_t in_features = 0, out_features = 0;      // Linear
  int64_t num_embeddings = 0, embedding_dim = 0;  // Embedding
  int64_t weight_param = -1, bias_param = -1;     // every layer kind (an Embedding has no bias)
  std::vector<EinsumLetter> letters;              // Einsum
  std::vector<AdapterFactors> adapters;           // Linear: its LoRA adapters (split with it)
  int64_t weight_elements = 0;                    // a layer: its weight's elements (0: not told)
  // Ops.
  std::vector<int64_t> permutation;  // Permute
  std::vector<int64_t> axes;         // Reduce
  int64_t dim = 0;                   // Split, Cat, Slice
  int64_t start = 0, stop = 0;       // Slice
  bool drop_dim = false;             // Slice: select drops the axis; Split: unbind drops it
  // Slice: the sizes of the slices of one tensor that together cover its axis in order (Phi-3's
  // q, k and v sliced from one fused output), and which of them this slice is; empty if none.
  std::vector<int64_t> partition;
  int64_t part = -1;
  bool narrowing = false;            // Pointwise: a cast to a narrower floating-point dtype
  bool average = false;              // AttentionWeights: averaged over the heads
  bool trainable = true;             // a layer: whether any parameter of its module requires a gradient
  bool no_grad = false;              // run under the model's own torch.no_grad(): no gradient through it
  // An experts module's combine (Opaque, inputs {expert outputs, routing...}): per routing input,
  // whether it is floating-point. Once the experts are split, its gradient is a partial sum.
  std::vector<bool> routing_floating;
  // The same combine: the elements of an out bias (gpt-oss's, one per expert) that one rank adds
  // to its partial outputs; once the experts are split, its gradient is summed over the ranks.
  int64_t summed_bias = 0;
  // An Einsum layer that is a convolution (its output channels may be gathered:
  // passes/unsplit_regions.cpp).
  bool convolution = false;
  // A Linear layer's weight multiplied by the model itself, outside the layer's call
  // (`self.dt_proj.weight @ x`): only a column split is exact, its local rows read by the
  // model's own product, and no input copy sums its input's gradient (gradients.cpp).
  // `functional_bias`: the product adds the layer's bias too (F.linear(x, w, layer.bias)).
  bool functional = false;
  bool functional_bias = false;
  // A Norm that is a LayerNorm: its mean and its variance each need every rank's features.
  bool centered = false;
  // A Norm per channel (axis 1) over the batch and positions, a BatchNorm: split with its
  // channels it needs no communication, but for the running statistics it updates
  // (`running_stats`), whose new values are all-gathered in a training forward.
  bool per_channel = false;
  bool running_stats = false;
  // Opaque, added by the planner itself (length_reads.cpp): the module that may read the token
  // count of this node's input, which therefore stays whole.
  std::string length_read_by;
};

// A tensor a module received in its first call: its node range and the tensor's position
// among the call's flattened inputs (sequence parallelism may cut it there).
struct ModuleEntry {
  int tensor = -1;
  int first = 0;
  int end = 0;
  int leaf = 0;
  std::string module;
};

// A tensor a module's only call returned: its node range and the tensor's position among the
// call's flattened outputs (sequence parallelism may gather it there, token_indexing.cpp).
struct ModuleExit {
  int tensor = -1;
  int first = 0;
  int end = 0;
  int leaf = 0;
  std::string module;
};

struct Graph {
  std::vector<TensorInfo> tensors;
  std::vector<Node> nodes;
  // User overrides: layer node -> "replicate" or "column_gather".
  std::vector<std::pair<int, std::string>> forced;
  // What the Python layer saw a layer's module compute once planned: other local shapes than the
  // plan's ("shape_mismatch"), or, sharded on a meta copy, other shapes or collectives than
  // predicted ("dry_run_mismatch"), with what differed. The planner holds such a layer whole and
  // says why; the Python layer reports and never decides.
  struct Observation {
    int node;
    std::string kind;
    std::string detail;
  };
  std::vector<Observation> observations;
  // Whether the planner may split the token axis between row and column layers.
  bool sequence_parallel = true;
  // The weight elements from which a layer that cannot be paired is split and its output
  // gathered (passes/unsplit_regions.cpp) rather than held whole on every rank; 0: never.
  int64_t gather_unpaired = 0;
  // Parameters (by index) whose every read lies inside one call of the module holding them, so
  // that they can be gathered whole where that call begins (constructs/gathered_params.cpp).
  std::set<int64_t> gatherable;
  std::vector<ModuleEntry> entries;
  // In the order the calls returned, each call's outputs in order (modules called more than
  // once have none: a gather at their output would act on every call).
  std::vector<ModuleExit> exits;
  // Layers one module computes that split only together, a column layer then a row layer, or
  // both whole (an nn.MultiheadAttention's q/k/v projection and its out_proj).
  std::vector<std::pair<int, int>> together;

  const TensorInfo& tensor(int id) const { return tensors.at(id); }
};

// The graph document, version 1 (written by python/autoshard/plan/capture.py):
//   {"version": 1,
//    "tensors": [{"shape": [...], "param": index (optional), "output": bool (optional),
//                 "floating": bool (optional, true), "trainable": bool (optional, true)}, ...],
//    "nodes": [{"kind": "linear", "label": "...", "inputs": [ids], "outputs": [ids],
//               "trainable": bool (optional, true; layers), "no_grad": bool (optional, false),
//               "routing_floating": [bool, ...] (optional),
//               "summed_bias": int (optional, 0), "convolution": bool (optional, false; einsum),
//               "functional", "functional_bias": bool (optional, false; linear),
//               "centered", "per_channel", "running_stats": bool (optional, false; norm),
//               "adapters": [{"a", "b", "a_shape", "b_shape", "a_trainable", "b_trainable"}] (optional; linear),
//               "weight_elements": int (optional, 0; layers),
//               and the fields of its kind named in Kind above}, ...],
//    "forced": [{"node": index, "style": "replicate" | "column_gather"}, ...] (optional),
//    "observations": [{"node": index, "kind": "shape_mismatch" | "dry_run_mismatch",
//                      "detail": "..."}, ...] (optional: Graph::Observation),
//    "sequence_parallel": bool (optional, true),
//    "gather_unpaired": int (optional, 0: Graph::gather_unpaired),
//    "gatherable_params": [parameter indices] (optional: Graph::gatherable),
//    "entries": [{"tensor": id, "first": node, "end": node, "leaf": index, "module": "..."}, ...]
//               (optional: ModuleEntry),
//    "exits": [{"tensor": id, "first": node, "end": node, "leaf": index, "module": "..."}, ...]
//             (optional: ModuleExit),
//    "together": [[column node, row node], ...] (optional: Graph::together)}
// A tensor's id is its index in "tensors"; einsum letters are objects
// {"letter": "d", "role": "output" | "contracted" | "batch", "input_dim": int, "output_dim": int,
//  "size": int (optional, batch letters: EinsumLetter::size)}.
Graph parse_graph(const std::string& document);

}  // namespace autoshard::plan
