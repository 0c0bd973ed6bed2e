// A layer whose weight the model multiplies itself is exact only as a column layer: its local
// rows give this rank's channels. As a row layer (its input split) the sum over the ranks its
// call would take never runs. Its bias, added by the model apart, must be split with those
// channels wherever it is read.
#include "plan/passes/settling.h"

namespace autoshard::plan {

bool replicate_unsplit_functional_layers(Settling& state, Propagation& pass) {
  const Graph& graph = state.graph;
  bool changed = false;
  for (size_t n = 0; n < state.count; ++n) {
    const Node& node = graph.nodes[n];
    if (!is_layer(node) || !node.functional) continue;
    const Style role = pass.roles[n];
    const int layer = static_cast<int>(n);
    if (role != Style::Column && role != Style::Replicate) {
      changed |= state.force(layer, Force::Replicate,
                             {"functional_layer", "replicated: the model multiplies its weight itself, so it is split "
                                                  "only as a column layer, and its input is split"});
    } else if (role == Style::Column && state.functional_biases.count(node.bias_param)) {
      for (size_t t = 0; t < graph.tensors.size(); ++t) {
        if (graph.tensors[t].param != node.bias_param || state.head_params.count(static_cast<int>(t))) continue;
        changed |= state.force(layer, Force::Replicate,
                               {"functional_layer", "replicated: the model multiplies its weight itself and adds its "
                                                    "bias apart, which is read where it cannot be split with the "
                                                    "layer's channels"});
      }
    }
  }
  return changed;
}

}  // namespace autoshard::plan
