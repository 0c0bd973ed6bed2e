// Autograd of the vocab-parallel lookup: only the table is differentiable (ids are integers),
// and its gradient is the backward op's dense accumulation into the local rows.
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

at::Tensor lookup_autograd(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                           int64_t vocab_size) {
  return LookupFunction::apply(ids, weight, vocab_start, padding_idx, vocab_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Autograd, m) {
  m.impl("vocab_parallel_lookup", &lookup_autograd);
}

}  // namespace autoshard
