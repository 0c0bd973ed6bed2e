// CPU and CUDA kernels of the collective ops: the group's backend picks the transport for the
// tensors' device, so one host implementation serves both.
#include <torch/library.h>

#include "comm/collective_ops.h"
#include "comm/collectives.h"
#include "comm/group.h"

namespace autoshard::comm {
namespace {

// Runs the in-place collective `run` on x, through a contiguous copy when x is not contiguous.
template <typename Run>
void on_contiguous(at::Tensor& x, Run run) {
  if (x.is_contiguous()) {
    run(x);
    return;
  }
  at::Tensor contiguous = x.contiguous();
  run(contiguous);
  x.copy_(contiguous);
}

void all_reduce_op(at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "all_reduce_");
  const auto op = checked_reduce_op(reduce_op, "all_reduce_");
  on_contiguous(x, [&](at::Tensor& t) { all_reduce_(t, op, *group); });
}

at::Tensor all_gather_uneven_op(const at::Tensor& x, int64_t dim, c10::IntArrayRef sizes,
                                c10::string_view group_name) {
  const auto group = resolve_group(group_name, "all_gather_uneven");
  const int64_t d = checked_uneven_gather_dim(x, dim, sizes, *group);
  return all_gather_uneven(x, d, sizes.vec(), *group);
}

at::Tensor reduce_scatter_uneven_op(const at::Tensor& x, c10::IntArrayRef sizes, c10::string_view group_name,
                                    bool async_op) {
  const auto group = resolve_group(group_name, "reduce_scatter_uneven");
  check_uneven_scatter(x, sizes, *group);
  return reduce_scatter_uneven(x, sizes.vec(), *group, async_op);
}

at::Tensor all_reduce_bucket_op(at::TensorList tensors, c10::string_view group_name, bool async_op) {
  const auto group = resolve_group(group_name, "all_reduce_bucket");
  checked_bucket_numel(tensors);
  return all_reduce_bucket(tensors, *group, async_op);
}

void broadcast_op(at::Tensor& x, int64_t src, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "broadcast_");
  check_src(src, *group);
  on_contiguous(x, [&](at::Tensor& t) { broadcast_(t, src, *group); });
}

void register_collective_kernels(torch::Library& m) {
  m.impl("all_reduce_", &all_reduce_op);
  m.impl("all_gather_uneven", &all_gather_uneven_op);
  m.impl("reduce_scatter_uneven", &reduce_scatter_uneven_op);
  m.impl("all_reduce_bucket", &all_reduce_bucket_op);
  m.impl("broadcast_", &broadcast_op);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  register_collective_kernels(m);
}

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  register_collective_kernels(m);
}

}  // namespace autoshard::comm
