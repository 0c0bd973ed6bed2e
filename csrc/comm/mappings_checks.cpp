#include "comm/mappings.h"
#include "split/split.h"

namespace autoshard::comm {

int64_t checked_gather_dim(const at::Tensor& x, int64_t dim, int64_t length, const c10d::ProcessGroup& group,
                           const char* function) {
  TORCH_CHECK_VALUE(length >= 0, function, ": length must be >= 0, got ", length);
  const int64_t d = checked_split_dim(x, dim, function, "x");
  const int64_t rank = group.getRank();
  const int64_t world = group.getSize();
  const int64_t expected = shard_range(length, rank, world).length;
  // A symbolic size is specialised: the pieces' layout depends on its exact value.
  const int64_t got = x.sym_size(d).guard_int(__FILE__, __LINE__);
  TORCH_CHECK_VALUE(got == expected, function, ": x must hold this rank's piece of length ", length,
                    " along dim ", dim, ": split_sizes(", length, ", ", world, ")[", rank, "] = ", expected,
                    " elements, got ", got);
  return d;
}

std::pair<int64_t, Range> checked_scatter_piece(const at::Tensor& x, int64_t dim, const c10d::ProcessGroup& group,
                                                const char* function) {
  const int64_t d = checked_split_dim(x, dim, function, "x");
  const int64_t length = x.sym_size(d).guard_int(__FILE__, __LINE__);
  return {d, shard_range(length, group.getRank(), group.getSize())};
}

}  // namespace autoshard::comm
