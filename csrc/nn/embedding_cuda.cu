// CUDA kernels of the vocab-parallel embedding, each one launch: the lookup gives every token
// row to one block (threads across the row), copying it if held and writing zeros if not; the
// backward adds each held token's gradient row into its table row with atomics (in float for
// half-precision gradients, as the CPU kernel and ATen's embedding backward sum them).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "nn/embedding.h"

namespace autoshard {
namespace {

constexpr int kThreads = 128;

// Rows are moved by element width: the lookup works for every dtype, and a value-initialised
// element is all-zero bytes, which is zero in all of them.
template <int Bytes>
struct alignas(Bytes) Element {
  unsigned char bytes[Bytes];
};

int64_t block_count(int64_t tokens) {
  const int64_t most = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return std::max<int64_t>(1, std::min(tokens, most));
}

template <typename T, typename index_t>
__global__ void lookup_kernel(const index_t* __restrict__ ids, int64_t tokens, const T* __restrict__ table,
                              int64_t rows, int64_t dim, int64_t vocab_start, int64_t vocab_size,
                              T* __restrict__ out) {
  for (int64_t i = blockIdx.x; i < tokens; i += gridDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    CUDA_KERNEL_ASSERT_MSG(id >= 0 && id < vocab_size, "vocab_parallel_lookup: ids must be in [0, vocab_size)");
    const int64_t row = id - vocab_start;
    T* dst = out + i * dim;
    if (row >= 0 && row < rows) {
      const T* src = table + row * dim;
      for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
    } else {
      for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = T{};
    }
  }
}

template <typename T, typename index_t>
void launch_lookup(const at::Tensor& ids, const at::Tensor& table, int64_t vocab_start, int64_t vocab_size,
                   at::Tensor& out) {
  const int64_t tokens = ids.numel();
  lookup_kernel<T, index_t><<<block_count(tokens), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      ids.const_data_ptr<index_t>(), tokens, static_cast<const T*>(table.const_data_ptr()), table.size(0),
      table.size(1), vocab_start, vocab_size, static_cast<T*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor lookup_cuda(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                       int64_t vocab_size) {
  check_lookup_args(ids, weight, vocab_start, padding_idx, vocab_size);
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor table = weight.contiguous();
  const at::Tensor flat_ids = ids.contiguous();
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(weight.size(1));
  at::Tensor out = at::empty(shape, weight.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t width = static_cast<int64_t>(weight.element_size());
  TORCH_CHECK_VALUE(width == 1 || width == 2 || width == 4 || width == 8 || width == 16,
                    "vocab_parallel_lookup: weight's element size must be 1, 2, 4, 8 or 16 bytes, got ", width);
  AT_DISPATCH_INDEX_TYPES(flat_ids.scalar_type(), "vocab_parallel_lookup", [&] {
    switch (width) {
      case 1: launch_lookup<Element<1>, index_t>(flat_ids, table, vocab_start, vocab_size, out); break;
      case 2: launch_lookup<Element<2>, index_t>(flat_ids, table, vocab_start, vocab_size, out); break;
      case 4: launch_lookup<Element<4>, index_t>(flat_ids, table, vocab_start, vocab_size, out); break;
      case 8: launch_lookup<Element<8>, index_t>(flat_ids, table, vocab_start, vocab_size, out); break;
      default: launch_lookup<Element<16>, index_t>(flat_ids, table, vocab_start, vocab_size, out); break;
    }
  });
  return out;
}

template <typename scalar_t, typename acc_t, typename index_t>
__global__ void accumulate_kernel(const scalar_t* __restrict__ grad, const index_t* __restrict__ ids, int64_t tokens,
                                  int64_t rows, int64_t dim, int64_t vocab_start, int64_t padding_idx,
                                  acc_t* __restrict__ out) {
  for (int64_t i = blockIdx.x; i < tokens; i += gridDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    const int64_t row = id - vocab_start;
    if (id == padding_idx || row < 0 || row >= rows) continue;
    const scalar_t* src = grad + i * dim;
    acc_t* dst = out + row * dim;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) gpuAtomicAdd(dst + j, static_cast<acc_t>(src[j]));
  }
}

at::Tensor lookup_backward_cuda(const at::Tensor& grad, const at::Tensor& ids, int64_t num_rows, int64_t vocab_start,
                                int64_t padding_idx) {
  check_lookup_backward_args(grad, ids, num_rows, vocab_start, padding_idx);
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t dim = grad.size(-1);
  const bool half = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  // Summing many bf16 rows into a bf16 row loses a bit per addition: half-precision gradients
  // are summed into a float buffer and rounded once.
  at::Tensor out = at::zeros({num_rows, dim}, grad.options()
                                                  .dtype(half ? at::kFloat : grad.scalar_type())
                                                  .memory_format(at::MemoryFormat::Contiguous));
  const int64_t tokens = ids.numel();
  if (out.numel() == 0 || tokens == 0) return out.to(grad.scalar_type());
  const at::Tensor flat_grad = grad.contiguous();
  const at::Tensor flat_ids = ids.contiguous();
  AT_DISPATCH_INDEX_TYPES(flat_ids.scalar_type(), "vocab_parallel_lookup_backward", [&] {
    using id_t = index_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat_grad.scalar_type(),
                                    "vocab_parallel_lookup_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      accumulate_kernel<scalar_t, acc_t, id_t><<<block_count(tokens), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          flat_grad.const_data_ptr<scalar_t>(), flat_ids.const_data_ptr<id_t>(), tokens, num_rows, dim,
          vocab_start, padding_idx, out.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return half ? out.to(grad.scalar_type()) : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  m.impl("vocab_parallel_lookup", &lookup_cuda);
  m.impl("vocab_parallel_lookup_backward", &lookup_backward_cuda);
}

}  // namespace autoshard
