// Sequence parallelism over the settled roles: a region refused (see sequence.cpp) refuses the
// layers that start it, and the passes repeat until none is refused anew.
#include <map>
#include <set>
#include <string>

#include <c10/util/Exception.h>

#include "plan/passes/settling.h"

namespace autoshard::plan {

Plan settle_sequence_parallel(Settling& state) {
  const Graph& graph = state.graph;
  std::set<int> refused;
  std::map<int, std::string> refusals;
  std::map<int, int> entries;
  for (size_t round = 0;; ++round) {
    TORCH_CHECK(round <= 2 * (state.count + graph.tensors.size()) + 2,
                "[plan.unsettled] plan: sequence parallelism did not settle");
    Propagation pass = state.run_pass();
    pass.run_sequence(refused, entries);
    pass.settle_gradients();
    // The settled passes asked for every cut they rely on (a bias let through uncut would be wrong).
    for (const auto& [entry, factor] : pass.wanted_cuts) {
      TORCH_CHECK(state.cuts.count(entry), "[plan.unsettled] plan: a head cut was asked for after the cuts settled");
    }
    for (const auto& [node, factor] : pass.wanted_node_cuts) {
      TORCH_CHECK(state.node_cuts.count(node), "[plan.unsettled] plan: a head cut was asked for after the cuts settled");
    }
    for (const auto& [tensor, factor] : pass.wanted_head_params) {
      TORCH_CHECK(state.head_params.count(tensor),
                  "[plan.unsettled] plan: a head parameter was asked for after they settled");
    }
    bool more = false;
    for (const auto& [tensor, axis] : pass.wanted_entries) more |= entries.emplace(tensor, axis).second;
    if (more) continue;
    for (const auto& [tensor, entry] : pass.entry_of) {
      if (pass.regions[pass.find(pass.layouts[tensor].region)].conflict) {
        entries.erase(tensor);
        more = true;
      }
    }
    for (const auto& [n, role] : pass.sequence_roles) {
      if (role == SequenceRole::Gather || refused.count(n)) continue;
      const Region& region = pass.regions[pass.find(pass.sequence_region.at(n))];
      if (region.conflict) {
        refused.insert(n);
        refusals[n] = region.reason;
        more = true;
      }
    }
    if (!more) return emit_plan(graph, pass, state.why, state.world_size, refusals);
  }
}

}  // namespace autoshard::plan
