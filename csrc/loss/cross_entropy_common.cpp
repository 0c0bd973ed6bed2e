// The device-independent part of the vocab-parallel cross-entropy: argument checks, the three
// forward all-reduces, and the per-row arithmetic on [rows] vectors. Shard sizes are learned in
// the first all-reduce (each rank writes its own slot), so no rank needs to be told the vocabulary
// size and every rank checks the same layout against split_sizes before the second collective.
#include <limits>
#include <numeric>
#include <sstream>

#include "comm/collectives.h"
#include "comm/group.h"
#include "loss/cross_entropy.h"
#include "split/split_rule.h"

namespace autoshard::loss {
namespace {

constexpr const char* kOp = "vocab_parallel_cross_entropy";
constexpr const char* kBackwardOp = "vocab_parallel_cross_entropy_backward";

// Shard sizes travel as floating-point values of the first all-reduce; float holds every
// integer up to 2^24 exactly.
constexpr int64_t kMaxShardColumns = int64_t{1} << 24;

Reduction parse_reduction(c10::string_view reduction, const char* op) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK_VALUE(false, op, ": reduction must be \"mean\", \"sum\" or \"none\", got \"", std::string(reduction),
                    "\"");
  return Reduction::kMean;  // not reached
}

void check_common(const at::Tensor& logits, const at::Tensor& labels, double label_smoothing, const char* op) {
  TORCH_CHECK_TYPE(at::isFloatingType(logits.scalar_type()), op,
                   ": logits must be a floating-point tensor, got ", logits.scalar_type());
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, op,
                   ": labels must be an integer tensor (int64 or int32), got ", labels.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() >= 1, op, ": logits must have a vocabulary dimension last, got a 0-d tensor");
  TORCH_CHECK_VALUE(labels.dim() == logits.dim() - 1, op,
                    ": labels must have logits' shape without its last (vocabulary) dimension, got labels ",
                    labels.sym_sizes(), " for logits ", logits.sym_sizes());
  for (int64_t d = 0; d < labels.dim(); ++d) {
    TORCH_CHECK_VALUE(labels.sym_size(d) == logits.sym_size(d), op,
                      ": labels must have logits' shape without its last (vocabulary) dimension, got labels ",
                      labels.sym_sizes(), " for logits ", logits.sym_sizes());
  }
  TORCH_CHECK_VALUE(labels.device() == logits.device(), op, ": labels and logits must be on the same device, got ",
                    labels.device(), " and ", logits.device());
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
                    ": label_smoothing must be in [0, 1], got ", label_smoothing);
}

std::string join(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

// (vocab_start, vocab_size) as int64 [2] from every rank's shard size; the sizes must follow
// split_sizes and the labels must be class ids of the whole vocabulary or ignore_index. On the
// CPU the values are read and the errors name them; elsewhere the checks are asserted on the
// device, so that no value waits for the host.
at::Tensor checked_vocab_range(const at::Tensor& shard_sizes, const at::Tensor& ids, int64_t rank,
                               int64_t ignore_index) {
  const int64_t world = shard_sizes.size(0);
  if (shard_sizes.is_cpu()) {
    const int64_t* data = shard_sizes.const_data_ptr<int64_t>();
    const std::vector<int64_t> sizes(data, data + world);
    const int64_t vocab = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    const std::vector<int64_t> expected = split_sizes(vocab, world);
    TORCH_CHECK_VALUE(sizes == expected, kOp, ": every rank's logits must hold its split_sizes(V, world_size) ",
                      "share of the vocabulary (V = ", vocab, " summed over the ranks): expected last dimensions ",
                      join(expected), ", got ", join(sizes));
    const int64_t* labels = ids.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      const int64_t id = labels[i];
      TORCH_CHECK_INDEX(id == ignore_index || (id >= 0 && id < vocab), kOp,
                        ": labels must be class ids in [0, V) = [0, ", vocab, ") or ignore_index = ", ignore_index,
                        ", got ", id, " at flat position ", i);
    }
    const int64_t start = std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0});
    return at::tensor({start, vocab}, shard_sizes.options());
  }
  const at::Tensor vocab = shard_sizes.sum();
  const at::Tensor start = shard_sizes.narrow(0, 0, rank).sum();
  const at::Tensor ranks = at::arange(world, shard_sizes.options());
  const at::Tensor expected = at::floor_divide(vocab, world) + ranks.lt(at::remainder(vocab, world)).to(at::kLong);
  at::_assert_async(shard_sizes.eq(expected).all(),
                    "vocab_parallel_cross_entropy: every rank's logits must hold its split_sizes(V, world_size) "
                    "share of the vocabulary");
  at::_assert_async(ids.eq(ignore_index).logical_or(ids.ge(0).logical_and(ids.lt(vocab))).all(),
                    "vocab_parallel_cross_entropy: labels must be class ids in [0, V) or ignore_index");
  return at::stack({start, vocab});
}

// Each row's target column in this rank's logits, or -1 where another rank holds it or the row is ignored.
at::Tensor local_targets(const at::Tensor& ids, const at::Tensor& vocab_range, int64_t columns, int64_t ignore_index) {
  const at::Tensor local = ids - vocab_range.select(0, 0);
  const at::Tensor held = ids.ne(ignore_index).logical_and(local.ge(0)).logical_and(local.lt(columns));
  return at::where(held, local, -1).contiguous();
}

}  // namespace

at::ScalarType accumulate_type(at::ScalarType logits_dtype) {
  return logits_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

Reduction check_forward_args(const at::Tensor& logits, const at::Tensor& labels, double label_smoothing,
                             c10::string_view reduction) {
  const Reduction parsed = parse_reduction(reduction, kOp);
  check_common(logits, labels, label_smoothing, kOp);
  return parsed;
}

Reduction check_backward_args(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                              const at::Tensor& lse, const at::Tensor& vocab_range, double label_smoothing,
                              c10::string_view reduction) {
  const Reduction parsed = parse_reduction(reduction, kBackwardOp);
  check_common(logits, labels, label_smoothing, kBackwardOp);
  TORCH_CHECK_TYPE(at::isFloatingType(grad_loss.scalar_type()), kBackwardOp,
                   ": grad_loss must be a floating-point tensor, got ", grad_loss.scalar_type());
  if (parsed == Reduction::kNone) {
    TORCH_CHECK_VALUE(grad_loss.dim() == 1 && grad_loss.sym_size(0) == labels.sym_numel(), kBackwardOp,
                      ": with reduction \"none\" grad_loss must be 1-d with labels' element count (",
                      labels.sym_numel(), "), got shape ", grad_loss.sym_sizes());
  } else {
    TORCH_CHECK_VALUE(grad_loss.dim() == 0, kBackwardOp, ": with a reduction grad_loss must be a scalar, got shape ",
                      grad_loss.sym_sizes());
  }
  TORCH_CHECK_VALUE(lse.dim() == 1 && lse.sym_size(0) == labels.sym_numel() &&
                        lse.scalar_type() == accumulate_type(logits.scalar_type()),
                    kBackwardOp, ": lse must be the forward's log-sum-exp, 1-d with labels' element count in ",
                    accumulate_type(logits.scalar_type()), ", got shape ", lse.sym_sizes(), " in ", lse.scalar_type());
  TORCH_CHECK_VALUE(vocab_range.dim() == 1 && vocab_range.sym_size(0) == 2 && vocab_range.scalar_type() == at::kLong,
                    kBackwardOp, ": vocab_range must be the forward's int64 [vocab_start, vocab_size], got shape ",
                    vocab_range.sym_sizes(), " in ", vocab_range.scalar_type());
  for (const at::Tensor* t : {&grad_loss, &lse, &vocab_range}) {
    TORCH_CHECK_VALUE(t->device() == logits.device(), kBackwardOp,
                      ": grad_loss, lse and vocab_range must be on logits' device ", logits.device(), ", got ",
                      t->device());
  }
  return parsed;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& labels, c10::string_view group_name, int64_t ignore_index,
    double label_smoothing, c10::string_view reduction, const CrossEntropyKernels& kernels) {
  const Reduction parsed = check_forward_args(logits, labels, label_smoothing, reduction);
  const auto group = comm::resolve_group(group_name, kOp);
  const int64_t world = group->getSize(), rank = group->getRank();
  const int64_t rows = labels.numel(), columns = logits.size(-1);
  TORCH_CHECK_VALUE(columns < kMaxShardColumns, kOp, ": a rank's logits may hold at most ", kMaxShardColumns - 1,
                    " vocabulary entries, got ", columns);
  const auto acc = logits.options().dtype(accumulate_type(logits.scalar_type()));
  const at::Tensor x = logits.reshape({rows, columns}).contiguous();
  const at::Tensor ids = labels.reshape({rows}).to(at::kLong).contiguous();

  // 1: the maximum over ranks of each row's maximum, and every rank's shard size in its own slot.
  at::Tensor maxima = at::zeros({rows + world}, acc);
  at::Tensor row_max = maxima.narrow(0, 0, rows);
  if (columns > 0) {
    row_max.copy_(at::amax(x, {1}));
  } else {
    row_max.fill_(-std::numeric_limits<double>::infinity());
  }
  maxima.narrow(0, rows + rank, 1).fill_(columns);
  comm::all_reduce_(maxima, c10d::ReduceOp::MAX, *group);
  const at::Tensor vocab_range =
      checked_vocab_range(maxima.narrow(0, rows, world).to(at::kLong), ids, rank, ignore_index);
  const at::Tensor targets = local_targets(ids, vocab_range, columns, ignore_index);

  // 2 and 3: the shifted exponentials' sum, then the target logit (and the smoothing sum).
  const bool smoothing = label_smoothing > 0.0;
  at::Tensor sum_exp = at::empty({rows}, acc);
  at::Tensor target_sums = at::empty({smoothing ? 2 : 1, rows}, acc);
  const at::Tensor row_max_now = row_max.contiguous();
  kernels.row_sums(x, row_max_now, targets, sum_exp, target_sums);
  comm::all_reduce_sum_(sum_exp, *group);
  comm::all_reduce_sum_(target_sums, *group);

  // loss = lse - (1 - eps) * x_target - eps / V * sum_j x_j, every logit taken relative to row_max.
  const at::Tensor log_sum_exp = sum_exp.log();
  const at::Tensor lse = row_max_now + log_sum_exp;
  at::Tensor per_row = log_sum_exp - target_sums.select(0, 0) * (1.0 - label_smoothing);
  if (smoothing) {
    per_row = per_row - target_sums.select(0, 1) * (vocab_range.select(0, 1).to(acc.dtype()).reciprocal() *
                                                    label_smoothing);
  }
  const at::Tensor valid = ids.ne(ignore_index);
  per_row = at::where(valid, per_row, 0.0);
  at::Tensor loss;
  switch (parsed) {
    case Reduction::kNone: loss = per_row; break;
    case Reduction::kSum: loss = per_row.sum(); break;
    // An all-ignored batch gives 0 / 0 = nan, as torch's cross_entropy does.
    case Reduction::kMean: loss = per_row.sum() / valid.sum().to(acc.dtype()); break;
  }
  return {loss.to(logits.scalar_type()).contiguous(), lse, vocab_range};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                                  double label_smoothing, c10::string_view reduction,
                                  const CrossEntropyKernels& kernels) {
  const Reduction parsed =
      check_backward_args(grad_loss, logits, labels, lse, vocab_range, label_smoothing, reduction);
  const int64_t rows = labels.numel(), columns = logits.size(-1);
  const at::ScalarType acc = accumulate_type(logits.scalar_type());
  const at::Tensor x = logits.reshape({rows, columns}).contiguous();
  const at::Tensor ids = labels.reshape({rows}).to(at::kLong).contiguous();
  const at::Tensor targets = local_targets(ids, vocab_range, columns, ignore_index);
  const at::Tensor valid = ids.ne(ignore_index);
  at::Tensor upstream = grad_loss.to(acc);
  if (parsed == Reduction::kMean) upstream = upstream / valid.sum().to(acc);
  // Ignored rows get no gradient, also when an all-ignored mean made the upstream infinite.
  const at::Tensor scale = at::where(valid, upstream.expand({rows}), 0.0).contiguous();
  const at::Tensor target_coef = (scale * (1.0 - label_smoothing)).contiguous();
  const at::Tensor uniform =
      (scale * (vocab_range.select(0, 1).to(acc).reciprocal() * label_smoothing)).contiguous();
  const at::Tensor grad = kernels.logits_grad(x, lse.contiguous(), targets, scale, target_coef, uniform);
  return grad.view(logits.sizes());
}

}  // namespace autoshard::loss
