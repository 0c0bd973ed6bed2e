// CUDA kernels of the vocab-parallel cross-entropy: each row is one block (threads across the
// vocabulary shard, a warp-shuffle reduction for the sums), accumulating in the op-math type
// (float for bf16 and fp16). Everything stays on the device: the checks of the orchestration
// are asserted there too.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "loss/cross_entropy.h"

namespace autoshard::loss {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

int64_t block_count(int64_t rows) {
  const int64_t most = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 8;
  return std::max<int64_t>(1, std::min(rows, most));
}

// The block's sum of v, valid in thread 0; `shared` holds kWarps values.
template <typename acc_t>
__device__ acc_t block_sum(acc_t v, acc_t* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // an earlier call's readers are done with `shared`
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kWarps ? shared[threadIdx.x] : acc_t(0);
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <typename scalar_t, typename acc_t>
__global__ void row_sums_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t columns,
                                const acc_t* __restrict__ row_max, const int64_t* __restrict__ local_target,
                                acc_t* __restrict__ sum_exp, acc_t* __restrict__ target,
                                acc_t* __restrict__ shifted) {
  __shared__ acc_t shared[kWarps];
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const scalar_t* row = x + i * columns;
    const acc_t m = row_max[i];
    acc_t s = 0, z = 0;
    for (int64_t j = threadIdx.x; j < columns; j += blockDim.x) {
      const acc_t v = static_cast<acc_t>(row[j]) - m;
      s += ::exp(v);
      z += v;
    }
    s = block_sum(s, shared);
    if (shifted != nullptr) z = block_sum(z, shared);
    if (threadIdx.x == 0) {
      sum_exp[i] = s;
      if (shifted != nullptr) shifted[i] = z;
      const int64_t t = local_target[i];
      target[i] = t >= 0 ? static_cast<acc_t>(row[t]) - m : acc_t(0);
    }
  }
}

void row_sums_cuda(const at::Tensor& x, const at::Tensor& row_max, const at::Tensor& local_target,
                   at::Tensor& sum_exp, at::Tensor& target_sums) {
  const int64_t rows = x.size(0), columns = x.size(1);
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_parallel_cross_entropy", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* target = target_sums.data_ptr<acc_t>();
    acc_t* shifted = target_sums.size(0) > 1 ? target + rows : nullptr;
    row_sums_kernel<scalar_t, acc_t><<<block_count(rows), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), rows, columns, row_max.const_data_ptr<acc_t>(),
        local_target.const_data_ptr<int64_t>(), sum_exp.data_ptr<acc_t>(), target, shifted);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t, typename acc_t>
__global__ void logits_grad_kernel(const scalar_t* __restrict__ x, int64_t rows, int64_t columns,
                                   const acc_t* __restrict__ lse, const int64_t* __restrict__ local_target,
                                   const acc_t* __restrict__ scale, const acc_t* __restrict__ target_coef,
                                   const acc_t* __restrict__ uniform, scalar_t* __restrict__ grad) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const scalar_t* row = x + i * columns;
    scalar_t* dst = grad + i * columns;
    const acc_t a = scale[i], b = target_coef[i], c = uniform[i], l = lse[i];
    const int64_t t = local_target[i];
    const bool silent = a == acc_t(0) && b == acc_t(0) && c == acc_t(0);
    for (int64_t j = threadIdx.x; j < columns; j += blockDim.x) {
      if (silent) {
        dst[j] = scalar_t(0);
      } else {
        const acc_t g = a * ::exp(static_cast<acc_t>(row[j]) - l) - c - (j == t ? b : acc_t(0));
        dst[j] = static_cast<scalar_t>(g);
      }
    }
  }
}

at::Tensor logits_grad_cuda(const at::Tensor& x, const at::Tensor& lse, const at::Tensor& local_target,
                            const at::Tensor& scale, const at::Tensor& target_coef, const at::Tensor& uniform) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = x.size(0), columns = x.size(1);
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "vocab_parallel_cross_entropy_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    logits_grad_kernel<scalar_t, acc_t><<<block_count(rows), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), rows, columns, lse.const_data_ptr<acc_t>(),
        local_target.const_data_ptr<int64_t>(), scale.const_data_ptr<acc_t>(), target_coef.const_data_ptr<acc_t>(),
        uniform.const_data_ptr<acc_t>(), out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

constexpr CrossEntropyKernels kCudaKernels{&row_sums_cuda, &logits_grad_cuda};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                                            c10::string_view group_name, int64_t ignore_index,
                                                            double label_smoothing, c10::string_view reduction) {
  const c10::cuda::CUDAGuard guard(logits.device());
  return cross_entropy_forward(logits, labels, group_name, ignore_index, label_smoothing, reduction, kCudaKernels);
}

at::Tensor backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& labels,
                         const at::Tensor& lse, const at::Tensor& vocab_range, int64_t ignore_index,
                         double label_smoothing, c10::string_view reduction) {
  const c10::cuda::CUDAGuard guard(logits.device());
  return cross_entropy_backward(grad_loss, logits, labels, lse, vocab_range, ignore_index, label_smoothing, reduction,
                                kCudaKernels);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy", &forward_cuda);
  m.impl("vocab_parallel_cross_entropy_backward", &backward_cuda);
}

}  // namespace autoshard::loss
