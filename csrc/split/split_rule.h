#pragma once
// numpy's array_split rule, in the one place the rest of autoshard takes it from.
#include <cstdint>
#include <vector>

namespace autoshard {

// A contiguous run [start, start + length) along the split dimension.
struct Range {
  int64_t start;
  int64_t length;
};

// Each section becomes a tensor (or at least a size in a vector): a count beyond this is a
// mistake, refused before anything is allocated.
constexpr int64_t kMaxSections = int64_t{1} << 24;

// Raises a ValueError naming `function`'s `sections` argument unless 0 < sections <= kMaxSections.
void check_sections(int64_t sections, const char* function);

// split_sizes(10, 3) == {4, 3, 3}: the first `length % sections` pieces get one extra.
std::vector<int64_t> split_sizes(int64_t length, int64_t sections);

// The pieces of an even-as-possible split into `sections`.
std::vector<Range> ranges_from_sections(int64_t length, int64_t sections);

// numpy's index form: piece i is python's slice [b[i]:b[i+1]] of [0, *indices, length],
// so negative indices wrap, out-of-range ones clamp, and a decreasing pair gives an
// empty piece (pieces may therefore overlap or skip elements).
std::vector<Range> ranges_from_indices(int64_t length, const std::vector<int64_t>& indices);

// One rank's piece of ranges_from_sections(length, world_size).
Range shard_range(int64_t length, int64_t rank, int64_t world_size);

}  // namespace autoshard
