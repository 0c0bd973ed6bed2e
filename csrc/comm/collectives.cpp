#include "comm/collectives.h"

#include <c10/core/DeviceGuard.h>

#include "comm/counters.h"
#include "split/split_rule.h"

namespace autoshard::comm {

void all_reduce_sum_(at::Tensor& tensor, c10d::ProcessGroup& group) {
  if (group.getSize() == 1 || tensor.numel() == 0) return;
  const c10::DeviceGuard device_guard(tensor.device());
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  group.allreduce(tensors, options)->wait();
  count_collective(Collective::kAllReduce, static_cast<int64_t>(tensor.nbytes()));
}

at::Tensor all_gather_uneven(const at::Tensor& local, int64_t dim, int64_t length, c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  if (world == 1) return local.clone(at::MemoryFormat::Contiguous);
  const std::vector<int64_t> sizes = split_sizes(length, world);
  const int64_t widest = sizes.front();  // the first ranks hold the extra elements
  const bool even = sizes.back() == widest;
  std::vector<int64_t> shape = local.sizes().vec();
  shape[dim] = length;
  if (c10::multiply_integers(shape) == 0) return at::empty(shape, local.options());

  const c10::DeviceGuard device_guard(local.device());
  const int64_t mine = local.size(dim);
  shape[dim] = widest;
  at::Tensor padded;
  if (mine == widest) {
    padded = local.contiguous();  // only read by the collective
  } else {
    padded = at::empty(shape, local.options());
    padded.narrow(dim, 0, mine).copy_(local);
    // The pad never reaches the result; zeroing it keeps what goes over the wire defined.
    padded.narrow(dim, mine, widest - mine).zero_();
  }
  // Flat buffers: backends differ in how they cut the output into per-rank pieces, but all
  // agree on a 1-d output of world times the input's elements.
  at::Tensor flat_input = padded.view({-1});
  at::Tensor flat_output = at::empty({world * padded.numel()}, local.options());
  group.all_gather_single(flat_output, flat_input)->wait();
  count_collective(Collective::kAllGather, static_cast<int64_t>(padded.nbytes()));
  std::vector<int64_t> gathered_shape{world};
  gathered_shape.insert(gathered_shape.end(), shape.begin(), shape.end());
  const at::Tensor gathered = flat_output.view(gathered_shape);

  if (even && dim == 0) {
    // [world, widest, ...] laid out in rank order is already the concatenation along dim 0.
    shape[0] = length;
    return gathered.view(shape);
  }
  std::vector<at::Tensor> pieces;
  pieces.reserve(world);
  for (int64_t r = 0; r < world; ++r) pieces.push_back(gathered.select(0, r).narrow(dim, 0, sizes[r]));
  return at::cat(pieces, dim);
}

}  // namespace autoshard::comm
