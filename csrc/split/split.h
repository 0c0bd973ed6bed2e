#pragma once
// The split kernel family: array_split (by sections or by indices) and shard all reduce to
// "copy these ranges along `dim` into fresh contiguous tensors"; each device provides that
// one primitive and registers the three ops through register_split_kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "split/split_rule.h"

namespace autoshard {

// Wraps a negative dim and rejects 0-d tensors and out-of-range dims, naming `op` and the
// tensor argument (`arg`). Every op that takes a dimension checks it here.
int64_t checked_split_dim(const at::Tensor& self, int64_t dim, const char* op, const char* arg = "self");

// The split length along `dim`. A symbolic length is specialised: uneven pieces depend on
// its exact value.
inline int64_t split_length(const at::Tensor& self, int64_t dim) {
  return self.sym_size(dim).guard_int(__FILE__, __LINE__);
}

// Empty contiguous pieces shaped like `self` with `dim` resized to each range's length.
std::vector<at::Tensor> allocate_pieces(const at::Tensor& self, int64_t dim, const std::vector<Range>& ranges);

// `CopyRanges` is the device's primitive:
//   std::vector<at::Tensor> (const at::Tensor& self, int64_t dim, const std::vector<Range>&)
template <std::vector<at::Tensor> (*CopyRanges)(const at::Tensor&, int64_t, const std::vector<Range>&)>
void register_split_kernels(torch::Library& m) {
  m.impl("array_split", [](const at::Tensor& self, int64_t sections, int64_t dim) {
    check_sections(sections, "array_split");
    dim = checked_split_dim(self, dim, "array_split");
    return CopyRanges(self, dim, ranges_from_sections(split_length(self, dim), sections));
  });
  m.impl("array_split.indices", [](const at::Tensor& self, at::IntArrayRef indices, int64_t dim) {
    dim = checked_split_dim(self, dim, "array_split");
    return CopyRanges(self, dim, ranges_from_indices(split_length(self, dim), indices.vec()));
  });
  m.impl("shard", [](const at::Tensor& self, int64_t rank, int64_t world_size, int64_t dim) {
    dim = checked_split_dim(self, dim, "shard");
    return CopyRanges(self, dim, {shard_range(split_length(self, dim), rank, world_size)})[0];
  });
}

}  // namespace autoshard
