#pragma once
// Slice arithmetic for reading and writing shards: which runs of the full tensor a rank
// holds, and which byte runs move between two local tensors that hold different parts of
// the same full tensor (a rank's slice of a checkpoint file, or another world size's shard).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace autoshard::checkpoint {

// The (start, length) runs of a dimension of `full_size` that `rank` holds, flattened, in
// local order. `parts` (consecutive fused parts, e.g. Q, K and V) are each split on their
// own, in whole `units` (attention heads) when given. With `repeat` (KV heads of grouped-query
// attention), each unit serves `repeat` finer units (query heads); those are split, and the
// rank holds the one run of units its finer units use, which may overlap its neighbours'.
std::vector<int64_t> shard_ranges(int64_t full_size, int64_t world_size, int64_t rank,
                                  std::optional<int64_t> units, at::OptionalIntArrayRef parts,
                                  std::optional<int64_t> repeat);

// A selection of a full tensor of shape `shape`, flattened per dimension as
// [count, start_0, length_0, ..., start_{count-1}, length_{count-1}]: the local tensor is the
// row-major product of those runs. The (src_byte, dst_byte, nbytes) runs, an int64 [n, 3]
// tensor sorted by source offset, that copy the overlap of `src` into `dst`.
at::Tensor copy_runs(at::IntArrayRef shape, int64_t itemsize, at::IntArrayRef src, at::IntArrayRef dst);

}  // namespace autoshard::checkpoint
