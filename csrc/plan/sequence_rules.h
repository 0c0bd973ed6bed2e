#pragma once
// Rules on a made plan's sequence regions that only the module calls around them can decide
// (each module's first call, its node range, the tensors it received and returned). Each may
// send the graph back to be planned again; plan_model (replan.cpp) repeats until none does.
#include <optional>
#include <string>
#include <vector>

#include "plan/graph.h"
#include "plan/planner.h"

namespace autoshard::plan {

// Column layers reading tokens through ops that index the token axis get them gathered where a
// module returns them (token_indexing.cpp): their role becomes "gathered", the gather a
// sequence_exits record, the tensors in between whole. Returns why no such place exists, in
// which case `plan` is left as it was and sequence parallelism must be given up.
std::optional<std::string> gather_before_token_indexing(const Graph& graph, Plan& plan);

// A tensor a module receives split over the tokens whose count it may read (length_reads.cpp).
struct LengthRead {
  std::string module;
  int tensor = -1;
};

bool operator==(const LengthRead& a, const LengthRead& b);

// The module inputs split over the tokens where the module's own layer gathers tokens inside its
// call and reshapes that layer's output, with a length it may have read from such an input.
std::vector<LengthRead> split_inputs_gathered_inside(const Graph& graph, const Plan& plan);

// Gives each read an opaque reader, which no sequence region passes: the input stays whole.
void add_length_readers(Graph& graph, const std::vector<LengthRead>& reads);

}  // namespace autoshard::plan
