// Head parameters (constructs/head_params.cpp): a split is kept while the heads it joins are split,
// and dropped for good with why once not, so that the attention stays whole saying why. A pass that
// split new parameters (or dropped some) judged their reads whole: nothing else is forced on it.
#include <string>

#include "plan/passes/settling.h"

namespace autoshard::plan {

bool settle_head_params(Settling& state, Propagation& pass) {
  bool changed = false;
  for (const auto& [tensor, region] : pass.head_param_region) {
    const int root = pass.find(region);
    bool meets_layer = false;
    for (size_t n = 0; n < state.count; ++n) {
      meets_layer = meets_layer || (pass.roles[n] == Style::Column && pass.find(pass.node_region[n]) == root);
    }
    std::string why;
    if (pass.regions[root].conflict) {
      why = "with it split, " + pass.regions[root].reason;
    } else if (!meets_layer) {
      why = "the heads it meets are not split by any layer";
    } else if (pass.kv_fine.count(root)) {
      why = "its heads are KV heads that several ranks hold";
    }
    if (!why.empty()) {
      state.head_params.erase(tensor);
      state.dropped_head_params[tensor] = why;
      changed = true;
    }
  }
  for (const auto& [tensor, factor] : pass.wanted_head_params) {
    if (!state.head_params.count(tensor) && !state.dropped_head_params.count(tensor)) {
      state.head_params[tensor] = factor;
      state.head_param_sources[tensor] = pass.wanted_head_param_sources.at(tensor);
      changed = true;
    }
  }
  return changed;
}

}  // namespace autoshard::plan
