// Modules that may read the token count of an input that sequence parallelism splits.
//
// Sequence parallelism hands a module the tokens of its inputs split over the ranks where the
// module's own column layers gather them again. A module that does that inside its own call
// (an attention called as attn(x, memory) that norms x and memory itself before its q and kv
// layers) and reshapes a layer's output may have read an input's length first (b, t, _ =
// x.shape, then .view(b, t, heads, -1) on the gathered q), which a capture on meta cannot see:
// it is not an op. (A decoder layer holding its MLP's Linear layers, which it never reshapes,
// keeps its split tokens.) Such inputs stay whole: each gets a reader that no sequence region
// passes (sequence.cpp refuses the region with length_may_be_read's words), and the graph is
// planned again (replan.cpp).
#include <algorithm>
#include <map>
#include <set>

#include "plan/propagation.h"
#include "plan/sequence_rules.h"

namespace autoshard::plan {
namespace {

// A module's first call, [first, end) nodes.
struct CallSpan {
  int first = 0;
  int end = -1;
};

// Whether the output of layer `node` reaches a view or reshape within `call` before another
// layer: a shape the module's code spells, possibly with a length it read.
bool reshaped_inside(const Graph& graph, int node, CallSpan call) {
  std::map<int, std::vector<int>> readers;
  for (int index = std::max(call.first, node + 1); index < call.end; ++index) {
    for (int tensor : graph.nodes[index].inputs) readers[tensor].push_back(index);
  }
  std::vector<int> stack = graph.nodes[node].outputs;
  std::set<int> seen;
  while (!stack.empty()) {
    const int tensor = stack.back();
    stack.pop_back();
    for (int index : readers[tensor]) {
      if (seen.count(index) || is_layer(graph.nodes[index])) continue;
      seen.insert(index);
      if (graph.nodes[index].kind == Kind::View) return true;
      stack.insert(stack.end(), graph.nodes[index].outputs.begin(), graph.nodes[index].outputs.end());
    }
  }
  return false;
}

// The module holding a layer: its name less the last component ("" for a top-level layer).
std::string parent_of(const std::string& layer) {
  const size_t dot = layer.rfind('.');
  return dot == std::string::npos ? "" : layer.substr(0, dot);
}

}  // namespace

bool operator==(const LengthRead& a, const LengthRead& b) { return a.module == b.module && a.tensor == b.tensor; }

std::vector<LengthRead> split_inputs_gathered_inside(const Graph& graph, const Plan& plan) {
  // Only modules that received a tensor can be found here, and their entries give their span.
  std::map<std::string, CallSpan> calls;
  for (const ModuleEntry& entry : graph.entries) calls[entry.module] = {entry.first, entry.end};
  std::set<int> split_on_tokens;
  for (const TensorLayout& layout : plan.tensors) {
    if (layout.sequence) split_on_tokens.insert(layout.tensor);
  }
  // Modules whose own layer gathers tokens inside the call and is reshaped after, with the
  // inputs of those layers (what they gather is not a length read).
  std::map<std::string, std::set<int>> gathered_inside;
  for (const LayerDecision& d : plan.layers) {
    const Node& layer = graph.nodes[d.node];
    const std::string module = parent_of(layer.label);
    const auto call = calls.find(module);
    if (d.sequence != "gather" || call == calls.end() || !reshaped_inside(graph, d.node, call->second)) continue;
    gathered_inside[module].insert(layer.inputs.at(0));
  }
  std::vector<LengthRead> found;
  for (const ModuleEntry& entry : graph.entries) {
    const auto module = gathered_inside.find(entry.module);
    if (entry.module.empty() || module == gathered_inside.end() || module->second.count(entry.tensor)) continue;
    const LengthRead read{entry.module, entry.tensor};
    if (split_on_tokens.count(entry.tensor) && std::find(found.begin(), found.end(), read) == found.end()) {
      found.push_back(read);
    }
  }
  return found;
}

void add_length_readers(Graph& graph, const std::vector<LengthRead>& reads) {
  for (const LengthRead& read : reads) {
    TensorInfo reading;
    reading.shape = {1};
    reading.known = true;
    graph.tensors.push_back(reading);
    Node reader;
    reader.kind = Kind::Opaque;
    reader.label = "<tokens read by " + read.module + ">";
    reader.inputs = {read.tensor};
    reader.outputs = {static_cast<int>(graph.tensors.size()) - 1};
    reader.length_read_by = read.module;
    graph.nodes.push_back(std::move(reader));
  }
}

}  // namespace autoshard::plan
