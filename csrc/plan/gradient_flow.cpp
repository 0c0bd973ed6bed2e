#include "plan/gradient_flow.h"

#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

// Node kinds whose outputs may share memory with their first input.
bool aliases(Kind kind) {
  return kind == Kind::View || kind == Kind::Permute || kind == Kind::Expand || kind == Kind::Slice ||
         kind == Kind::Split;
}

}  // namespace

GradientFlow gradient_flow(const Graph& graph) {
  const size_t count = graph.tensors.size();
  GradientFlow flow;
  flow.requires_grad.assign(count, false);
  flow.reaches_output.assign(count, false);
  for (size_t t = 0; t < count; ++t) {
    const TensorInfo& info = graph.tensors[t];
    flow.requires_grad[t] = info.param >= 0 && info.trainable;
    flow.reaches_output[t] = info.is_output;
  }
  std::vector<std::vector<int>> producers(count), linked(count);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    bool reached = is_layer(node) && node.trainable;
    for (int id : node.inputs) reached = reached || flow.requires_grad[id];
    reached = reached && !node.no_grad;
    for (int id : node.outputs) {
      flow.requires_grad[id] = flow.requires_grad[id] || (reached && graph.tensors[id].floating);
      producers[id].push_back(static_cast<int>(n));
      if (aliases(node.kind) && !node.inputs.empty()) {
        linked[id].push_back(node.inputs[0]);
        linked[node.inputs[0]].push_back(id);
      }
    }
  }
  std::vector<int> pending;
  for (size_t t = 0; t < count; ++t) {
    if (flow.reaches_output[t]) pending.push_back(static_cast<int>(t));
  }
  auto reach = [&](int id) {
    if (!flow.reaches_output[id]) {
      flow.reaches_output[id] = true;
      pending.push_back(id);
    }
  };
  while (!pending.empty()) {
    const int tensor = pending.back();
    pending.pop_back();
    // No gradient flows back through an integer or bool tensor (top-k indices, a mask): what it
    // is computed from is not reached through it.
    if (!graph.tensors[tensor].floating) continue;
    for (int other : linked[tensor]) reach(other);
    for (int n : producers[tensor]) {
      if (graph.nodes[n].no_grad) continue;  // computed without a graph: backward stops at its output
      for (int id : graph.nodes[n].inputs) reach(id);
    }
  }
  return flow;
}

}  // namespace autoshard::plan
