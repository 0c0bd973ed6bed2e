// Device-independent pieces of the split family: argument checks, piece allocation, and unsplit (the gradient), which is composed of ATen ops.
#include "split/split.h"

namespace autoshard {

int64_t checked_split_dim(const at::Tensor& self, int64_t dim, const char* op, const char* arg) {
  const int64_t ndim = self.dim();
  TORCH_CHECK_INDEX(ndim > 0, op, ": ", arg, " must have at least 1 dimension, got a 0-d tensor");
  TORCH_CHECK_INDEX(dim >= -ndim && dim < ndim, op, ": dim must be in [", -ndim, ", ", ndim, ") for a ", ndim,
                    "-d tensor, got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

std::vector<at::Tensor> allocate_pieces(const at::Tensor& self, int64_t dim, const std::vector<Range>& ranges) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(ranges.size());
  std::vector<c10::SymInt> shape = self.sym_sizes().vec();
  for (const Range& r : ranges) {
    shape[dim] = r.length;
    pieces.push_back(at::empty_symint(shape, self.options().memory_format(at::MemoryFormat::Contiguous)));
  }
  return pieces;
}

// Pieces that tile [0, length) in order are one cat; otherwise overlapping pieces add up
// and uncovered elements stay zero, which is what the gradient of an index split needs.
static at::Tensor unsplit(at::TensorList pieces, at::IntArrayRef starts, int64_t length, int64_t dim) {
  TORCH_CHECK_VALUE(!pieces.empty(), "unsplit: pieces must hold at least one tensor");
  TORCH_CHECK_VALUE(starts.size() == pieces.size(), "unsplit: starts must have one entry per piece (",
                    pieces.size(), "), got ", starts.size());
  dim = checked_split_dim(pieces[0], dim, "unsplit");
  bool tiles = true;
  int64_t next = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t size = pieces[i].sym_size(dim).guard_int(__FILE__, __LINE__);
    TORCH_CHECK_VALUE(starts[i] >= 0 && starts[i] + size <= length, "unsplit: piece ", i, " spans [", starts[i],
                      ", ", starts[i] + size, ") which is outside [0, length) = [0, ", length, ")");
    tiles = tiles && starts[i] == next;
    next = starts[i] + size;
  }
  if (tiles && next == length) return at::cat(pieces, dim);
  std::vector<c10::SymInt> shape = pieces[0].sym_sizes().vec();
  shape[dim] = length;
  at::Tensor result = at::zeros_symint(shape, pieces[0].options());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t size = pieces[i].sym_size(dim).guard_int(__FILE__, __LINE__);
    if (size > 0) result.narrow(dim, starts[i], size).add_(pieces[i]);
  }
  return result;
}

TORCH_LIBRARY_IMPL(autoshard, CompositeImplicitAutograd, m) {
  m.impl("unsplit", &unsplit);
}

}  // namespace autoshard
