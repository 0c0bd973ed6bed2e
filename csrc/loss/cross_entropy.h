#pragma once
// Cross-entropy over vocabulary shards. Each rank holds logits [..., V_local] for its contiguous
// range of the vocabulary (split_sizes(V, world)[rank] entries, in rank order); labels hold global
// class ids and are the same on every rank. Forward issues three all-reduces of one value per row
// (the maximum over ranks of the row maxima, the sum of exponentials shifted by that maximum, and
// the target logit with, under label smoothing, the sum of the shifted logits); backward needs no
// collective: each rank's gradient is its own columns of softmax minus the smoothed one-hot target.
//
// Every device shares the orchestration below (checks, collectives, the per-row arithmetic in
// ATen ops on [rows] vectors); only the two passes over the [rows, V_local] logits are kernels of
// their own, one per device.
#include <tuple>

#include <ATen/ATen.h>

namespace autoshard::loss {

enum class Reduction { kNone, kSum, kMean };

// The passes over the logits, x [rows, cols] contiguous. Row statistics are in the accumulation
// dtype (double for double logits, float otherwise).
struct CrossEntropyKernels {
  // sum_exp[i] = sum_j exp(x[i][j] - row_max[i]); target_sums[0][i] = x[i][t] - row_max[i] with
  // t = local_target[i] when t >= 0, else 0; when target_sums has two rows, target_sums[1][i] =
  // sum_j (x[i][j] - row_max[i]). Outputs are preallocated and contiguous.
  void (*row_sums)(const at::Tensor& x, const at::Tensor& row_max, const at::Tensor& local_target,
                   at::Tensor& sum_exp, at::Tensor& target_sums);
  // grad[i][j] = scale[i] * exp(x[i][j] - lse[i]) - uniform[i] - (j == local_target[i] ? target_coef[i] : 0),
  // in x's dtype; rows whose three coefficients are all zero get zeros.
  at::Tensor (*logits_grad)(const at::Tensor& x, const at::Tensor& lse, const at::Tensor& local_target,
                            const at::Tensor& scale, const at::Tensor& target_coef, const at::Tensor& uniform);
};

// The dtype row statistics are kept in.
at::ScalarType accumulate_type(at::ScalarType logits_dtype);

// Argument checks shared by every device's kernels (the Meta ones included, so fake tensors fail
// where real ones do); each returns the parsed reduction.
Reduction check_forward_args(const at::Tensor& logits, const at::Tensor& labels, double label_smoothing,
                             c10::string_view reduction);
Reduction check_backward_args(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                              const at::Tensor& lse, const at::Tensor& vocab_range, double label_smoothing,
                              c10::string_view reduction);

// The loss (labels' element count for "none", a scalar otherwise, in the logits' dtype), the
// log-sum-exp of every row over the whole vocabulary, and (vocab_start, vocab_size) as int64 [2].
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& labels, c10::string_view group_name, int64_t ignore_index,
    double label_smoothing, c10::string_view reduction, const CrossEntropyKernels& kernels);

// The gradient of the loss with respect to this rank's logits, shaped and typed like them.
at::Tensor cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                                  double label_smoothing, c10::string_view reduction,
                                  const CrossEntropyKernels& kernels);

}  // namespace autoshard::loss
