#include "comm/collective_ops.h"

#include "split/split.h"

namespace autoshard::comm {

c10d::ReduceOp::RedOpType checked_reduce_op(c10::string_view reduce_op, const char* op) {
  const bool max = reduce_op == "max";
  TORCH_CHECK_VALUE(max || reduce_op == "sum", op, ": reduce_op must be 'sum' or 'max', got '",
                    std::string(reduce_op), "'");
  return max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
}

void check_sizes(c10::IntArrayRef sizes, const c10d::ProcessGroup& group, const char* op) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(sizes.size()) == group.getSize(), op,
                    ": sizes must hold one size per rank of the group (", group.getSize(), "), got ",
                    sizes.size());
  for (size_t r = 0; r < sizes.size(); ++r) {
    TORCH_CHECK_VALUE(sizes[r] >= 0, op, ": sizes must be >= 0, got sizes[", r, "] = ", sizes[r]);
  }
}

int64_t checked_uneven_gather_dim(const at::Tensor& x, int64_t dim, c10::IntArrayRef sizes,
                                  const c10d::ProcessGroup& group) {
  check_sizes(sizes, group, "all_gather_uneven");
  const int64_t d = checked_split_dim(x, dim, "all_gather_uneven", "x");
  const int64_t rank = group.getRank();
  const int64_t got = x.sym_size(d).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(got == sizes[rank], "all_gather_uneven: x must hold sizes[", rank, "] = ", sizes[rank],
                    " elements along dim ", dim, ", got ", got);
  return d;
}

void check_uneven_scatter(const at::Tensor& x, c10::IntArrayRef sizes, const c10d::ProcessGroup& group) {
  check_sizes(sizes, group, "reduce_scatter_uneven");
  TORCH_CHECK_VALUE(x.dim() == 1, "reduce_scatter_uneven: x must be 1-d, got ", x.dim(), " dims");
  int64_t total = 0;
  for (const int64_t s : sizes) total += s;
  const int64_t got = x.sym_size(0).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(got == total, "reduce_scatter_uneven: x must hold sum(sizes) = ", total, " elements, got ", got);
}

int64_t checked_bucket_numel(at::TensorList tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "all_reduce_bucket: tensors must not be empty");
  int64_t numel = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == tensors[0].device(), "all_reduce_bucket: tensors[", i, "] is on ",
                      tensors[i].device(), ", tensors[0] on ", tensors[0].device());
    TORCH_CHECK_TYPE(tensors[i].scalar_type() == tensors[0].scalar_type(), "all_reduce_bucket: tensors[", i,
                     "] has dtype ", tensors[i].scalar_type(), ", tensors[0] ", tensors[0].scalar_type());
    numel += tensors[i].sym_numel().guard_int(__FILE__, __LINE__);
  }
  return numel;
}

void check_src(int64_t src, const c10d::ProcessGroup& group) {
  TORCH_CHECK_VALUE(0 <= src && src < group.getSize(), "broadcast_: src must be a rank in [0, ", group.getSize(),
                    "), got ", src);
}

}  // namespace autoshard::comm
