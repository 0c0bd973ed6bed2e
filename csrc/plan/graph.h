#pragma once
// The dataflow graph the planner reads: tensors with their shapes, and the ops between them,
// reduced to the few kinds that matter for deciding where a sharded axis can travel. The
// Python side records it (on meta tensors) and writes it in the line format parsed here.
#include <cstdint>
#include <string>
#include <vector>

namespace autoshard::plan {

enum class Kind {
  Linear,     // a Linear-like layer: args {in_features, out_features, weight_param, bias_param}
  Embedding,  // args {num_embeddings, embedding_dim, weight_param}
  Einsum,     // an einsum layer: args {weight_param, bias_param, n, then per weight letter:
              // character code, role (0 output, 1 contracted, 2 batch), input dim, output dim}
  View,       // any reshape; the axis mapping follows from the two shapes
  Permute,    // args: the permutation
  Expand,     // broadcast of size-1 dims (and new leading dims)
  Pointwise,  // elementwise with broadcasting
  Reduce,     // args: the reduced input axes (softmax and norms count as reductions)
  Matmul,     // inputs {a, b}: [..., m, k] @ [..., k, n]
  Attention,  // inputs {q, k, v, ...}: heads on axis -3
  Split,      // args {dim}; one output per piece
  Cat,        // args {dim}
  Slice,      // args {dim, start, stop, drop_dim}
  Source,     // no tensor inputs
  Opaque,     // anything else: a sharded tensor cannot pass through it
};

struct TensorInfo {
  std::vector<int64_t> shape;
  int param = -1;  // index of the parameter this tensor is, or -1
  bool is_output = false;
  bool known = false;
};

struct Node {
  Kind kind;
  std::string label;  // for messages: the module or op it came from
  std::vector<int> inputs;
  std::vector<int> outputs;
  std::vector<int64_t> args;
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

struct Graph {
  std::vector<TensorInfo> tensors;
  std::vector<Node> nodes;
  // User overrides: layer node -> "replicate" or "column_gather".
  std::vector<std::pair<int, std::string>> forced;
  // Whether the planner may split the token axis between row and column layers.
  bool sequence_parallel = true;
  std::vector<ModuleEntry> entries;

  const TensorInfo& tensor(int id) const { return tensors.at(id); }
};

// Line format, one record per line:
//   tensor <id> <ndim> <size>...
//   param <tensor id> <parameter index>
//   output <tensor id>
//   node <kind> <label> in <n> <id>... out <n> <id>... args <n> <int>...
//   force <node> <replicate|column_gather>
//   sequence off          (no sequence parallelism)
//   entry <tensor id> <first node> <end node> <input leaf> <module name>
Graph parse_graph(const std::string& text);

}  // namespace autoshard::plan
