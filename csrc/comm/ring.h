#pragma once
// Reduce-scatter and all-gather as rings of point-to-point transfers, used on gloo.
//
// Why: gloo's reduce-scatter sums the whole tensor on every rank before each keeps its piece,
// so on gloo sequence parallelism's reduce-scatter + all-gather cost more than the one all-reduce
// they replace. A ring moves (N-1)/N of the tensor once in each direction, as NCCL's do.
// A ring also reads and writes pieces along any axis: a piece of the tokens of a
// [batch, tokens, hidden] tensor goes over the wire without the axis first being moved to the
// front of a copy of the whole tensor.
//
// Every rank must call these in the same order on a group, as with any collective: each call
// takes the next block of point-to-point tags of its group, so two calls in flight at once
// (one started with async_op) never take each other's messages.
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace autoshard::comm {

// At two ranks both directions of a ring share one connection, and gloo's connection handles
// one direction at a time (a message being read holds it), so each rank's sends wait on its
// receives. A second group over the same two ranks (made by autoshard.distributed.prepare_rings)
// gives the data from the higher rank to the lower a connection of its own. Every rank of the
// group must register the same `return_group_name` before the next ring on `group_name`; an
// empty one takes the registration back.
void set_ring_return_group(c10::string_view group_name, c10::string_view return_group_name);

// Whether collectives of `t` on `group` go as rings: a CPU tensor on a group whose CPU backend
// is gloo, unless the environment sets AUTOSHARD_GLOO_RINGS=0 (then gloo's own collectives).
bool takes_ring(const at::Tensor& t, c10d::ProcessGroup& group);

// This rank's piece along `dim` (sizes[rank] there, a new contiguous tensor) of the sum over the
// group of x, whose pieces along `dim` are sizes[0], sizes[1], ... With `async_op` the first
// transfers are only started and the rest runs when the result is waited for (wait_tensor).
// Each piece's sum is taken in the ring's order, the same whatever `dim` and however x is laid
// out, so a piece summed from x and from x.movedim(dim, 0) is bit-identical.
at::Tensor ring_reduce_scatter(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes,
                               c10d::ProcessGroup& group, bool async_op);

// Every rank's `local` (rank r's of sizes[r] along `dim`) concatenated along `dim`, new and
// contiguous.
at::Tensor ring_all_gather(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes,
                           c10d::ProcessGroup& group);

}  // namespace autoshard::comm
