#pragma once
// Turning the last, settled pass into a Plan (emit.cpp).
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

Plan emit_plan(const Graph& graph, Propagation& pass, const std::vector<Why>& why, int64_t world_size);

}  // namespace autoshard::plan
