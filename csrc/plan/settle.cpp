// Settling the decisions: passes repeat, each forcing the layers whose regions cannot be
// split (replicated) or must end in a gather, until no decision changes. The reason code
// given to a forced layer (LayerDecision::reason) is one of reasons.cpp's table. The passes
// are in plan/passes/, one to a file.
#include <c10/util/Exception.h>

#include "plan/passes/settling.h"

namespace autoshard::plan {

Plan make_plan(const Graph& graph, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size > 0, "[plan.world_size] plan: world_size must be a positive integer, got ", world_size);
  Settling state(graph, world_size);
  for (size_t iteration = 0;; ++iteration) {
    TORCH_CHECK(iteration <= 2 * state.count + 1, "[plan.unsettled] plan: decisions did not settle");
    Propagation pass = state.run_pass();
    pass.settle_gradients();
    const bool params_changed = settle_head_params(state, pass);
    if (settle_cuts(state, pass) || params_changed) continue;
    if (replicate_feeders_of_called_layers(state, pass)) continue;
    if (hold_small_parts_whole(state, pass)) continue;
    // Regions forced here change what the layers sharing a weight see in the next pass (a layer
    // fed by a column layer that is now replicated becomes a column layer itself): the shared
    // weights are judged once the regions are settled, or ALBERT's one layer, called by every
    // block, would be replicated for what its first call saw.
    if (force_unsplit_regions(state, pass)) continue;
    bool changed = replicate_disagreeing_shared_weights(state, pass);
    changed |= replicate_unpaired_layers(state, pass);
    changed |= replicate_unsplit_functional_layers(state, pass);
    if (changed) continue;
    if (!graph.sequence_parallel || world_size == 1) return emit_plan(graph, pass, state.why, world_size);
    return settle_sequence_parallel(state);
  }
}

}  // namespace autoshard::plan
