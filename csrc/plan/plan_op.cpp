// The planner as an op: a JSON graph document in, a JSON plan out (see graph.h and emit.cpp for
// both formats). It takes no tensors, so it is registered for every backend at once.
#include "plan/plan_op.h"

#include "plan/graph.h"
#include "plan/planner.h"

namespace autoshard::plan {

std::string plan_graph(const std::string& graph, int64_t world_size) {
  return plan_to_json(plan_model(parse_graph(graph), world_size));
}

}  // namespace autoshard::plan
