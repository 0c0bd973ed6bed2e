#pragma once
// The four mappings of tensor parallelism (Megatron's f, g and their gather/scatter pair),
// each the other's gradient:
//   copy_to_parallel      forward identity           backward all-reduce (sum)
//   reduce_from_parallel  forward all-reduce (sum)   backward identity
//   gather_from_parallel  forward all-gather         backward this rank's piece
//   scatter_to_parallel   forward this rank's piece  backward all-gather
// and sequence parallelism's pair, along a token axis:
//   reduce_scatter_to_sequence  forward reduce-scatter   backward all-gather
//   all_gather_from_sequence    forward all-gather       backward reduce-scatter
// Pieces follow split_sizes, so a gather or scatter of any length works on any group size.
// The argument checks below are shared by the device and Meta kernels, so fake tensors
// fail exactly where real ones do.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "split/split_rule.h"

namespace autoshard::comm {

// Checks gather_from_parallel's arguments against `group` (length >= 0, dim in range, the
// local size along dim equal to this rank's split size of length); returns dim wrapped to
// be non-negative.
int64_t checked_gather_dim(const at::Tensor& x, int64_t dim, int64_t length, const c10d::ProcessGroup& group,
                           const char* function = "gather_from_parallel");

// The wrapped dim and this rank's piece of x along it, for scatter_to_parallel.
std::pair<int64_t, Range> checked_scatter_piece(const at::Tensor& x, int64_t dim, const c10d::ProcessGroup& group,
                                                const char* function = "scatter_to_parallel");

}  // namespace autoshard::comm
