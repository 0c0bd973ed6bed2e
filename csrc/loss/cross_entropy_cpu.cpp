// CPU kernels of the vocab-parallel cross-entropy: each pass runs over the rows in parallel, one
// row per iteration, accumulating in the op-math type (float for bf16 and fp16), so the result
// does not depend on the thread count.
#include <cmath>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "loss/cross_entropy.h"

namespace autoshard::loss {
namespace {

int64_t rows_per_task(int64_t columns) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(columns, 1));
}

template <typename scalar_t>
void row_sums_typed(const at::Tensor& x, const at::Tensor& row_max, const at::Tensor& local_target,
                    at::Tensor& sum_exp, at::Tensor& target_sums) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = x.size(0), columns = x.size(1);
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const acc_t* maxima = row_max.const_data_ptr<acc_t>();
  const int64_t* targets = local_target.const_data_ptr<int64_t>();
  acc_t* sums = sum_exp.data_ptr<acc_t>();
  acc_t* target = target_sums.data_ptr<acc_t>();
  acc_t* shifted = target_sums.size(0) > 1 ? target + rows : nullptr;
  at::parallel_for(0, rows, rows_per_task(columns), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* row = data + i * columns;
      const acc_t m = maxima[i];
      acc_t s = 0, z = 0;
      for (int64_t j = 0; j < columns; ++j) {
        const acc_t v = static_cast<acc_t>(row[j]) - m;
        s += std::exp(v);
        z += v;
      }
      sums[i] = s;
      if (shifted != nullptr) shifted[i] = z;
      const int64_t t = targets[i];
      target[i] = t >= 0 ? static_cast<acc_t>(row[t]) - m : acc_t(0);
    }
  });
}

void row_sums_cpu(const at::Tensor& x, const at::Tensor& row_max, const at::Tensor& local_target,
                  at::Tensor& sum_exp, at::Tensor& target_sums) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy", [&] {
    row_sums_typed<scalar_t>(x, row_max, local_target, sum_exp, target_sums);
  });
}

template <typename scalar_t>
void logits_grad_typed(const at::Tensor& x, const at::Tensor& lse, const at::Tensor& local_target,
                       const at::Tensor& scale, const at::Tensor& target_coef, const at::Tensor& uniform,
                       at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = x.size(0), columns = x.size(1);
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const acc_t* lses = lse.const_data_ptr<acc_t>();
  const int64_t* targets = local_target.const_data_ptr<int64_t>();
  const acc_t* scales = scale.const_data_ptr<acc_t>();
  const acc_t* target_coefs = target_coef.const_data_ptr<acc_t>();
  const acc_t* uniforms = uniform.const_data_ptr<acc_t>();
  scalar_t* grad = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, rows_per_task(columns), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* row = data + i * columns;
      scalar_t* dst = grad + i * columns;
      const acc_t a = scales[i], b = target_coefs[i], c = uniforms[i], l = lses[i];
      if (a == acc_t(0) && b == acc_t(0) && c == acc_t(0)) {
        std::fill(dst, dst + columns, scalar_t(0));
        continue;
      }
      for (int64_t j = 0; j < columns; ++j) {
        dst[j] = static_cast<scalar_t>(a * std::exp(static_cast<acc_t>(row[j]) - l) - c);
      }
      const int64_t t = targets[i];
      if (t >= 0) dst[t] = static_cast<scalar_t>(a * std::exp(static_cast<acc_t>(row[t]) - l) - c - b);
    }
  });
}

at::Tensor logits_grad_cpu(const at::Tensor& x, const at::Tensor& lse, const at::Tensor& local_target,
                           const at::Tensor& scale, const at::Tensor& target_coef, const at::Tensor& uniform) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "vocab_parallel_cross_entropy_backward", [&] {
                                    logits_grad_typed<scalar_t>(x, lse, local_target, scale, target_coef, uniform,
                                                                out);
                                  });
  return out;
}

constexpr CrossEntropyKernels kCpuKernels{&row_sums_cpu, &logits_grad_cpu};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                           c10::string_view group_name, int64_t ignore_index,
                                                           double label_smoothing, c10::string_view reduction) {
  return cross_entropy_forward(logits, labels, group_name, ignore_index, label_smoothing, reduction, kCpuKernels);
}

at::Tensor backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                        const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                        double label_smoothing, c10::string_view reduction) {
  return cross_entropy_backward(grad_loss, logits, labels, lse, vocab_range, ignore_index, label_smoothing, reduction,
                                kCpuKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  m.impl("vocab_parallel_cross_entropy", &forward_cpu);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cpu);
}

}  // namespace autoshard::loss
