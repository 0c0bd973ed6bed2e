// Meta kernels of the optim family: the steps only mutate their inputs in place, so tracing
// them (fake tensors, torch.compile) needs nothing beyond the argument checks.
#include <torch/library.h>

#include "optim/optim.h"

namespace autoshard::optim {
namespace {

void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double weight_decay,
                      double eps, int64_t step, bool maximize) {
  checked_adamw_scalars(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, weight_decay, eps, step, maximize);
}

void fused_sgd_meta(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
                    double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                    bool first_step) {
  checked_sgd_scalars(params, grads, momentum_buffers, lr, momentum, dampening, weight_decay, nesterov, maximize,
                      first_step);
}

void fused_adamw_master_meta(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double beta1,
                             double beta2, double weight_decay, double eps, int64_t step, bool maximize) {
  checked_adamw_master_scalars(params, grads, master_params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, weight_decay,
                               eps, step, maximize);
}

void fused_sgd_master_meta(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                           at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                           double weight_decay, bool nesterov, bool maximize, bool first_step) {
  checked_sgd_master_scalars(params, grads, master_params, momentum_buffers, lr, momentum, dampening, weight_decay,
                             nesterov, maximize, first_step);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("fused_adamw_", &fused_adamw_meta);
  m.impl("fused_sgd_", &fused_sgd_meta);
  m.impl("fused_adamw_master_", &fused_adamw_master_meta);
  m.impl("fused_sgd_master_", &fused_sgd_master_meta);
}

}  // namespace autoshard::optim
