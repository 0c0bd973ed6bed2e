#pragma once
// Every collective autoshard issues, on the group's backend for the tensors' device (gloo on
// CPU; NCCL, or gloo, on CUDA), and counted where it is issued. Unless said otherwise each
// one is waited for before returning. On CUDA, NCCL's wait only orders the current stream
// after the collective: the host does not block and no data passes through host memory.
// A group of one issues nothing.
//
// Uneven pieces (rank r holding sizes[r] elements) go over the wire padded to the largest
// one; the padding is added and dropped here, and nowhere else. On gloo the reduce-scatters and
// all-gathers go as rings of point-to-point transfers instead (ring.h), which need no padding.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace autoshard::comm {

// Sums (or takes the maximum of) the contiguous `tensor` over the group, in place.
void all_reduce_(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, c10d::ProcessGroup& group);
inline void all_reduce_sum_(at::Tensor& tensor, c10d::ProcessGroup& group) {
  all_reduce_(tensor, c10d::ReduceOp::SUM, group);
}

// Concatenates along `dim` the pieces of all ranks, rank r holding sizes[r] elements there.
// The result is a new contiguous tensor.
at::Tensor all_gather_uneven(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes,
                             c10d::ProcessGroup& group);

// The same for pieces that follow split_sizes(length, world).
at::Tensor all_gather_split(const at::Tensor& local, int64_t dim, int64_t length, c10d::ProcessGroup& group);

// `flat` (1-d) holds every rank's piece back to back, rank r's of sizes[r] elements; returns
// this rank's piece of the sum over the group. With `async_op` the collective is only
// started: the result is registered with c10d, to be waited for with wait_tensor.
at::Tensor reduce_scatter_uneven(const at::Tensor& flat, const std::vector<int64_t>& sizes,
                                 c10d::ProcessGroup& group, bool async_op);

// This rank's piece along `dim` (sizes[rank] there) of the sum over the group of x, whose pieces
// along `dim` are sizes[0], sizes[1], ...; a new contiguous tensor.
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes,
                                c10d::ProcessGroup& group);

// The tensors flattened into one new 1-d buffer, summed over the group (started only with
// `async_op`, as above).
at::Tensor all_reduce_bucket(at::TensorList tensors, c10d::ProcessGroup& group, bool async_op);

// Rank `src`'s contiguous `tensor` on every rank, in place.
void broadcast_(at::Tensor& tensor, int64_t src, c10d::ProcessGroup& group);

}  // namespace autoshard::comm
