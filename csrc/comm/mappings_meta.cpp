// Meta kernels of the mappings: shapes only. The group is still resolved, so that a bad
// name or a misshapen piece is reported while tracing, as it would be when running.
#include <torch/library.h>

#include "comm/group.h"
#include "comm/mappings.h"

namespace autoshard::comm {
namespace {

at::Tensor copy_to_parallel_meta(const at::Tensor& x, c10::string_view group_name) {
  resolve_group(group_name, "copy_to_parallel");
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

at::Tensor reduce_from_parallel_meta(const at::Tensor& x, c10::string_view group_name) {
  resolve_group(group_name, "reduce_from_parallel");
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

at::Tensor resized_along(const at::Tensor& x, int64_t dim, int64_t size) {
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  shape[dim] = size;
  return at::empty_symint(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor gather_from_parallel_meta(const at::Tensor& x, int64_t dim, int64_t length, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "gather_from_parallel");
  return resized_along(x, checked_gather_dim(x, dim, length, *group), length);
}

at::Tensor scatter_to_parallel_meta(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "scatter_to_parallel");
  const auto [d, piece] = checked_scatter_piece(x, dim, *group);
  return resized_along(x, d, piece.length);
}

at::Tensor reduce_scatter_to_sequence_meta(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "reduce_scatter_to_sequence");
  const auto [d, piece] = checked_scatter_piece(x, dim, *group, "reduce_scatter_to_sequence");
  return resized_along(x, d, piece.length);
}

at::Tensor all_gather_from_sequence_meta(const at::Tensor& x, int64_t dim, int64_t length, c10::string_view group_name) {
  const auto group = resolve_group(group_name, "all_gather_from_sequence");
  return resized_along(x, checked_gather_dim(x, dim, length, *group, "all_gather_from_sequence"), length);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("copy_to_parallel", &copy_to_parallel_meta);
  m.impl("reduce_from_parallel", &reduce_from_parallel_meta);
  m.impl("gather_from_parallel", &gather_from_parallel_meta);
  m.impl("scatter_to_parallel", &scatter_to_parallel_meta);
  m.impl("reduce_scatter_to_sequence", &reduce_scatter_to_sequence_meta);
  m.impl("all_gather_from_sequence", &all_gather_from_sequence_meta);
}

}  // namespace autoshard::comm
