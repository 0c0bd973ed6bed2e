// CUDA kernel of the split family: every piece is written by one launch (blockIdx.y picks the
// piece), reading the input through its strides, so a non-contiguous input costs no extra copy.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "split/split.h"

namespace autoshard {
namespace {

constexpr int kMaxDims = 8;
constexpr int kMaxPiecesPerLaunch = 64;  // bounded by the 4 KB kernel-parameter space
constexpr int kThreads = 256;

// The input after merging adjacent dimensions that are laid out as one; the split axis is
// never merged, since each piece has its own length there.
struct InputGeometry {
  int ndim;
  int split_axis;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

struct PieceBatch {
  void* dst[kMaxPiecesPerLaunch];
  int64_t start[kMaxPiecesPerLaunch];
  int64_t length[kMaxPiecesPerLaunch];
  int64_t numel[kMaxPiecesPerLaunch];
};

// Copies by element width: a split moves bytes, whatever the dtype.
template <int Bytes>
struct alignas(Bytes) Element {
  unsigned char bytes[Bytes];
};

template <typename T>
__global__ void split_copy_kernel(const T* __restrict__ src, InputGeometry geometry, PieceBatch batch) {
  const int piece = blockIdx.y;
  const int64_t numel = batch.numel[piece];
  T* __restrict__ dst = static_cast<T*>(batch.dst[piece]);
  const int64_t base = batch.start[piece] * geometry.strides[geometry.split_axis];
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < numel;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = e;
    int64_t offset = base;
    for (int d = geometry.ndim - 1; d >= 0; --d) {
      const int64_t size = d == geometry.split_axis ? batch.length[piece] : geometry.sizes[d];
      offset += (rest % size) * geometry.strides[d];
      rest /= size;
    }
    dst[e] = src[offset];
  }
}

// Drops size-1 dimensions and merges neighbours whose strides chain, keeping `dim` apart.
bool collapse(const at::Tensor& self, int64_t dim, InputGeometry& g) {
  std::vector<int64_t> sizes, strides;
  int split_axis = -1;
  for (int64_t d = 0; d < self.dim(); ++d) {
    const int64_t size = self.size(d), stride = self.stride(d);
    if (d == dim) {
      split_axis = static_cast<int>(sizes.size());
      sizes.push_back(size);
      strides.push_back(stride);
      continue;
    }
    if (size == 1) continue;
    const bool mergeable = !sizes.empty() && static_cast<int>(sizes.size()) - 1 != split_axis &&
                           strides.back() == stride * size;
    if (mergeable) {
      sizes.back() *= size;
      strides.back() = stride;
    } else {
      sizes.push_back(size);
      strides.push_back(stride);
    }
  }
  if (sizes.size() > static_cast<size_t>(kMaxDims)) return false;
  g.ndim = static_cast<int>(sizes.size());
  g.split_axis = split_axis;
  for (int d = 0; d < g.ndim; ++d) {
    g.sizes[d] = sizes[d];
    g.strides[d] = strides[d];
  }
  return true;
}

template <typename T>
void launch_batches(const at::Tensor& self, const InputGeometry& geometry, const std::vector<Range>& ranges,
                    std::vector<at::Tensor>& pieces) {
  const int max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < ranges.size(); first += kMaxPiecesPerLaunch) {
    const size_t count = std::min<size_t>(kMaxPiecesPerLaunch, ranges.size() - first);
    PieceBatch batch;
    int64_t largest = 0;
    for (size_t i = 0; i < count; ++i) {
      batch.dst[i] = pieces[first + i].data_ptr();
      batch.start[i] = ranges[first + i].start;
      batch.length[i] = ranges[first + i].length;
      batch.numel[i] = pieces[first + i].numel();
      largest = std::max(largest, batch.numel[i]);
    }
    if (largest == 0) continue;
    const int64_t wanted = (largest + kThreads - 1) / kThreads;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(wanted, max_blocks)), static_cast<unsigned>(count));
    split_copy_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(self.const_data_ptr()), geometry,
                                                         batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

std::vector<at::Tensor> copy_ranges_cuda(const at::Tensor& self, int64_t dim, const std::vector<Range>& ranges) {
  const c10::cuda::CUDAGuard guard(self.device());
  std::vector<at::Tensor> pieces = allocate_pieces(self, dim, ranges);
  if (self.numel() == 0) return pieces;
  InputGeometry geometry;
  at::Tensor input = self;
  if (!collapse(input, dim, geometry)) {
    input = self.contiguous();
    collapse(input, dim, geometry);
  }
  const int64_t width = static_cast<int64_t>(input.element_size());
  TORCH_CHECK_VALUE(width == 1 || width == 2 || width == 4 || width == 8 || width == 16,
                    "array_split: element size must be 1, 2, 4, 8 or 16 bytes, got ", width);
  switch (width) {
    case 1: launch_batches<Element<1>>(input, geometry, ranges, pieces); break;
    case 2: launch_batches<Element<2>>(input, geometry, ranges, pieces); break;
    case 4: launch_batches<Element<4>>(input, geometry, ranges, pieces); break;
    case 8: launch_batches<Element<8>>(input, geometry, ranges, pieces); break;
    default: launch_batches<Element<16>>(input, geometry, ranges, pieces); break;
  }
  return pieces;
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  register_split_kernels<copy_ranges_cuda>(m);
}

}  // namespace autoshard
