// A fused layer whose parts differ (query heads beside one KV head) and whose region cannot be
// split whole is tried once with its smaller parts held whole on every rank, before anything
// else is forced: what else conflicts now may follow from its split parts.
#include <algorithm>
#include <functional>

#include "plan/passes/settling.h"

namespace autoshard::plan {

bool hold_small_parts_whole(Settling& state, Propagation& pass) {
  bool changed = false;
  for (size_t n = 0; n < state.count; ++n) {
    const int node = static_cast<int>(n);
    const auto fused = pass.parts.find(node);
    if (pass.roles[n] != Style::Column || fused == pass.parts.end() || state.graph.nodes[n].kind != Kind::Linear ||
        state.forced[node] != Force::None) {
      continue;
    }
    const Region& region = pass.regions[pass.find(pass.node_region[n])];
    const bool unequal = std::adjacent_find(fused->second.begin(), fused->second.end(),
                                            std::not_equal_to<int64_t>()) != fused->second.end();
    if (!unequal || !(region.conflict || region.units < state.world_size)) continue;
    state.known_parts[node] = fused->second;
    changed |= state.force(node, Force::WholeSmallParts,
                           {"small_parts_whole", "split by heads; its smaller parts (KV heads) are held whole on every "
                                                 "rank, their gradient summed"});
  }
  if (changed) {
    // The cuts its split parts met were judged against a pass where every part was split:
    // they may be asked for again (once per such layer, so the passes still settle).
    state.dropped_cuts.clear();
    state.dropped_node_cuts.clear();
  }
  return changed;
}

}  // namespace autoshard::plan
