#include "slices.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "../split/split_rule.h"

namespace autoshard::checkpoint {

namespace {

std::vector<int64_t> repeated_unit_run(int64_t full_size, int64_t world_size, int64_t rank, int64_t units,
                                       int64_t repeat) {
  TORCH_CHECK_VALUE(units > 0 && repeat > 0, "shard_ranges: repeat needs positive units and repeat, got units=",
                    units, ", repeat=", repeat);
  TORCH_CHECK_VALUE(full_size % units == 0, "shard_ranges: full_size ", full_size, " does not split into ", units,
                    " whole units");
  TORCH_CHECK_VALUE(units * repeat >= world_size, "shard_ranges: units * repeat = ", units * repeat,
                    " finer units cannot give each of ", world_size, " ranks one");
  const Range fine = shard_range(units * repeat, rank, world_size);
  const int64_t first = fine.start / repeat;
  const int64_t end = (fine.start + fine.length + repeat - 1) / repeat;
  const int64_t width = full_size / units;
  return {first * width, (end - first) * width};
}

}  // namespace

std::vector<int64_t> shard_ranges(int64_t full_size, int64_t world_size, int64_t rank,
                                  std::optional<int64_t> units, at::OptionalIntArrayRef parts,
                                  std::optional<int64_t> repeat) {
  TORCH_CHECK_VALUE(world_size > 0, "shard_ranges: world_size must be positive, got ", world_size);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "shard_ranges: rank must be in [0, ", world_size, "), got ", rank);
  TORCH_CHECK_VALUE(full_size >= 0, "shard_ranges: full_size must be >= 0, got ", full_size);
  if (repeat.has_value()) {
    TORCH_CHECK_VALUE(units.has_value() && !parts.has_value(), "shard_ranges: repeat goes with units and without parts");
    return repeated_unit_run(full_size, world_size, rank, *units, *repeat);
  }
  std::vector<int64_t> part_sizes = parts.has_value() ? parts->vec() : std::vector<int64_t>{full_size};
  int64_t total = 0;
  for (int64_t size : part_sizes) {
    TORCH_CHECK_VALUE(size >= 0, "shard_ranges: parts must be >= 0, got ", size);
    total += size;
  }
  TORCH_CHECK_VALUE(total == full_size, "shard_ranges: parts ", at::IntArrayRef(part_sizes),
                    " must add up to full_size ", full_size);
  std::vector<int64_t> flat;
  int64_t offset = 0;
  for (int64_t size : part_sizes) {
    const int64_t unit_count = units.value_or(size);
    TORCH_CHECK_VALUE(unit_count > 0 || size == 0, "shard_ranges: units must be positive, got ", unit_count);
    const int64_t granule = unit_count > 0 ? size / unit_count : 0;
    TORCH_CHECK_VALUE(unit_count == 0 || granule * unit_count == size, "shard_ranges: a part of size ", size,
                      " does not split into ", unit_count, " whole units");
    const Range piece = shard_range(unit_count, rank, world_size);
    flat.push_back(offset + piece.start * granule);
    flat.push_back(piece.length * granule);
    offset += size;
  }
  return flat;
}

namespace {

// One dimension's overlap of the two selections: `length` elements at local position
// `src` in the source and `dst` in the destination.
struct Segment {
  int64_t src;
  int64_t dst;
  int64_t length;
};

std::vector<std::vector<Range>> parse_selection(at::IntArrayRef flat, at::IntArrayRef shape, const char* arg) {
  std::vector<std::vector<Range>> dims;
  size_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK_VALUE(i < flat.size(), "copy_runs: ", arg, " describes fewer dims than shape ", shape);
    const int64_t count = flat[i++];
    TORCH_CHECK_VALUE(count >= 0 && i + 2 * count <= flat.size(), "copy_runs: ", arg, " has a bad run count ",
                      count, " for dim ", d);
    std::vector<Range> runs;
    for (int64_t r = 0; r < count; ++r) {
      const Range run{flat[i], flat[i + 1]};
      i += 2;
      TORCH_CHECK_VALUE(run.start >= 0 && run.length >= 0 && run.start + run.length <= shape[d], "copy_runs: ", arg,
                        " run (", run.start, ", ", run.length, ") of dim ", d, " lies outside [0, ", shape[d], ")");
      runs.push_back(run);
    }
    dims.push_back(std::move(runs));
  }
  TORCH_CHECK_VALUE(i == flat.size(), "copy_runs: ", arg, " describes more dims than shape ", shape);
  return dims;
}

int64_t local_length(const std::vector<Range>& runs) {
  int64_t total = 0;
  for (const Range& run : runs) total += run.length;
  return total;
}

std::vector<Segment> overlap(const std::vector<Range>& src, const std::vector<Range>& dst) {
  std::vector<Segment> segments;
  int64_t src_pos = 0;
  for (const Range& s : src) {
    int64_t dst_pos = 0;
    for (const Range& d : dst) {
      const int64_t begin = std::max(s.start, d.start);
      const int64_t end = std::min(s.start + s.length, d.start + d.length);
      if (begin < end) segments.push_back({src_pos + begin - s.start, dst_pos + begin - d.start, end - begin});
      dst_pos += d.length;
    }
    src_pos += s.length;
  }
  std::sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) { return a.src < b.src; });
  return segments;
}

}  // namespace

at::Tensor copy_runs(at::IntArrayRef shape, int64_t itemsize, at::IntArrayRef src, at::IntArrayRef dst) {
  TORCH_CHECK_VALUE(itemsize > 0, "copy_runs: itemsize must be positive, got ", itemsize);
  for (int64_t n : shape) TORCH_CHECK_VALUE(n >= 0, "copy_runs: shape must be non-negative, got ", shape);
  const auto src_dims = parse_selection(src, shape, "src");
  const auto dst_dims = parse_selection(dst, shape, "dst");
  const int64_t ndim = static_cast<int64_t>(shape.size());

  std::vector<std::vector<Segment>> segments(ndim);
  std::vector<int64_t> src_stride(ndim + 1, itemsize), dst_stride(ndim + 1, itemsize);
  bool empty = false;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    segments[d] = overlap(src_dims[d], dst_dims[d]);
    empty = empty || segments[d].empty();
    src_stride[d] = src_stride[d + 1] * local_length(src_dims[d]);
    dst_stride[d] = dst_stride[d + 1] * local_length(dst_dims[d]);
  }
  std::vector<int64_t> runs;
  if (!empty) {
    // Trailing dims that both sides hold whole and in the same order fold into one run, so
    // a row slice is a single run however many dims follow the split one.
    int64_t block_dim = ndim - 1;
    int64_t block_bytes = itemsize;
    while (block_dim >= 0 && segments[block_dim].size() == 1) {
      const Segment& s = segments[block_dim][0];
      const int64_t full = shape[block_dim];
      if (s.src != 0 || s.dst != 0 || s.length != full || local_length(src_dims[block_dim]) != full ||
          local_length(dst_dims[block_dim]) != full) {
        break;
      }
      block_bytes *= full;
      --block_dim;
    }
    if (block_dim < 0) {
      runs = {0, 0, block_bytes};
    } else {
      // Walk the outer dims element by element (in source order) and emit the block dim's
      // segments at each position.
      std::vector<size_t> seg_index(block_dim, 0);
      std::vector<int64_t> within(block_dim, 0);
      while (true) {
        int64_t src_base = 0, dst_base = 0;
        for (int64_t d = 0; d < block_dim; ++d) {
          const Segment& s = segments[d][seg_index[d]];
          src_base += (s.src + within[d]) * src_stride[d + 1];
          dst_base += (s.dst + within[d]) * dst_stride[d + 1];
        }
        for (const Segment& s : segments[block_dim]) {
          const int64_t src_byte = src_base + s.src * src_stride[block_dim + 1];
          const int64_t dst_byte = dst_base + s.dst * dst_stride[block_dim + 1];
          const int64_t nbytes = s.length * block_bytes;
          const size_t n = runs.size();
          if (n >= 3 && runs[n - 3] + runs[n - 1] == src_byte && runs[n - 2] + runs[n - 1] == dst_byte) {
            runs[n - 1] += nbytes;
          } else {
            runs.insert(runs.end(), {src_byte, dst_byte, nbytes});
          }
        }
        int64_t d = block_dim - 1;
        for (; d >= 0; --d) {
          if (++within[d] < segments[d][seg_index[d]].length) break;
          within[d] = 0;
          if (++seg_index[d] < segments[d].size()) break;
          seg_index[d] = 0;
        }
        if (d < 0) break;
      }
    }
  }
  at::Tensor out = at::empty({static_cast<int64_t>(runs.size() / 3), 3}, at::kLong);
  std::copy(runs.begin(), runs.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace autoshard::checkpoint
