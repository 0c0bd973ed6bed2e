#pragma once
// The argument checks of the collective ops (all_reduce_, all_gather_uneven,
// reduce_scatter_uneven, all_reduce_bucket, broadcast_), shared by their device and Meta
// kernels, so that fake tensors fail exactly where real ones do.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace autoshard::comm {

// "sum" or "max".
c10d::ReduceOp::RedOpType checked_reduce_op(c10::string_view reduce_op, const char* op);

// One non-negative size per rank of `group`.
void check_sizes(c10::IntArrayRef sizes, const c10d::ProcessGroup& group, const char* op);

// all_gather_uneven: dim wrapped to be non-negative, x holding sizes[rank] elements there.
int64_t checked_uneven_gather_dim(const at::Tensor& x, int64_t dim, c10::IntArrayRef sizes,
                                  const c10d::ProcessGroup& group);

// reduce_scatter_uneven: x is 1-d with sum(sizes) elements.
void check_uneven_scatter(const at::Tensor& x, c10::IntArrayRef sizes, const c10d::ProcessGroup& group);

// all_reduce_bucket: the tensors share a device and a dtype; returns their total numel.
int64_t checked_bucket_numel(at::TensorList tensors);

// broadcast_: src is a rank of the group.
void check_src(int64_t src, const c10d::ProcessGroup& group);

}  // namespace autoshard::comm
