// Meta kernels of the collective ops: shapes only, after the same checks as the device kernels.
#include <torch/library.h>

#include "comm/collective_ops.h"
#include "comm/group.h"

namespace autoshard::comm {
namespace {

void all_reduce_meta(at::Tensor& x, c10::string_view reduce_op, c10::string_view group_name) {
  resolve_group(group_name, "all_reduce_");
  checked_reduce_op(reduce_op, "all_reduce_");
}

at::Tensor all_gather_uneven_meta(const at::Tensor& x, int64_t dim, c10::IntArrayRef sizes,
                                  c10::string_view group_name) {
  const auto group = resolve_group(group_name, "all_gather_uneven");
  const int64_t d = checked_uneven_gather_dim(x, dim, sizes, *group);
  std::vector<c10::SymInt> shape = x.sym_sizes().vec();
  int64_t length = 0;
  for (const int64_t s : sizes) length += s;
  shape[d] = length;
  return at::empty_symint(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor reduce_scatter_uneven_meta(const at::Tensor& x, c10::IntArrayRef sizes, c10::string_view group_name,
                                      bool async_op) {
  const auto group = resolve_group(group_name, "reduce_scatter_uneven");
  check_uneven_scatter(x, sizes, *group);
  return at::empty({sizes[group->getRank()]}, x.options());
}

at::Tensor all_reduce_bucket_meta(at::TensorList tensors, c10::string_view group_name, bool async_op) {
  resolve_group(group_name, "all_reduce_bucket");
  return at::empty({checked_bucket_numel(tensors)}, tensors[0].options());
}

void broadcast_meta(at::Tensor& x, int64_t src, c10::string_view group_name) {
  check_src(src, *resolve_group(group_name, "broadcast_"));
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("all_reduce_", &all_reduce_meta);
  m.impl("all_gather_uneven", &all_gather_uneven_meta);
  m.impl("reduce_scatter_uneven", &reduce_scatter_uneven_meta);
  m.impl("all_reduce_bucket", &all_reduce_bucket_meta);
  m.impl("broadcast_", &broadcast_meta);
}

}  // namespace autoshard::comm
