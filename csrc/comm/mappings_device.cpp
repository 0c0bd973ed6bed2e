// CPU and CUDA kernels of the mappings: one host implementation serves both, since the
// group's backend picks the transport for the tensors' device and every other step is an
// ATen op on that device. Outputs are always new tensors (a custom op must not alias).
#include <torch/library.h>

#include "comm/collectives.h"
#include "comm/group.h"
#include "comm/mappings.h"
#include "split/split_rule.h"

namespace autoshard::comm {
namespace {

at::Tensor copy_to_parallel(const at::Tensor& x, c10::string_view group_name) {
  resolve_group(group_name, "copy_to_parallel");
  return x.clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_from_parallel(const at::Tensor& x, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "reduce_from_parallel");
  at::Tensor sum = x.clone(at::MemoryFormat::Contiguous);
  all_reduce_sum_(sum, *group);
  return sum;
}

at::Tensor gather_from_parallel(const at::Tensor& x, int64_t dim, int64_t length, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "gather_from_parallel");
  return all_gather_split(x, checked_gather_dim(x, dim, length, *group), length, *group);
}

at::Tensor scatter_to_parallel(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "scatter_to_parallel");
  const auto [d, piece] = checked_scatter_piece(x, dim, *group);
  return x.narrow(d, piece.start, piece.length).clone(at::MemoryFormat::Contiguous);
}

// The sum over the group of x, of which this rank keeps its split_sizes piece along `dim`.
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "reduce_scatter_to_sequence");
  [[maybe_unused]] const auto [d, piece] = checked_scatter_piece(x, dim, *group, "reduce_scatter_to_sequence");
  return reduce_scatter_along(x, d, split_sizes(x.size(d), group->getSize()), *group);
}

at::Tensor all_gather_from_sequence(const at::Tensor& x, int64_t dim, int64_t length, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "all_gather_from_sequence");
  return all_gather_split(x, checked_gather_dim(x, dim, length, *group, "all_gather_from_sequence"), length, *group);
}

void register_mapping_kernels(torch::Library& m) {
  m.impl("copy_to_parallel", &copy_to_parallel);
  m.impl("reduce_from_parallel", &reduce_from_parallel);
  m.impl("gather_from_parallel", &gather_from_parallel);
  m.impl("scatter_to_parallel", &scatter_to_parallel);
  m.impl("reduce_scatter_to_sequence", &reduce_scatter_to_sequence);
  m.impl("all_gather_from_sequence", &all_gather_from_sequence);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  register_mapping_kernels(m);
}

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  register_mapping_kernels(m);
}

}  // namespace autoshard::comm
