// Meta kernels of the vocab-parallel embedding: shapes only, symbolic sizes kept symbolic.
#include <torch/library.h>

#include "nn/embedding.h"

namespace autoshard {
namespace {

at::Tensor lookup_meta(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                       int64_t vocab_size) {
  check_lookup_args(ids, weight, vocab_start, padding_idx, vocab_size);
  return at::empty_symint(lookup_output_shape(ids, weight),
                          weight.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor lookup_backward_meta(const at::Tensor& grad, const at::Tensor& ids, c10::SymInt num_rows,
                                int64_t vocab_start, int64_t padding_idx) {
  check_lookup_backward_args(grad, ids, num_rows, vocab_start, padding_idx);
  return at::empty_symint({std::move(num_rows), grad.sym_size(-1)},
                          grad.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("vocab_parallel_lookup", &lookup_meta);
  m.impl("vocab_parallel_lookup_backward", &lookup_backward_meta);
}

}  // namespace autoshard
