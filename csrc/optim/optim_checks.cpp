// Device-independent pieces of the optim family: argument checks, the per-step scalars, and
// the flat-layout stand-ins.
#include <cmath>
#include <string>

#include "optim/optim.h"

namespace autoshard::optim {
namespace {

struct NamedList {
  const char* name;
  at::TensorList tensors;
  bool float32 = false;  // a master weight or its state: fp32 whatever the parameters' dtype
};

void check_same_length(const char* op, const NamedList& reference, const NamedList& other) {
  TORCH_CHECK_VALUE(other.tensors.size() == reference.tensors.size(), op, ": ", other.name, " must hold one tensor per ",
                    "entry of ", reference.name, " (", reference.tensors.size(), "), got ", other.tensors.size());
}

// Every tensor of `lists` against params: defined, one device, one dtype, the parameter's shape.
void check_tensor_lists(const char* op, const std::vector<NamedList>& lists) {
  const NamedList& params = lists[0];
  for (size_t l = 1; l < lists.size(); ++l) check_same_length(op, params, lists[l]);
  if (params.tensors.empty()) return;
  for (const NamedList& list : lists) {
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      TORCH_CHECK_VALUE(list.tensors[i].defined(), op, ": ", list.name, "[", i, "] is undefined (None)");
    }
  }
  const at::Device device = params.tensors[0].device();
  for (const NamedList& list : lists) {
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      const at::Tensor& t = list.tensors[i];
      TORCH_CHECK_VALUE(t.device() == device, op, ": ", list.name, "[", i, "] is on ", t.device(), " but ",
                        params.name, "[0] is on ", device, "; all tensors must be on one device");
    }
  }
  const at::ScalarType dtype = params.tensors[0].scalar_type();
  bool with_master = false;
  for (const NamedList& list : lists) with_master = with_master || list.float32;
  if (with_master) {
    // An fp32 master of a float64 parameter would lose its precision.
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", params.name,
                     "[0] must be bfloat16, float16 or float32 (the master weights are float32), got ", dtype);
  } else {
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
                     ": ", params.name, "[0] must be float32, float64, float16 or bfloat16, got ", dtype);
  }
  for (const NamedList& list : lists) {
    for (size_t i = 0; i < list.tensors.size(); ++i) {
      const at::Tensor& t = list.tensors[i];
      if (list.float32) {
        TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", list.name, "[", i, "] has dtype ", t.scalar_type(),
                         " but must be float32 (master weights and their optimizer states are fp32)");
      } else {
        TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", list.name, "[", i, "] has dtype ", t.scalar_type(),
                         " but ", params.name, "[0] has dtype ", dtype, "; all tensors must share one dtype");
      }
    }
  }
  for (size_t l = 1; l < lists.size(); ++l) {
    for (size_t i = 0; i < params.tensors.size(); ++i) {
      const at::Tensor& t = lists[l].tensors[i];
      const at::Tensor& param = params.tensors[i];
      TORCH_CHECK_VALUE(t.sym_sizes() == param.sym_sizes(), op, ": ", lists[l].name, "[", i, "] has shape ",
                        t.sym_sizes(), " but ", params.name, "[", i, "] has shape ", param.sym_sizes());
    }
  }
}

void check_finite(const char* op, const char* name, double value) {
  TORCH_CHECK_VALUE(std::isfinite(value), op, ": ", name, " must be finite, got ", value);
}

AdamWScalars adamw_scalars(const char* op, double lr, double beta1, double beta2, double weight_decay, double eps,
                           int64_t step, bool maximize) {
  for (auto [name, value] : {std::pair{"lr", lr}, {"beta1", beta1}, {"beta2", beta2},
                             {"weight_decay", weight_decay}, {"eps", eps}}) {
    check_finite(op, name, value);
  }
  TORCH_CHECK_VALUE(lr >= 0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0 && beta2 < 1, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(eps >= 0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(step >= 1, op, ": step must be >= 1 (the count of steps including this one), got ", step);

  // As torch.optim.AdamW computes them (Python floats), so the kernels see the same roundings.
  const double steps = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(beta1, steps);
  const double bias_correction2 = 1 - std::pow(beta2, steps);
  AdamWScalars s;
  s.decay_factor = 1 - lr * weight_decay;
  s.lerp_weight = 1 - beta1;
  s.beta2 = beta2;
  s.one_minus_beta2 = 1 - beta2;
  s.bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  s.eps = eps;
  s.neg_step_size = -(lr / bias_correction1);
  s.decay = weight_decay != 0;
  s.maximize = maximize;
  return s;
}

// Checks the SGD hyperparameters, then the lists: `masters` is null for the plain step.
SGDScalars sgd_scalars(const char* op, at::TensorList params, at::TensorList grads, const at::TensorList* masters,
                       at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, bool maximize, bool first_step) {
  for (auto [name, value] : {std::pair{"lr", lr}, {"momentum", momentum}, {"dampening", dampening},
                             {"weight_decay", weight_decay}}) {
    check_finite(op, name, value);
  }
  TORCH_CHECK_VALUE(lr >= 0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(momentum >= 0, op, ": momentum must be >= 0, got ", momentum);
  TORCH_CHECK_VALUE(weight_decay >= 0, op, ": weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0 && dampening == 0), op,
                    ": nesterov needs momentum > 0 and dampening == 0, got momentum=", momentum,
                    ", dampening=", dampening);
  std::vector<NamedList> lists{{"params", params}, {"grads", grads}};
  if (masters != nullptr) lists.push_back({"master_params", *masters, true});
  if (momentum != 0) {
    lists.push_back({"momentum_buffers", momentum_buffers, masters != nullptr});
  } else {
    TORCH_CHECK_VALUE(momentum_buffers.empty(), op, ": momentum_buffers must be empty when momentum is 0, got ",
                      momentum_buffers.size(), " tensors");
  }
  check_tensor_lists(op, lists);
  SGDScalars s;
  s.neg_lr = -lr;
  s.momentum = momentum;
  s.one_minus_dampening = 1 - dampening;
  s.weight_decay = weight_decay;
  s.decay = weight_decay != 0;
  s.use_momentum = momentum != 0;
  s.nesterov = nesterov;
  s.maximize = maximize;
  s.first_step = first_step;
  return s;
}

}  // namespace

AdamWScalars checked_adamw_scalars(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                   at::TensorList exp_avg_sqs, double lr, double beta1, double beta2,
                                   double weight_decay, double eps, int64_t step, bool maximize) {
  constexpr const char* op = "fused_adamw_";
  check_tensor_lists(op, {{"params", params}, {"grads", grads}, {"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}});
  return adamw_scalars(op, lr, beta1, beta2, weight_decay, eps, step, maximize);
}

AdamWScalars checked_adamw_master_scalars(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                                          at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
                                          double beta1, double beta2, double weight_decay, double eps, int64_t step,
                                          bool maximize) {
  constexpr const char* op = "fused_adamw_master_";
  check_tensor_lists(op, {{"params", params},
                          {"grads", grads},
                          {"master_params", master_params, true},
                          {"exp_avgs", exp_avgs, true},
                          {"exp_avg_sqs", exp_avg_sqs, true}});
  return adamw_scalars(op, lr, beta1, beta2, weight_decay, eps, step, maximize);
}

SGDScalars checked_sgd_scalars(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                               double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                               bool maximize, bool first_step) {
  return sgd_scalars("fused_sgd_", params, grads, nullptr, momentum_buffers, lr, momentum, dampening, weight_decay,
                     nesterov, maximize, first_step);
}

SGDScalars checked_sgd_master_scalars(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                                      at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                                      double weight_decay, bool nesterov, bool maximize, bool first_step) {
  return sgd_scalars("fused_sgd_master_", params, grads, &master_params, momentum_buffers, lr, momentum, dampening,
                     weight_decay, nesterov, maximize, first_step);
}

FlatLists::FlatLists(std::vector<at::TensorList> lists, std::vector<bool> mutated) {
  lists_.resize(lists.size());
  for (size_t l = 0; l < lists.size(); ++l) lists_[l].reserve(lists[l].size());
  for (size_t i = 0; i < lists[0].size(); ++i) {
    const at::Tensor& param = lists[0][i];
    // Element order in memory is the parameter's when every tensor is dense with its strides.
    bool shared_layout = param.is_non_overlapping_and_dense();
    for (size_t l = 1; l < lists.size() && shared_layout; ++l) {
      shared_layout = lists[l][i].strides() == param.strides() || lists[l][i].numel() <= 1;
    }
    for (size_t l = 0; l < lists.size(); ++l) {
      const at::Tensor& t = lists[l][i];
      if (shared_layout) {
        lists_[l].push_back(t);
        continue;
      }
      at::Tensor flat = t.contiguous();
      if (mutated[l] && !flat.is_same(t)) stand_ins_.emplace_back(t, flat);
      lists_[l].push_back(std::move(flat));
    }
  }
}

void FlatLists::write_back() {
  for (auto& [target, stand_in] : stand_ins_) target.copy_(stand_in);
  stand_ins_.clear();
}

}  // namespace autoshard::optim
