// The body of the pointer-level CPU kernels, included once per instruction set by
// optim_cpu_segments_*.cpp. Everything here has internal linkage, so each inclusion is its own
// copy, compiled for its own instruction set, and the copies never stand in for one another.
//
// Fused multiply-adds happen only where the update rules ask for them (where ATen's kernels
// use one); the compiler must not merge the rules' separately rounded steps into more.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <algorithm>
#include <array>
#include <tuple>

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "optim/optim_cpu_segments.h"
#include "optim/optim_math.h"

namespace autoshard::optim {
namespace {

using at::vec::Vectorized;

// Loads vectors [i, i + width) of every array, hands them to `update` in the math type
// (a reduced-precision vector as two float vectors) and stores the arrays marked in `stored`.
template <typename scalar_t, size_t Depth, typename Update>
inline void update_elements(const std::array<scalar_t*, Depth>& data, const std::array<bool, Depth>& stored,
                            int64_t n, const Update& update) {
  using Vec = Vectorized<scalar_t>;
  constexpr int64_t width = Vec::size();
  const auto step = [&](int64_t i, int64_t valid) {
    std::array<Vec, Depth> raw;
    for (size_t d = 0; d < Depth; ++d) {
      raw[d] = valid == width ? Vec::loadu(data[d] + i) : Vec::loadu(data[d] + i, valid);
    }
    if constexpr (at::vec::is_reduced_floating_point_v<scalar_t>) {
      std::array<Vectorized<float>, Depth> low, high;
      for (size_t d = 0; d < Depth; ++d) std::tie(low[d], high[d]) = at::vec::convert_to_float<scalar_t>(raw[d]);
      update(low);
      update(high);
      for (size_t d = 0; d < Depth; ++d) raw[d] = at::vec::convert_from_float<scalar_t>(low[d], high[d]);
    } else {
      update(raw);
    }
    for (size_t d = 0; d < Depth; ++d) {
      if (stored[d]) raw[d].store(data[d] + i, static_cast<int>(valid));
    }
  };
  int64_t i = 0;
  for (; i + width <= n; i += width) step(i, width);
  if (i < n) step(i, n - i);
}

// Gradients are only read; their pointer is made non-const so that all arrays share one type.
template <typename scalar_t>
inline scalar_t* as_array(const void* data) {
  return static_cast<scalar_t*>(const_cast<void*>(data));
}

template <typename scalar_t>
void adamw_segment(void* param, const void* grad, void* exp_avg, void* exp_avg_sq, int64_t n,
                   const AdamWScalars& scalars) {
  using opmath_t = at::opmath_type<scalar_t>;
  using MathVec = Vectorized<opmath_t>;
  const auto c = AdamWCoefficients<MathVec>::template make<opmath_t>(scalars);
  const std::array<scalar_t*, 4> data{as_array<scalar_t>(param), as_array<scalar_t>(grad),
                                      as_array<scalar_t>(exp_avg), as_array<scalar_t>(exp_avg_sq)};
  update_elements<scalar_t, 4>(data, {true, false, true, true}, n,
                               [&](std::array<MathVec, 4>& x) { adamw_update(x[0], x[1], x[2], x[3], c); });
}

template <typename scalar_t>
void sgd_segment(void* param, const void* grad, void* momentum_buffer, int64_t n, const SGDScalars& scalars) {
  using opmath_t = at::opmath_type<scalar_t>;
  using MathVec = Vectorized<opmath_t>;
  const auto c = SGDCoefficients<MathVec>::template make<opmath_t>(scalars);
  if (scalars.use_momentum) {
    const std::array<scalar_t*, 3> data{as_array<scalar_t>(param), as_array<scalar_t>(grad),
                                        as_array<scalar_t>(momentum_buffer)};
    update_elements<scalar_t, 3>(data, {true, false, true}, n,
                                 [&](std::array<MathVec, 3>& x) { sgd_update(x[0], x[1], x[2], c); });
  } else {
    const std::array<scalar_t*, 2> data{as_array<scalar_t>(param), as_array<scalar_t>(grad)};
    update_elements<scalar_t, 2>(data, {true, false}, n, [&](std::array<MathVec, 2>& x) {
      MathVec unused_buffer;
      sgd_update(x[0], x[1], unused_buffer, c);
    });
  }
}

// The master-weight form of update_elements: the parameter and its gradient in `param_t`
// (16-bit or fp32), the master and the states fp32. Each vector of parameters is one or two
// float vectors in the math; `update` gets {master, grad, states...} as float vectors, and the
// parameter is stored as the updated master rounded to nearest even (ATen's conversion).
template <typename param_t, size_t States, typename Update>
inline void update_with_master(param_t* param, const param_t* grad, const std::array<float*, States + 1>& fp32,
                               int64_t n, const Update& update) {
  using FloatVec = Vectorized<float>;
  constexpr int64_t float_width = FloatVec::size();
  constexpr bool reduced = at::vec::is_reduced_floating_point_v<param_t>;
  constexpr int64_t halves = reduced ? 2 : 1;
  constexpr int64_t width = float_width * halves;
  const auto step = [&](int64_t i, int64_t valid) {
    std::array<FloatVec, halves> grads;
    if constexpr (reduced) {
      using ParamVec = Vectorized<param_t>;
      const ParamVec raw = valid == width ? ParamVec::loadu(grad + i) : ParamVec::loadu(grad + i, valid);
      std::tie(grads[0], grads[1]) = at::vec::convert_to_float<param_t>(raw);
    } else {
      grads[0] = valid == width ? FloatVec::loadu(grad + i) : FloatVec::loadu(grad + i, valid);
    }
    std::array<FloatVec, halves> updated;
    for (int64_t h = 0; h < halves; ++h) {
      const int64_t offset = i + h * float_width;
      const int64_t count = std::min(std::max(valid - h * float_width, int64_t(0)), float_width);
      if (count == 0) {  // past the end of the arrays: nothing to load or store
        updated[h] = FloatVec(0.0f);
        continue;
      }
      std::array<FloatVec, States + 2> x;  // master, grad, states...
      x[1] = grads[h];
      for (size_t d = 0; d <= States; ++d) {
        x[d == 0 ? 0 : d + 1] = count == float_width ? FloatVec::loadu(fp32[d] + offset)
                                                     : FloatVec::loadu(fp32[d] + offset, count);
      }
      update(x);
      for (size_t d = 0; d <= States; ++d) x[d == 0 ? 0 : d + 1].store(fp32[d] + offset, static_cast<int>(count));
      updated[h] = x[0];
    }
    if constexpr (reduced) {
      at::vec::convert_from_float<param_t>(updated[0], updated[1]).store(param + i, static_cast<int>(valid));
    } else {
      updated[0].store(param + i, static_cast<int>(valid));
    }
  };
  int64_t i = 0;
  for (; i + width <= n; i += width) step(i, width);
  if (i < n) step(i, n - i);
}

template <typename param_t>
void adamw_master_segment(void* param, const void* grad, float* master, float* exp_avg, float* exp_avg_sq, int64_t n,
                          const AdamWScalars& scalars) {
  using FloatVec = Vectorized<float>;
  const auto c = AdamWCoefficients<FloatVec>::template make<float>(scalars);
  update_with_master<param_t, 2>(static_cast<param_t*>(param), static_cast<const param_t*>(grad),
                                 {master, exp_avg, exp_avg_sq}, n,
                                 [&](std::array<FloatVec, 4>& x) { adamw_update(x[0], x[1], x[2], x[3], c); });
}

template <typename param_t>
void sgd_master_segment(void* param, const void* grad, float* master, float* momentum_buffer, int64_t n,
                        const SGDScalars& scalars) {
  using FloatVec = Vectorized<float>;
  const auto c = SGDCoefficients<FloatVec>::template make<float>(scalars);
  if (scalars.use_momentum) {
    update_with_master<param_t, 1>(static_cast<param_t*>(param), static_cast<const param_t*>(grad),
                                   {master, momentum_buffer}, n,
                                   [&](std::array<FloatVec, 3>& x) { sgd_update(x[0], x[1], x[2], c); });
  } else {
    update_with_master<param_t, 0>(static_cast<param_t*>(param), static_cast<const param_t*>(grad), {master}, n,
                                   [&](std::array<FloatVec, 2>& x) {
                                     FloatVec unused_buffer;
                                     sgd_update(x[0], x[1], unused_buffer, c);
                                   });
  }
}

SegmentKernels make_segment_kernels(const char* instruction_set) {
  return {{&adamw_segment<float>, &adamw_segment<double>, &adamw_segment<at::Half>, &adamw_segment<at::BFloat16>},
          {&sgd_segment<float>, &sgd_segment<double>, &sgd_segment<at::Half>, &sgd_segment<at::BFloat16>},
          {&adamw_master_segment<float>, nullptr, &adamw_master_segment<at::Half>,
           &adamw_master_segment<at::BFloat16>},
          {&sgd_master_segment<float>, nullptr, &sgd_master_segment<at::Half>, &sgd_master_segment<at::BFloat16>},
          instruction_set};
}

}  // namespace
}  // namespace autoshard::optim
