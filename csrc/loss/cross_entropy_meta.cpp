// Meta kernels of the vocab-parallel cross-entropy: shapes only, symbolic sizes kept symbolic.
// The group is still resolved, so that a bad name is reported while tracing, as when running.
#include <torch/library.h>

#include "comm/group.h"
#include "loss/cross_entropy.h"

namespace autoshard::loss {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_meta(const at::Tensor& logits, const at::Tensor& labels,
                                                            c10::string_view group_name, int64_t ignore_index,
                                                            double label_smoothing, c10::string_view reduction) {
  const Reduction parsed = check_forward_args(logits, labels, label_smoothing, reduction);
  comm::resolve_group(group_name, "vocab_parallel_cross_entropy");
  const c10::SymInt rows = labels.sym_numel();
  std::vector<c10::SymInt> loss_shape;
  if (parsed == Reduction::kNone) loss_shape.push_back(rows);
  return {at::empty_symint(loss_shape, logits.options().memory_format(at::MemoryFormat::Contiguous)),
          at::empty_symint({rows}, logits.options().dtype(accumulate_type(logits.scalar_type()))),
          at::empty({2}, logits.options().dtype(at::kLong))};
}

at::Tensor backward_meta(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                         const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction) {
  check_backward_args(grad_loss, logits, labels, lse, vocab_range, label_smoothing, reduction);
  return at::empty_symint(logits.sym_sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("vocab_parallel_cross_entropy", &forward_meta);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_meta);
}

}  // namespace autoshard::loss
