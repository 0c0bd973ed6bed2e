#pragma once
// The vocab-parallel embedding family: each rank holds rows [vocab_start, vocab_start + rows)
// of the full table. The lookup copies the rows it holds and writes zeros for every other id,
// so that summing the ranks' outputs gives the full table's lookup; its backward accumulates
// the output gradient into the rows this rank holds.
#include <ATen/ATen.h>

namespace autoshard {

// Argument checks shared by every device's lookup kernel (shapes and ranges only: the ids'
// values are checked by the kernels, which read them anyway).
void check_lookup_args(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_start, int64_t padding_idx,
                       int64_t vocab_size);
void check_lookup_backward_args(const at::Tensor& grad, const at::Tensor& ids, const c10::SymInt& num_rows,
                                int64_t vocab_start, int64_t padding_idx);

// ids.shape + [embedding_dim]
std::vector<c10::SymInt> lookup_output_shape(const at::Tensor& ids, const at::Tensor& weight);

}  // namespace autoshard
