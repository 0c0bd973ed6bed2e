#pragma once
// The element-wise update rules, written once for both the CPU kernel (V = at::vec::Vectorized)
// and the CUDA kernel (V = float or double). They follow torch.optim's single-tensor
// implementations operation by operation, including where ATen's kernels use a fused
// multiply-add (lerp, add with alpha), so that fp32 results agree to the last bits.
#include <c10/macros/Macros.h>

#include <cmath>

#include "optim/optim.h"

namespace autoshard::optim {

// Scalar forms of the vector operations; Vectorized provides its own (found by ADL for fmadd).
C10_HOST_DEVICE inline float fmadd(float a, float b, float c) { return ::fmaf(a, b, c); }
C10_HOST_DEVICE inline double fmadd(double a, double b, double c) { return ::fma(a, b, c); }
C10_HOST_DEVICE inline float sqrt_of(float x) { return ::sqrtf(x); }
C10_HOST_DEVICE inline double sqrt_of(double x) { return ::sqrt(x); }
C10_HOST_DEVICE inline float negated(float x) { return -x; }
C10_HOST_DEVICE inline double negated(double x) { return -x; }
template <typename V>
inline V sqrt_of(const V& x) {
  return x.sqrt();
}
template <typename V>
inline V negated(const V& x) {
  return x.neg();
}

// AdamWScalars rounded to the math type `S` and held as `V` (a broadcast vector on CPU).
template <typename V>
struct AdamWCoefficients {
  V decay_factor, lerp_weight, lerp_weight_minus_one, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size;
  bool decay, lerp_weight_small, maximize;

  template <typename S>
  static AdamWCoefficients make(const AdamWScalars& s) {
    const S lerp_weight = static_cast<S>(s.lerp_weight);
    return {V(static_cast<S>(s.decay_factor)),
            V(lerp_weight),
            V(lerp_weight - S(1)),  // ATen's vectorised lerp takes (weight - 1) in the math type
            V(static_cast<S>(s.beta2)),
            V(static_cast<S>(s.one_minus_beta2)),
            V(static_cast<S>(s.bias_correction2_sqrt)),
            V(static_cast<S>(s.eps)),
            V(static_cast<S>(s.neg_step_size)),
            s.decay,
            // ATen's lerp switches formula at |weight| < 0.5, deciding in the math type.
            (lerp_weight < S(0) ? -lerp_weight : lerp_weight) < S(0.5),
            s.maximize};
  }
};

template <typename V>
struct SGDCoefficients {
  V neg_lr, momentum, one_minus_dampening, weight_decay;
  bool decay, use_momentum, nesterov, maximize, first_step;

  template <typename S>
  static SGDCoefficients make(const SGDScalars& s) {
    return {V(static_cast<S>(s.neg_lr)),
            V(static_cast<S>(s.momentum)),
            V(static_cast<S>(s.one_minus_dampening)),
            V(static_cast<S>(s.weight_decay)),
            s.decay,
            s.use_momentum,
            s.nesterov,
            s.maximize,
            s.first_step};
  }
};

// torch.optim.AdamW, one step:
//   param.mul_(1 - lr*wd); exp_avg.lerp_(grad, 1 - beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)
template <typename V>
C10_HOST_DEVICE inline void adamw_update(V& param, const V& gradient, V& exp_avg, V& exp_avg_sq,
                                         const AdamWCoefficients<V>& c) {
  const V grad = c.maximize ? negated(gradient) : gradient;
  if (c.decay) param = param * c.decay_factor;
  const V difference = grad - exp_avg;
  exp_avg = c.lerp_weight_small ? fmadd(c.lerp_weight, difference, exp_avg)
                                : fmadd(c.lerp_weight_minus_one, difference, grad);
  exp_avg_sq = exp_avg_sq * c.beta2 + c.one_minus_beta2 * grad * grad;
  const V denom = sqrt_of(exp_avg_sq) / c.bias_correction2_sqrt + c.eps;
  param = param + c.neg_step_size * exp_avg / denom;
}

// torch.optim.SGD, one step:
//   grad = grad.add(param, alpha=wd)
//   buf = grad.clone() on the first step, else buf.mul_(momentum).add_(grad, alpha=1 - dampening)
//   grad = grad.add(buf, alpha=momentum) if nesterov else buf
//   param.add_(grad, alpha=-lr)
template <typename V>
C10_HOST_DEVICE inline void sgd_update(V& param, const V& gradient, V& momentum_buffer, const SGDCoefficients<V>& c) {
  V grad = c.maximize ? negated(gradient) : gradient;
  if (c.decay) grad = fmadd(param, c.weight_decay, grad);
  if (c.use_momentum) {
    momentum_buffer = c.first_step ? grad : fmadd(grad, c.one_minus_dampening, momentum_buffer * c.momentum);
    grad = c.nesterov ? fmadd(momentum_buffer, c.momentum, grad) : momentum_buffer;
  }
  param = fmadd(grad, c.neg_lr, param);
}

}  // namespace autoshard::optim
