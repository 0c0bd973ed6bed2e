#include "split/split_rule.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace autoshard {

void check_sections(int64_t sections, const char* function) {
  TORCH_CHECK_VALUE(sections > 0, function, ": sections must be a positive integer, got ", sections);
  TORCH_CHECK_VALUE(sections <= kMaxSections, function, ": sections must be at most ", kMaxSections,
                    " (each section becomes a tensor), got ", sections);
}

std::vector<int64_t> split_sizes(int64_t length, int64_t sections) {
  check_sections(sections, "split_sizes");
  TORCH_CHECK_VALUE(length >= 0, "split_sizes: length must be >= 0, got ", length);
  const int64_t base = length / sections;
  const int64_t extra = length % sections;
  std::vector<int64_t> sizes(sections, base);
  for (int64_t i = 0; i < extra; ++i) sizes[i] += 1;
  return sizes;
}

std::vector<Range> ranges_from_sections(int64_t length, int64_t sections) {
  const std::vector<int64_t> sizes = split_sizes(length, sections);
  std::vector<Range> ranges;
  ranges.reserve(sizes.size());
  int64_t start = 0;
  for (int64_t size : sizes) {
    ranges.push_back({start, size});
    start += size;
  }
  return ranges;
}

static int64_t clamp_slice_bound(int64_t index, int64_t length) {
  if (index < 0) index += length;
  return std::clamp<int64_t>(index, 0, length);
}

std::vector<Range> ranges_from_indices(int64_t length, const std::vector<int64_t>& indices) {
  std::vector<int64_t> bounds;
  bounds.reserve(indices.size() + 2);
  bounds.push_back(0);
  bounds.insert(bounds.end(), indices.begin(), indices.end());
  bounds.push_back(length);
  std::vector<Range> ranges;
  ranges.reserve(bounds.size() - 1);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t start = clamp_slice_bound(bounds[i], length);
    const int64_t stop = clamp_slice_bound(bounds[i + 1], length);
    ranges.push_back({start, std::max<int64_t>(stop - start, 0)});
  }
  return ranges;
}

Range shard_range(int64_t length, int64_t rank, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size > 0, "shard: world_size must be a positive integer, got ", world_size);
  TORCH_CHECK_INDEX(rank >= 0 && rank < world_size,
                    "shard: rank must be in [0, world_size) = [0, ", world_size, "), got ", rank);
  TORCH_CHECK_VALUE(length >= 0, "shard: length must be >= 0, got ", length);
  // Computed directly: a vector of every rank's range would be as long as world_size.
  const int64_t base = length / world_size;
  const int64_t extra = length % world_size;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

}  // namespace autoshard
