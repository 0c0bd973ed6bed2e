#include "comm/collectives.h"

#include <algorithm>
#include <numeric>

#include <c10/core/DeviceGuard.h>
#include <torch/version.h>

#include "comm/counters.h"
#include "comm/ring.h"
#include "split/split_rule.h"

// torch 2.13 named ProcessGroup's flat collectives all_gather_single and reduce_scatter_single
// and kept the old names as deprecated aliases; older torch (2.11 on our GPU machines) has
// only the old names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define AUTOSHARD_ALL_GATHER_SINGLE all_gather_single
#define AUTOSHARD_REDUCE_SCATTER_SINGLE reduce_scatter_single
#else
#define AUTOSHARD_ALL_GATHER_SINGLE _allgather_base
#define AUTOSHARD_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#endif

namespace autoshard::comm {
namespace {

int64_t widest_of(const std::vector<int64_t>& sizes) {
  return sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
}

bool even(const std::vector<int64_t>& sizes) {
  return std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == sizes.front(); });
}

// `piece` along `dim`, padded with zeros to `widest` there (itself when already that wide).
// The pad never reaches a result; zeroing it keeps what goes over the wire defined.
at::Tensor padded_piece(const at::Tensor& piece, int64_t dim, int64_t widest) {
  const int64_t mine = piece.size(dim);
  if (mine == widest) return piece.contiguous();
  std::vector<int64_t> shape = piece.sizes().vec();
  shape[dim] = widest;
  at::Tensor padded = at::empty(shape, piece.options());
  padded.narrow(dim, 0, mine).copy_(piece);
  padded.narrow(dim, mine, widest - mine).zero_();
  return padded;
}

}  // namespace

void all_reduce_(at::Tensor& tensor, c10d::ReduceOp::RedOpType op, c10d::ProcessGroup& group) {
  if (group.getSize() == 1 || tensor.numel() == 0) return;
  const c10::DeviceGuard device_guard(tensor.device());
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(op);
  group.allreduce(tensors, options)->wait();
  count_collective(Collective::kAllReduce, static_cast<int64_t>(tensor.nbytes()), group.getGroupName());
}

at::Tensor all_gather_uneven(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes,
                             c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  if (world == 1) return local.clone(at::MemoryFormat::Contiguous);
  const int64_t length = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  std::vector<int64_t> shape = local.sizes().vec();
  shape[dim] = length;
  if (c10::multiply_integers(shape) == 0) return at::empty(shape, local.options());

  if (takes_ring(local, group)) {
    at::Tensor gathered = ring_all_gather(local, dim, sizes, group);
    count_collective(Collective::kAllGather, static_cast<int64_t>(local.nbytes()), group.getGroupName());
    return gathered;
  }
  const c10::DeviceGuard device_guard(local.device());
  const int64_t widest = widest_of(sizes);
  const at::Tensor padded = padded_piece(local, dim, widest);
  // Flat buffers: backends differ in how they cut the output into per-rank pieces, but all
  // agree on a 1-d output of world times the input's elements.
  at::Tensor flat_input = padded.view({-1});
  at::Tensor flat_output = at::empty({world * padded.numel()}, local.options());
  group.AUTOSHARD_ALL_GATHER_SINGLE(flat_output, flat_input)->wait();
  count_collective(Collective::kAllGather, static_cast<int64_t>(padded.nbytes()), group.getGroupName());
  std::vector<int64_t> gathered_shape{world};
  gathered_shape.insert(gathered_shape.end(), padded.sizes().begin(), padded.sizes().end());
  const at::Tensor gathered = flat_output.view(gathered_shape);

  if (even(sizes) && dim == 0) {
    // [world, widest, ...] laid out in rank order is already the concatenation along dim 0.
    return gathered.view(shape);
  }
  std::vector<at::Tensor> pieces;
  pieces.reserve(world);
  for (int64_t r = 0; r < world; ++r) pieces.push_back(gathered.select(0, r).narrow(dim, 0, sizes[r]));
  return at::cat(pieces, dim);
}

at::Tensor all_gather_split(const at::Tensor& local, int64_t dim, int64_t length, c10d::ProcessGroup& group) {
  if (group.getSize() == 1) return local.clone(at::MemoryFormat::Contiguous);
  return all_gather_uneven(local, dim, split_sizes(length, group.getSize()), group);
}

at::Tensor reduce_scatter_uneven(const at::Tensor& flat, const std::vector<int64_t>& sizes,
                                 c10d::ProcessGroup& group, bool async_op) {
  const int64_t world = group.getSize();
  const int64_t rank = group.getRank();
  if (world == 1) return flat.clone(at::MemoryFormat::Contiguous);
  const int64_t widest = widest_of(sizes);
  if (widest == 0) return at::empty({0}, flat.options());
  if (takes_ring(flat, group)) {
    at::Tensor mine = ring_reduce_scatter(flat, 0, sizes, group, async_op);
    count_collective(Collective::kReduceScatter, static_cast<int64_t>(flat.nbytes()), group.getGroupName());
    return mine;
  }
  const c10::DeviceGuard device_guard(flat.device());
  at::Tensor input;
  if (even(sizes)) {
    input = flat.contiguous();
  } else {
    input = at::zeros({world, widest}, flat.options());
    int64_t offset = 0;
    for (int64_t r = 0; r < world; ++r) {
      input.select(0, r).narrow(0, 0, sizes[r]).copy_(flat.narrow(0, offset, sizes[r]));
      offset += sizes[r];
    }
    input = input.view({-1});
  }
  at::Tensor output = at::empty({widest}, flat.options());
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  auto work = group.AUTOSHARD_REDUCE_SCATTER_SINGLE(output, input, options);
  count_collective(Collective::kReduceScatter, static_cast<int64_t>(input.nbytes()), group.getGroupName());
  at::Tensor mine = sizes[rank] == widest ? output : output.narrow(0, 0, sizes[rank]);
  if (async_op) {
    c10d::register_work(mine, work);
  } else {
    work->wait();
  }
  return mine;
}

at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes,
                                c10d::ProcessGroup& group) {
  const int64_t rank = group.getRank();
  if (group.getSize() == 1 || x.numel() == 0) {
    return x.narrow(dim, std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0}), sizes[rank])
        .clone(at::MemoryFormat::Contiguous);
  }
  if (takes_ring(x, group)) {
    at::Tensor mine = ring_reduce_scatter(x, dim, sizes, group, /*async_op=*/false);
    count_collective(Collective::kReduceScatter, static_cast<int64_t>(x.nbytes()), group.getGroupName());
    return mine;
  }
  // The backend's reduce-scatter takes every rank's piece as one run of a flat buffer.
  const at::Tensor front = x.movedim(dim, 0).contiguous();
  const int64_t per_slice = front.numel() / front.size(0);
  std::vector<int64_t> flat_sizes = sizes;
  for (auto& s : flat_sizes) s *= per_slice;
  std::vector<int64_t> front_shape = front.sizes().vec();
  front_shape[0] = sizes[rank];
  return reduce_scatter_uneven(front.view({-1}), flat_sizes, group, /*async_op=*/false)
      .view(front_shape)
      .movedim(0, dim)
      .contiguous();
}

at::Tensor all_reduce_bucket(at::TensorList tensors, c10d::ProcessGroup& group, bool async_op) {
  std::vector<at::Tensor> flats;
  flats.reserve(tensors.size());
  for (const auto& t : tensors) flats.push_back(t.reshape({-1}));
  at::Tensor bucket = at::cat(flats);
  if (group.getSize() == 1 || bucket.numel() == 0) return bucket;
  const c10::DeviceGuard device_guard(bucket.device());
  std::vector<at::Tensor> buffers{bucket};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  auto work = group.allreduce(buffers, options);
  count_collective(Collective::kAllReduce, static_cast<int64_t>(bucket.nbytes()), group.getGroupName());
  if (async_op) {
    c10d::register_work(bucket, work);
  } else {
    work->wait();
  }
  return bucket;
}

void broadcast_(at::Tensor& tensor, int64_t src, c10d::ProcessGroup& group) {
  if (group.getSize() == 1 || tensor.numel() == 0) return;
  const c10::DeviceGuard device_guard(tensor.device());
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = src;
  group.broadcast(tensors, options)->wait();
  count_collective(Collective::kBroadcast, static_cast<int64_t>(tensor.nbytes()), group.getGroupName());
}

}  // namespace autoshard::comm
