#pragma once
// The optim kernel family: fused AdamW and SGD steps over lists of local tensors (a rank's
// shards). Every device kernel runs the same argument checks and takes its per-step
// constants from the same host computation, so CPU, CUDA and Meta agree on what is valid and
// on every rounding of the scalars.
#include <ATen/ATen.h>

namespace autoshard::optim {

// The host side of one AdamW step, in double as torch.optim.AdamW computes it in Python; the
// kernels round each value once to their math type.
struct AdamWScalars {
  double decay_factor;           // 1 - lr * weight_decay
  double lerp_weight;            // 1 - beta1, the weight of exp_avg.lerp_(grad, ...)
  double beta2;
  double one_minus_beta2;
  double bias_correction2_sqrt;  // (1 - beta2^step) ** 0.5
  double eps;
  double neg_step_size;          // -lr / (1 - beta1^step)
  bool decay;                    // weight_decay != 0
  bool maximize;
};

struct SGDScalars {
  double neg_lr;
  double momentum;
  double one_minus_dampening;
  double weight_decay;
  bool decay;         // weight_decay != 0
  bool use_momentum;  // momentum != 0
  bool nesterov;
  bool maximize;
  bool first_step;    // momentum buffers are set to the gradient instead of updated
};

// Validate every argument of fused_adamw_ / fused_sgd_ (lists, devices, dtypes, shapes,
// hyperparameters) before any kernel touches memory, and return the step's constants.
AdamWScalars checked_adamw_scalars(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                   at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                                   double weight_decay, double eps, int64_t step, bool maximize);

SGDScalars checked_sgd_scalars(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                               double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                               bool maximize, bool first_step);

// The same for fused_adamw_master_ / fused_sgd_master_: `params` bf16, fp16 or fp32 with
// gradients of their dtype; master weights and states fp32.
AdamWScalars checked_adamw_master_scalars(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                                          at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
                                          double beta1, double beta2, double weight_decay, double eps, int64_t step,
                                          bool maximize);

SGDScalars checked_sgd_master_scalars(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                                      at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                                      double weight_decay, bool nesterov, bool maximize, bool first_step);

// Lists whose i-th tensors can all be walked as one flat array in the same element order.
// A tensor whose layout differs from its parameter's (or is not dense) is replaced by a
// contiguous stand-in; write_back() copies the stand-ins of the mutated lists into the
// caller's tensors. Typical parameters, gradients and states need no stand-in at all.
class FlatLists {
 public:
  FlatLists(std::vector<at::TensorList> lists, std::vector<bool> mutated);
  const std::vector<at::Tensor>& list(size_t which) const { return lists_[which]; }
  void write_back();

 private:
  std::vector<std::vector<at::Tensor>> lists_;
  std::vector<std::pair<at::Tensor, at::Tensor>> stand_ins_;  // (caller's tensor, stand-in)
};

}  // namespace autoshard::optim
