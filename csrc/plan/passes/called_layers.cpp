// A layer called several times (ALBERT's one layer, run by every block) is a row layer where a
// column layer feeds it and a column layer where its input is whole: the layers feeding its row
// call are replicated, so that every call splits the weight as a column layer. Only the first
// such call in the graph is settled per pass: later ones may follow from it.
#include "plan/passes/settling.h"

namespace autoshard::plan {

bool replicate_feeders_of_called_layers(Settling& state, Propagation& pass) {
  const Graph& graph = state.graph;
  bool changed = false;
  for (size_t n = 0; n < state.count && !changed; ++n) {
    if (pass.roles[n] != Style::Row) continue;
    bool column_elsewhere = false;
    for (int other : state.layers_of_param[graph.nodes[n].weight_param]) {
      column_elsewhere = column_elsewhere || pass.roles[other] == Style::Column;
    }
    if (!column_elsewhere) continue;
    // The column layer whose region the row call reads, before the pass united it with others
    // (a region it meets only because of this very mismatch).
    const int fed_by = pass.node_region[n];
    for (size_t m = 0; m < state.count; ++m) {
      if (pass.roles[m] != Style::Column || pass.node_region[m] != fed_by) continue;
      changed |= state.force(static_cast<int>(m), Force::Replicate,
                             {"feeds_called_layer", "replicated: it feeds a layer called elsewhere as a column layer (" +
                                                        graph.nodes[n].label + ")"});
    }
  }
  return changed;
}

}  // namespace autoshard::plan
