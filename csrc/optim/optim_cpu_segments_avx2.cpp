// The optim CPU kernels for x86-64 CPUs with AVX2, FMA and F16C, compiled here for that
// instruction set whatever the build's flags, and used only when the CPU reports it (see
// segment_kernels() in optim_cpu.cpp).
//
// `#pragma GCC target` switches code generation but, unlike -mavx2, does not define the
// feature macros that ATen's and Sleef's headers test, so they are defined here as -mavx2
// -mfma -mf16c would. CPU_CAPABILITY puts ATen's vector types into a namespace of their own,
// as ATen's own AVX2 build does, so they never mix with the baseline build's.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,popcnt")
// GCC does not give lambdas in ATen's headers the target above and notes that their AVX
// arguments change the ABI; none of those lambdas is called from these kernels.
#pragma GCC diagnostic ignored "-Wpsabi"
#define __SSE3__ 1
#define __SSSE3__ 1
#define __SSE4_1__ 1
#define __SSE4_2__ 1
#define __POPCNT__ 1
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define AUTOSHARD_OPTIM_AVX2 1
#include "optim/optim_cpu_segments_impl.h"
#else
#include "optim/optim_cpu_segments.h"
#endif

namespace autoshard::optim {

const SegmentKernels* avx2_segment_kernels() {
#if defined(AUTOSHARD_OPTIM_AVX2)
  static const SegmentKernels kernels = make_segment_kernels("avx2");
  return &kernels;
#else
  return nullptr;
#endif
}

}  // namespace autoshard::optim
