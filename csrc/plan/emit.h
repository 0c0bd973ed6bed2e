#pragma once
// Turning the last, settled pass into a Plan (emit.cpp).
#include <map>
#include <string>
#include <vector>

#include "plan/propagation.h"

namespace autoshard::plan {

// Why a layer was forced away from its natural style: a code and the same in words.
struct Why {
  std::string reason;
  std::string note;
  int64_t whole_units = 0;
};

// `sequence_refused`: layers that could start a sequence region, and why they do not.
Plan emit_plan(const Graph& graph, Propagation& pass, const std::vector<Why>& why, int64_t world_size,
               const std::map<int, std::string>& sequence_refused = {});

}  // namespace autoshard::plan
