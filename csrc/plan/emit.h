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

// One more collective of `kind` in `phase`, of `elements` elements, in the plan's counts.
void count_collective(Plan& plan, const char* phase, const char* kind, int64_t elements);

// Names each region's module and, where its layers sit in several attentions, each
// attention's (region_modules.cpp).
void name_region_modules(const Graph& graph, Plan& plan);

}  // namespace autoshard::plan
