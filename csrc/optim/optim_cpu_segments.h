#pragma once
// Pointer-level CPU kernels of the optim family: one call updates `n` consecutive elements of
// one tensor's arrays. They are compiled once per instruction set (optim_cpu_segments_*.cpp)
// and the best one the CPU supports is chosen at run time, as ATen does for its own kernels.
#include <cstdint>

#include "optim/optim.h"

namespace autoshard::optim {

struct SegmentKernels {
  using AdamW = void (*)(void* param, const void* grad, void* exp_avg, void* exp_avg_sq, int64_t n,
                         const AdamWScalars& scalars);
  using SGD = void (*)(void* param, const void* grad, void* momentum_buffer, int64_t n, const SGDScalars& scalars);

  // With fp32 master weights: `param` and `grad` in the parameters' dtype, the others fp32;
  // `param` is only written. `momentum_buffer` is null when momentum is 0.
  using AdamWMaster = void (*)(void* param, const void* grad, float* master, float* exp_avg, float* exp_avg_sq,
                               int64_t n, const AdamWScalars& scalars);
  using SGDMaster = void (*)(void* param, const void* grad, float* master, float* momentum_buffer, int64_t n,
                             const SGDScalars& scalars);

  // Indexed by dtype_index() (of the parameters); the master kernels have no float64 entry.
  AdamW adamw[4];
  SGD sgd[4];
  AdamWMaster adamw_master[4];
  SGDMaster sgd_master[4];
  const char* instruction_set;
};

// float32, float64, float16, bfloat16 -> 0, 1, 2, 3 (the only dtypes the checks let through).
inline int dtype_index(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    default: return 3;
  }
}

// Portable build (whatever the compiler's baseline vector width is).
const SegmentKernels& baseline_segment_kernels();
// AVX2 + FMA build for x86-64; nullptr where it is not compiled in.
const SegmentKernels* avx2_segment_kernels();

}  // namespace autoshard::optim
