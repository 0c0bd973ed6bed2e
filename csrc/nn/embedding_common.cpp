// Device-independent pieces of the vocab-parallel embedding family: argument checks and shapes.
#include "nn/embedding.h"

namespace autoshard {

namespace {

void check_ids(const at::Tensor& ids, const char* op) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op,
                   ": ids must be an integer tensor (int64 or int32), got ", ids.scalar_type());
}

}  // namespace

void check_lookup_args(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                       int64_t vocab_size) {
  constexpr const char* op = "vocab_parallel_lookup";
  check_ids(ids, op);
  TORCH_CHECK_VALUE(weight.dim() == 2, op, ": weight must be a 2-d table [rows, embedding_dim], got a ",
                    weight.dim(), "-d tensor");
  TORCH_CHECK_VALUE(ids.device() == weight.device(), op, ": ids and weight must be on the same device, got ",
                    ids.device(), " and ", weight.device());
  TORCH_CHECK_VALUE(vocab_size >= 0, op, ": vocab_size must be >= 0, got ", vocab_size);
  // A symbolic row count is asserted, not specialised: tables of any size share one graph.
  const c10::SymInt end = weight.sym_size(0) + vocab_start;
  TORCH_CHECK_VALUE(vocab_start >= 0 && end.sym_le(vocab_size).expect_true(__FILE__, __LINE__), op,
                    ": the local rows [vocab_start, vocab_start + weight.size(0)) = [", vocab_start, ", ", end,
                    ") must lie inside the vocabulary [0, vocab_size) = [0, ", vocab_size, ")");
  TORCH_CHECK_VALUE(padding_idx == -1 || (padding_idx >= 0 && padding_idx < vocab_size), op,
                    ": padding_idx must be a global row in [0, vocab_size) = [0, ", vocab_size,
                    ") or -1 for none, got ", padding_idx);
}

void check_lookup_backward_args(const at::Tensor& grad, const at::Tensor& ids, const c10::SymInt& num_rows,
                                int64_t vocab_start, int64_t padding_idx) {
  constexpr const char* op = "vocab_parallel_lookup_backward";
  check_ids(ids, op);
  TORCH_CHECK_TYPE(at::isFloatingType(grad.scalar_type()), op, ": grad must be a floating-point tensor, got ",
                   grad.scalar_type());
  TORCH_CHECK_VALUE(grad.dim() == ids.dim() + 1, op, ": grad must have shape ids.shape + [embedding_dim] (",
                    ids.dim() + 1, " dims), got ", grad.dim(), " dims");
  for (int64_t d = 0; d < ids.dim(); ++d) {
    TORCH_CHECK_VALUE(grad.sym_size(d) == ids.sym_size(d), op,
                      ": grad must have shape ids.shape + [embedding_dim], got grad ", grad.sym_sizes(), " for ids ",
                      ids.sym_sizes());
  }
  TORCH_CHECK_VALUE(grad.device() == ids.device(), op, ": grad and ids must be on the same device, got ",
                    grad.device(), " and ", ids.device());
  TORCH_CHECK_VALUE(num_rows.sym_ge(0).expect_true(__FILE__, __LINE__), op, ": num_rows must be >= 0, got ",
                    num_rows);
  TORCH_CHECK_VALUE(vocab_start >= 0, op, ": vocab_start must be >= 0, got ", vocab_start);
  TORCH_CHECK_VALUE(padding_idx >= -1, op, ": padding_idx must be a global row or -1 for none, got ", padding_idx);
}

std::vector<c10::SymInt> lookup_output_shape(const at::Tensor& ids, const at::Tensor& weight) {
  std::vector<c10::SymInt> shape = ids.sym_sizes().vec();
  shape.push_back(weight.sym_size(1));
  return shape;
}

}  // namespace autoshard
