// CPU kernels of the vocab-parallel embedding: the masked lookup is one pass over the tokens
// in parallel (a memcpy per row held, a memset per row not held); the backward buckets the
// tokens by destination row and sums each row on one thread, in token order, so the result
// does not depend on the thread count.
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "nn/embedding.h"

namespace autoshard {
namespace {

constexpr int64_t kGrainBytes = 32 * 1024;
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(bytes_per_item, 1));
}

// Rows are moved as bytes: the lookup works for every dtype, and all-zero bytes are zero in all of them.
template <typename index_t>
void lookup_rows(const index_t* ids, int64_t tokens, const char* table, int64_t rows, int64_t row_bytes,
                 int64_t vocab_start, int64_t vocab_size, char* out) {
  // The first offending position, so the error names the same token whatever the threading.
  std::atomic<int64_t> first_bad{kNone};
  at::parallel_for(0, tokens, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(ids[i]);
      const int64_t row = id - vocab_start;
      const bool held = row >= 0 && row < rows;
      if (row_bytes > 0) {
        char* dst = out + i * row_bytes;
        if (held) {
          std::memcpy(dst, table + row * row_bytes, row_bytes);
        } else {
          std::memset(dst, 0, row_bytes);
        }
      }
      if (!held && (id < 0 || id >= vocab_size)) {
        int64_t seen = first_bad.load();
        while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
        }
      }
    }
  });
  const int64_t bad = first_bad.load();
  TORCH_CHECK_INDEX(bad == kNone, "vocab_parallel_lookup: ids must be in [0, vocab_size) = [0, ", vocab_size,
                    "), got ", (bad == kNone ? 0 : static_cast<int64_t>(ids[bad])), " at flat position ", bad);
}

at::Tensor lookup_cpu(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                      int64_t vocab_size) {
  check_lookup_args(ids, weight, vocab_start, padding_idx, vocab_size);
  const at::Tensor table = weight.contiguous();
  const at::Tensor flat_ids = ids.contiguous();
  std::vector<int64_t> shape = ids.sizes().vec();
  shape.push_back(weight.size(1));
  at::Tensor out = at::empty(shape, weight.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t tokens = flat_ids.numel();
  if (tokens == 0) return out;
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  AT_DISPATCH_INDEX_TYPES(flat_ids.scalar_type(), "vocab_parallel_lookup", [&] {
    lookup_rows<index_t>(flat_ids.const_data_ptr<index_t>(), tokens, static_cast<const char*>(table.const_data_ptr()),
                         table.size(0), row_bytes, vocab_start, vocab_size, static_cast<char*>(out.data_ptr()));
  });
  return out;
}

// Token positions grouped by local row, each group in token order (a stable counting sort):
// tokens of row r are order[offsets[r] .. offsets[r + 1]).
template <typename index_t>
void bucket_by_row(const index_t* ids, int64_t tokens, int64_t rows, int64_t vocab_start, int64_t padding_idx,
                   std::vector<int64_t>& offsets, std::vector<int64_t>& order) {
  offsets.assign(rows + 1, 0);
  auto local_row = [&](int64_t i) -> int64_t {
    const int64_t id = static_cast<int64_t>(ids[i]);
    const int64_t row = id - vocab_start;
    return (id == padding_idx || row < 0 || row >= rows) ? -1 : row;
  };
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t row = local_row(i);
    if (row >= 0) ++offsets[row + 1];
  }
  for (int64_t r = 0; r < rows; ++r) offsets[r + 1] += offsets[r];
  order.resize(offsets[rows]);
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t row = local_row(i);
    if (row >= 0) order[cursor[row]++] = i;
  }
}

template <typename scalar_t>
void sum_rows(const scalar_t* grad, int64_t dim, int64_t rows, const std::vector<int64_t>& offsets,
              const std::vector<int64_t>& order, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t tokens_per_row = std::max<int64_t>(1, static_cast<int64_t>(order.size()) / std::max<int64_t>(rows, 1));
  const int64_t grain = grain_for(dim * static_cast<int64_t>(sizeof(scalar_t)) * tokens_per_row);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    // Half-precision gradients are summed in float, as ATen's embedding backward does.
    std::vector<acc_t> acc(std::is_same_v<acc_t, scalar_t> ? 0 : dim);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* __restrict__ dst = out + r * dim;
      const int64_t first = offsets[r], last = offsets[r + 1];
      if (first == last) {
        std::fill(dst, dst + dim, scalar_t(0));
        continue;
      }
      if constexpr (std::is_same_v<acc_t, scalar_t>) {
        std::memcpy(dst, grad + order[first] * dim, dim * sizeof(scalar_t));
        for (int64_t k = first + 1; k < last; ++k) {
          const scalar_t* __restrict__ src = grad + order[k] * dim;
          for (int64_t j = 0; j < dim; ++j) dst[j] += src[j];
        }
      } else {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t k = first; k < last; ++k) {
          const scalar_t* __restrict__ src = grad + order[k] * dim;
          for (int64_t j = 0; j < dim; ++j) acc[j] += static_cast<acc_t>(src[j]);
        }
        for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<scalar_t>(acc[j]);
      }
    }
  });
}

at::Tensor lookup_backward_cpu(const at::Tensor& grad, const at::Tensor& ids, int64_t num_rows, int64_t vocab_start,
                               int64_t padding_idx) {
  check_lookup_backward_args(grad, ids, num_rows, vocab_start, padding_idx);
  const int64_t dim = grad.size(-1);
  at::Tensor out = at::empty({num_rows, dim}, grad.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const at::Tensor flat_grad = grad.contiguous();
  const at::Tensor flat_ids = ids.contiguous();
  std::vector<int64_t> offsets, order;
  AT_DISPATCH_INDEX_TYPES(flat_ids.scalar_type(), "vocab_parallel_lookup_backward", [&] {
    bucket_by_row<index_t>(flat_ids.const_data_ptr<index_t>(), flat_ids.numel(), num_rows, vocab_start, padding_idx,
                           offsets, order);
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat_grad.scalar_type(), "vocab_parallel_lookup_backward",
                                  [&] {
                                    sum_rows<scalar_t>(flat_grad.const_data_ptr<scalar_t>(), dim, num_rows, offsets,
                                                       order, out.data_ptr<scalar_t>());
                                  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CPU, m) {
  m.impl("vocab_parallel_lookup", &lookup_cpu);
  m.impl("vocab_parallel_lookup_backward", &lookup_backward_cpu);
}

}  // namespace autoshard
