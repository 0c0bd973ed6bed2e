// CPU kernel of the split family: contiguous inputs are copied row by row in
// parallel; strided inputs go through ATen's (also parallel) strided copy.
#include <cstring>

#include <ATen/Parallel.h>

#include "split/split.h"

namespace autoshard {
namespace {

constexpr int64_t kGrainBytes = 64 * 1024;

// A plain 16-byte-word loop rather than memcpy: for rows of a few KiB landing on freshly
// allocated pages, glibc's memcpy measured 0.72-0.77x the speed of torch's own copy loop on
// a dim-1 split of 8192x8192 fp32; this loop is at parity (benchmarks/bench_split.py).
void copy_bytes(char* __restrict dst, const char* __restrict src, int64_t bytes) {
  int64_t k = 0;
  for (; k + 16 <= bytes; k += 16) {
    uint64_t a, b;
    std::memcpy(&a, src + k, 8);
    std::memcpy(&b, src + k + 8, 8);
    std::memcpy(dst + k, &a, 8);
    std::memcpy(dst + k + 8, &b, 8);
  }
  for (; k < bytes; ++k) dst[k] = src[k];
}

void parallel_copy(char* dst, const char* src, int64_t bytes) {
  at::parallel_for(0, bytes, kGrainBytes, [&](int64_t begin, int64_t end) {
    copy_bytes(dst + begin, src + begin, end - begin);
  });
}

std::vector<at::Tensor> copy_ranges_cpu(const at::Tensor& self, int64_t dim, const std::vector<Range>& ranges) {
  std::vector<at::Tensor> pieces = allocate_pieces(self, dim, ranges);
  if (self.numel() == 0) return pieces;
  if (!self.is_contiguous()) {
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (ranges[i].length > 0) pieces[i].copy_(self.narrow(dim, ranges[i].start, ranges[i].length));
    }
    return pieces;
  }
  // A contiguous tensor is [outer, length, inner]: each piece takes a run of `length` from
  // every outer row.
  // Sizes, not strides: a contiguous tensor may carry any stride on a dimension of size 1.
  const int64_t length = self.size(dim);
  const int64_t inner = c10::multiply_integers(self.sizes().slice(dim + 1));
  const int64_t inner_bytes = inner * static_cast<int64_t>(self.element_size());
  const int64_t outer = c10::multiply_integers(self.sizes().slice(0, dim));
  const char* src = static_cast<const char*>(self.const_data_ptr());
  if (outer == 1) {
    // Few large blocks: parallelise inside each block.
    for (size_t i = 0; i < ranges.size(); ++i) {
      parallel_copy(static_cast<char*>(pieces[i].data_ptr()), src + ranges[i].start * inner_bytes,
                      ranges[i].length * inner_bytes);
    }
    return pieces;
  }
  const int64_t row_bytes = length * inner_bytes;
  const int64_t grain_rows = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, outer, grain_rows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const char* src_row = src + row * row_bytes;
      for (size_t i = 0; i < ranges.size(); ++i) {
        const int64_t piece_row_bytes = ranges[i].length * inner_bytes;
        if (piece_row_bytes == 0) continue;
        copy_bytes(static_cast<char*>(pieces[i].data_ptr()) + row * piece_row_bytes,
                   src_row + ranges[i].start * inner_bytes, piece_row_bytes);
      }
    }
  });
  return pieces;
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  register_split_kernels<copy_ranges_cpu>(m);
}

}  // namespace autoshard
