// Layers that split only together (an attention's projections into and out of its heads): a
// column layer then a row layer, or both whole; anything between would split one side alone.
#include "plan/passes/settling.h"

namespace autoshard::plan {

bool replicate_unpaired_layers(Settling& state, Propagation& pass) {
  const Graph& graph = state.graph;
  bool changed = false;
  for (const auto& [first, second] : graph.together) {
    const Style a = pass.roles[first], b = pass.roles[second];
    if ((a == Style::Column && b == Style::Row) || (a == Style::Replicate && b == Style::Replicate)) continue;
    const Why unpaired{"attention_unpaired", "replicated: " + graph.nodes[first].label + " and " +
                                                 graph.nodes[second].label + " split only together, by heads "
                                                 "(column, then row), which this model's dataflow does not allow"};
    changed |= state.force(first, Force::Replicate, unpaired);
    changed |= state.force(second, Force::Replicate, unpaired);
  }
  return changed;
}

}  // namespace autoshard::plan
