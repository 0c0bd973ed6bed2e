#pragma once
// The two collectives the mappings need, issued on the group's backend for the tensors'
// device (gloo on CPU; NCCL, or gloo, on CUDA) and waited for before returning. On CUDA,
// NCCL's wait only orders the current stream after the collective: the host does not block
// and no data passes through host memory. A group of one issues nothing.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace autoshard::comm {

// Sums the contiguous `tensor` over the group, in place.
void all_reduce_sum_(at::Tensor& tensor, c10d::ProcessGroup& group);

// Concatenates along `dim` the pieces of all ranks, rank r holding split_sizes(length,
// world)[r] elements there. Pieces are padded to the largest for the collective and unpadded
// after it. The result is a new contiguous tensor.
at::Tensor all_gather_uneven(const at::Tensor& local, int64_t dim, int64_t length, c10d::ProcessGroup& group);

}  // namespace autoshard::comm
