#pragma once
// Sequence cuts' records, which the token-indexing rule (token_indexing.cpp) also makes.
#include <string>

#include "plan/records.h"

namespace autoshard::plan {

// Where a tensor is cut to this rank's tokens, or gathered whole, at a module call: the tensor,
// the module, its place among the call's flattened inputs (or outputs), its token axis and its
// sequence region.
Record sequence_cut(int tensor, const std::string& module, int leaf, int dim, int region);

// Tensors gathered whole where a module returns them, for column layers reading them through ops
// that index the token axis.
constexpr const char* kSequenceExits = "sequence_exits";

}  // namespace autoshard::plan
