// Autograd of the vocab-parallel cross-entropy: only the logits are differentiable, and their
// gradient is the backward op, which needs no collective (the forward returns the row log-sum-exp
// and the vocabulary range it learned from the group). A second derivative would need the global
// softmax again, hence collectives in backward: it is refused rather than silently wrong.
#include <torch/autograd.h>
#include <torch/library.h>

#include "loss/cross_entropy.h"

namespace autoshard::loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                         const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::vocab_parallel_cross_entropy_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, int64_t, double, c10::string_view)>();
  return op.call(grad_loss, logits, labels, lse, vocab_range, ignore_index, label_smoothing, reduction);
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& labels,
                               c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                               c10::string_view reduction) {
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("autoshard::vocab_parallel_cross_entropy", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  c10::string_view, int64_t, double,
                                                                  c10::string_view)>();
    at::Tensor loss, lse, vocab_range;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(loss, lse, vocab_range) = op.call(logits, labels, group_name, ignore_index, label_smoothing, reduction);
    }
    ctx->save_for_backward({logits, labels, lse, vocab_range});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->mark_non_differentiable({lse, vocab_range});
    return {loss, lse, vocab_range};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_logits;
    if (grads[0].defined()) {
      grad_logits = call_backward(grads[0], saved[0], saved[1], saved[2], saved[3],
                                  ctx->saved_data["ignore_index"].toInt(),
                                  ctx->saved_data["label_smoothing"].toDouble(),
                                  ctx->saved_data["reduction"].toStringRef());
    }
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class CrossEntropyBackwardFunction : public torch::autograd::Function<CrossEntropyBackwardFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_loss, const at::Tensor& logits,
                            const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& vocab_range,
                            int64_t ignore_index, double label_smoothing, c10::string_view reduction) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward(grad_loss, logits, labels, lse, vocab_range, ignore_index, label_smoothing, reduction);
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "vocab_parallel_cross_entropy: a second derivative is not supported (it would need the softmax "
                "over the whole vocabulary again, across the ranks)");
    return {};  // not reached
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autograd(const at::Tensor& logits, const at::Tensor& labels,
                                                                c10::string_view group_name, int64_t ignore_index,
                                                                double label_smoothing, c10::string_view reduction) {
  const variable_list out =
      CrossEntropyFunction::apply(logits, labels, group_name, ignore_index, label_smoothing, reduction);
  return {out[0], out[1], out[2]};
}

at::Tensor backward_autograd(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                             const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                             double label_smoothing, c10::string_view reduction) {
  return CrossEntropyBackwardFunction::apply(grad_loss, logits, labels, lse, vocab_range, ignore_index,
                                             label_smoothing, reduction);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Autograd, m) {
  m.impl("vocab_parallel_cross_entropy", &forward_autograd);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_autograd);
}

}  // namespace autoshard::loss
