// Copying many small byte runs out of a window of a file (a block read into host memory)
// into a shard: a column slice of a checkpoint tensor is one run per row, too many to copy
// one Python call at a time.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace autoshard::checkpoint {
namespace {

void check_byte_tensor(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous(), "copy_byte_runs_: ", arg,
                    " must be a contiguous 1-D uint8 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
}

void check_arguments(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& runs) {
  check_byte_tensor(dst, "dst");
  check_byte_tensor(src, "src");
  TORCH_CHECK_VALUE(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous(),
                    "copy_byte_runs_: runs must be a contiguous int64 [n, 3] tensor, got ", runs.scalar_type(),
                    " of shape ", runs.sizes());
}

// Each run (src byte, dst byte, nbytes) has source bytes in the file's coordinates; `src`
// holds bytes [src_offset, src_offset + src.numel()) of the file. The part of every run that
// falls in the window is copied; the rest is left for another window.
void copy_byte_runs_cpu(at::Tensor& dst, const at::Tensor& src, const at::Tensor& runs, int64_t src_offset) {
  check_arguments(dst, src, runs);
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu() && runs.device().is_cpu(),
                    "copy_byte_runs_: dst, src and runs must be CPU tensors");
  const int64_t* r = runs.const_data_ptr<int64_t>();
  const int64_t count = runs.size(0);
  const int64_t window_end = src_offset + src.numel();
  const int64_t dst_size = dst.numel();
  const uint8_t* in = src.const_data_ptr<uint8_t>();
  uint8_t* out = dst.data_ptr<uint8_t>();
  // Validate every run before writing anything, so a bad run leaves dst untouched.
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = r[3 * i], d = r[3 * i + 1], n = r[3 * i + 2];
    TORCH_CHECK_VALUE(n >= 0 && d >= 0 && d + n <= dst_size && s >= 0, "copy_byte_runs_: run ", i, " (", s, ", ", d,
                      ", ", n, ") does not fit a destination of ", dst_size, " bytes");
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t s = r[3 * i], d = r[3 * i + 1], n = r[3 * i + 2];
    const int64_t begin = std::max(s, src_offset), end = std::min(s + n, window_end);
    if (begin < end) std::memcpy(out + d + (begin - s), in + (begin - src_offset), end - begin);
  }
}

void copy_byte_runs_meta(at::Tensor& dst, const at::Tensor& src, const at::Tensor& runs, int64_t) {
  check_arguments(dst, src, runs);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  m.impl("copy_byte_runs_", &copy_byte_runs_cpu);
}

TORCH_LIBRARY_IMPL(autoshard, Meta, m) {
  m.impl("copy_byte_runs_", &copy_byte_runs_meta);
}

}  // namespace autoshard::checkpoint
