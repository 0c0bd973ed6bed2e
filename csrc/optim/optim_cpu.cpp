// CPU kernels of the optim family: one pass over every element (each value loaded and stored
// once), vectorised, with all tensors of a call laid end to end and cut into equal work items,
// so that a hundred small tensors spread over the threads like one large one.
#include <algorithm>
#include <string>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include "optim/optim_cpu_segments.h"

namespace autoshard::optim {
namespace {

// Large enough to amortise handing work to a thread, small enough that 10M elements make
// hundreds of items to share out.
constexpr int64_t kItemElements = 32 * 1024;
// Tensors start at multiples of this in the laid-out space, so that item boundaries fall on
// whole vectors and cache lines of a tensor.
constexpr int64_t kTensorAlignment = 64;

// The instruction set ATen itself runs at (ATEN_CPU_CAPABILITY may lower it), if this library
// has kernels for it.
const SegmentKernels& segment_kernels() {
  static const SegmentKernels* kernels = [] {
    const std::string aten = at::get_cpu_capability();
    const SegmentKernels* avx2 = avx2_segment_kernels();
#if defined(__x86_64__) && defined(__GNUC__)
    const bool cpu_has_avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    const bool cpu_has_avx2 = false;
#endif
    if (avx2 != nullptr && cpu_has_avx2 && (aten == "AVX2" || aten == "AVX512")) return avx2;
    return &baseline_segment_kernels();
  }();
  return *kernels;
}

// Calls segment(t, begin, end) on element ranges of tensors[t] that cover every element once,
// in parallel, each thread taking whole items of the tensors laid end to end.
template <typename Segment>
void parallel_over_elements(const std::vector<at::Tensor>& tensors, const Segment& segment) {
  const size_t count = tensors.size();
  std::vector<int64_t> offsets(count + 1, 0);
  for (size_t t = 0; t < count; ++t) {
    const int64_t numel = tensors[t].numel();
    offsets[t + 1] = offsets[t] + (numel + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  }
  const int64_t total = offsets[count];
  if (total == 0) return;
  const int64_t items = (total + kItemElements - 1) / kItemElements;
  at::parallel_for(0, items, 1, [&](int64_t first_item, int64_t last_item) {
    const int64_t begin = first_item * kItemElements;
    const int64_t end = std::min(total, last_item * kItemElements);
    // The last tensor starting at or before `begin` (empty tensors share their successor's offset).
    size_t t = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (; t < count && offsets[t] < end; ++t) {
      const int64_t lo = std::max(begin, offsets[t]) - offsets[t];
      const int64_t hi = std::min(end - offsets[t], tensors[t].numel());
      if (lo < hi) segment(t, lo, hi);
    }
  });
}

// The address of element `offset` (in memory order) of a dense tensor.
char* element_address(const at::Tensor& t, int64_t offset) {
  return static_cast<char*>(const_cast<void*>(t.const_data_ptr())) + offset * static_cast<int64_t>(t.element_size());
}

void fused_adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     double lr, double beta1, double beta2, double weight_decay, double eps, int64_t step,
                     bool maximize) {
  const AdamWScalars scalars = checked_adamw_scalars(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2,
                                                     weight_decay, eps, step, maximize);
  if (params.empty()) return;
  const SegmentKernels::AdamW kernel = segment_kernels().adamw[dtype_index(params[0].scalar_type())];
  FlatLists flat({params, grads, exp_avgs, exp_avg_sqs}, {true, false, true, true});
  parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
    kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin),
           element_address(flat.list(2)[t], begin), element_address(flat.list(3)[t], begin), end - begin, scalars);
  });
  flat.write_back();
}

void fused_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
                   double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                   bool first_step) {
  const SGDScalars scalars = checked_sgd_scalars(params, grads, momentum_buffers, lr, momentum, dampening,
                                                 weight_decay, nesterov, maximize, first_step);
  if (params.empty()) return;
  const SegmentKernels::SGD kernel = segment_kernels().sgd[dtype_index(params[0].scalar_type())];
  if (scalars.use_momentum) {
    FlatLists flat({params, grads, momentum_buffers}, {true, false, true});
    parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
      kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin),
             element_address(flat.list(2)[t], begin), end - begin, scalars);
    });
    flat.write_back();
  } else {
    FlatLists flat({params, grads}, {true, false});
    parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
      kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin), nullptr,
             end - begin, scalars);
    });
    flat.write_back();
  }
}

float* float_address(const at::Tensor& t, int64_t offset) {
  return reinterpret_cast<float*>(element_address(t, offset));
}

void fused_adamw_master_cpu(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                            at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double beta1,
                            double beta2, double weight_decay, double eps, int64_t step, bool maximize) {
  const AdamWScalars scalars = checked_adamw_master_scalars(params, grads, master_params, exp_avgs, exp_avg_sqs, lr,
                                                            beta1, beta2, weight_decay, eps, step, maximize);
  if (params.empty()) return;
  const SegmentKernels::AdamWMaster kernel = segment_kernels().adamw_master[dtype_index(params[0].scalar_type())];
  FlatLists flat({params, grads, master_params, exp_avgs, exp_avg_sqs}, {true, false, true, true, true});
  parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
    kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin),
           float_address(flat.list(2)[t], begin), float_address(flat.list(3)[t], begin),
           float_address(flat.list(4)[t], begin), end - begin, scalars);
  });
  flat.write_back();
}

void fused_sgd_master_cpu(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                          at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool maximize, bool first_step) {
  const SGDScalars scalars = checked_sgd_master_scalars(params, grads, master_params, momentum_buffers, lr, momentum,
                                                        dampening, weight_decay, nesterov, maximize, first_step);
  if (params.empty()) return;
  const SegmentKernels::SGDMaster kernel = segment_kernels().sgd_master[dtype_index(params[0].scalar_type())];
  if (scalars.use_momentum) {
    FlatLists flat({params, grads, master_params, momentum_buffers}, {true, false, true, true});
    parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
      kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin),
             float_address(flat.list(2)[t], begin), float_address(flat.list(3)[t], begin), end - begin, scalars);
    });
    flat.write_back();
  } else {
    FlatLists flat({params, grads, master_params}, {true, false, true});
    parallel_over_elements(flat.list(0), [&](size_t t, int64_t begin, int64_t end) {
      kernel(element_address(flat.list(0)[t], begin), element_address(flat.list(1)[t], begin),
             float_address(flat.list(2)[t], begin), nullptr, end - begin, scalars);
    });
    flat.write_back();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  m.impl("fused_adamw_", &fused_adamw_cpu);
  m.impl("fused_sgd_", &fused_sgd_cpu);
  m.impl("fused_adamw_master_", &fused_adamw_master_cpu);
  m.impl("fused_sgd_master_", &fused_sgd_master_cpu);
}

}  // namespace autoshard::optim
