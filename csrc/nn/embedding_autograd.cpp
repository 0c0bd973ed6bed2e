// Autograd of the vocab-parallel lookup: only the table is differentiable (ids are integers),
// and its gradient is the backward op's dense accumulation into the local rows. The backward
// op is linear in `grad`, so its own gradient (double backward) is a masked gather of rows.
#include <torch/autograd.h>
#include <torch/library.h>

#include "nn/embedding.h"

namespace autoshard {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LookupFunction : public torch::autograd::Function<LookupFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ids, const at::Tensor& weight,
                            int64_t vocab_start, int64_t padding_idx, int64_t vocab_size) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("autoshard::vocab_parallel_lookup", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
    ctx->save_for_backward({ids});
    ctx->saved_data["num_rows"] = weight.sym_size(0);
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["padding_idx"] = padding_idx;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(ids, weight, vocab_start, padding_idx, vocab_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("autoshard::vocab_parallel_lookup_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, int64_t, int64_t)>();
    const at::Tensor ids = ctx->get_saved_variables()[0];
    const at::Tensor grad_weight =
        op.call(grads[0], ids, ctx->saved_data["num_rows"].toSymInt(), ctx->saved_data["vocab_start"].toInt(),
                ctx->saved_data["padding_idx"].toInt());
    return {at::Tensor(), grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// d(backward)/d(grad) applied to `grad_table`: each token gets its held row of grad_table, and
// tokens of rows not held or of padding_idx get zeros. Composed of ATen ops, so it is itself
// differentiable.
at::Tensor gather_held_rows(const at::Tensor& grad_table, const at::Tensor& ids, int64_t vocab_start,
                            int64_t padding_idx) {
  std::vector<c10::SymInt> shape = ids.sym_sizes().vec();
  shape.push_back(grad_table.sym_size(1));
  const at::Tensor local = ids.to(at::kLong) - vocab_start;
  const c10::SymInt rows = grad_table.sym_size(0);
  const at::Tensor held = local.ge(0).logical_and(local.lt(rows)).logical_and(ids.ne(padding_idx));
  // With no rows held every token gets zeros (and there is no row to clamp into).
  if (rows.sym_eq(0).guard_bool(__FILE__, __LINE__)) return at::zeros_symint(shape, grad_table.options());
  const at::Tensor rows_of_tokens = local.clamp(0, rows - 1).reshape({-1});
  return grad_table.index_select(0, rows_of_tokens).reshape_symint(shape) * held.unsqueeze(-1).to(grad_table.dtype());
}

class LookupBackwardFunction : public torch::autograd::Function<LookupBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& ids, c10::SymInt num_rows,
                            int64_t vocab_start, int64_t padding_idx) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("autoshard::vocab_parallel_lookup_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, int64_t, int64_t)>();
    ctx->save_for_backward({ids});
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["padding_idx"] = padding_idx;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(grad, ids, std::move(num_rows), vocab_start, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor ids = ctx->get_saved_variables()[0];
    return {gather_held_rows(grads[0], ids, ctx->saved_data["vocab_start"].toInt(),
                             ctx->saved_data["padding_idx"].toInt()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor lookup_autograd(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                           int64_t vocab_size) {
  return LookupFunction::apply(ids, weight, vocab_start, padding_idx, vocab_size);
}

at::Tensor lookup_backward_autograd(const at::Tensor& grad, const at::Tensor& ids, c10::SymInt num_rows,
                                    int64_t vocab_start, int64_t padding_idx) {
  return LookupBackwardFunction::apply(grad, ids, std::move(num_rows), vocab_start, padding_idx);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Autograd, m) {
  m.impl("vocab_parallel_lookup", &lookup_autograd);
  m.impl("vocab_parallel_lookup_backward", &lookup_backward_autograd);
}

}  // namespace autoshard
