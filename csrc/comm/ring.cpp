#include "comm/ring.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

namespace autoshard::comm {
namespace {

// The first tag of the next ring on `group`, `steps` tags reserved for it. Tags wrap well before
// int's limit; two rings whose tags met after a wrap would be 2^30 / world calls apart.
int reserve_tags(c10d::ProcessGroup& group, int64_t steps) {
  static std::mutex mutex;
  static std::unordered_map<std::string, int64_t> next;
  const std::lock_guard<std::mutex> lock(mutex);
  int64_t& first = next[group.getGroupName()];
  const int64_t tag = first;
  first = (first + steps) % (int64_t{1} << 30);
  return static_cast<int>(tag);
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) starts[i] = starts[i - 1] + sizes[i - 1];
  return starts;
}

int64_t wrapped(int64_t i, int64_t world) {
  return ((i % world) + world) % world;
}

// How a piece goes over the wire. A piece along `dim` of a contiguous tensor lies in `rows`
// runs of memory, one per index of the axes before `dim`. Runs of at least kRunBytes each go as
// a message of their own, sent from and received into the tensor where they lie; smaller ones go
// as one message of a contiguous copy. Both ends derive the layout from the piece's shape, so
// their messages match. Posting a gloo message costs about what copying 4 MiB costs (0.3-0.4 ms
// on a 2-core machine), so shorter runs are cheaper copied.
constexpr int64_t kRunBytes = 4 * 1024 * 1024;

int64_t message_count(const at::Tensor& piece, int64_t dim) {
  const int64_t rows = c10::multiply_integers(piece.sizes().begin(), piece.sizes().begin() + dim);
  if (rows <= 1 || piece.numel() == 0) return 1;
  return piece.numel() / rows * static_cast<int64_t>(piece.element_size()) >= kRunBytes ? rows : 1;
}

// The piece's messages where it lies, or nothing when they are not each one run of memory.
std::vector<at::Tensor> messages_in_place(const at::Tensor& piece, int64_t dim) {
  const int64_t count = message_count(piece, dim);
  if (count == 1) return piece.is_contiguous() ? std::vector<at::Tensor>{piece} : std::vector<at::Tensor>{};
  for (int64_t i = 0; i + 1 < dim; ++i) {
    if (piece.stride(i) != piece.stride(i + 1) * piece.size(i + 1)) return {};
  }
  std::vector<int64_t> grid_shape{count};
  grid_shape.insert(grid_shape.end(), piece.sizes().begin() + dim, piece.sizes().end());
  std::vector<int64_t> grid_strides{piece.stride(dim - 1)};
  grid_strides.insert(grid_strides.end(), piece.strides().begin() + dim, piece.strides().end());
  const at::Tensor grid = piece.as_strided(grid_shape, grid_strides, piece.storage_offset());
  if (!grid.select(0, 0).is_contiguous()) return {};
  return grid.unbind(0);
}

// The messages of a contiguous tensor holding a piece shaped as `piece` is.
std::vector<at::Tensor> messages_of_copy(const at::Tensor& contiguous, int64_t dim) {
  const int64_t count = message_count(contiguous, dim);
  if (count == 1) return {contiguous};
  return contiguous.view({count, -1}).unbind(0);
}

// The piece's messages to send: where it lies if it can, else from a contiguous copy.
std::vector<at::Tensor> messages_to_send(const at::Tensor& piece, int64_t dim) {
  std::vector<at::Tensor> messages = messages_in_place(piece, dim);
  return messages.empty() ? messages_of_copy(piece.contiguous(), dim) : messages;
}

// One ring step's transfers: `to_send` to the next rank, `into` from the previous one, message i
// under tag + i. Empty messages are skipped at both ends, which both know from the sizes.
class Exchange {
 public:
  Exchange(c10d::ProcessGroup& group, int tag, std::vector<at::Tensor> to_send, std::vector<at::Tensor> into)
      : to_send_(std::move(to_send)), into_(std::move(into)) {
    const int world = group.getSize();
    const int rank = group.getRank();
    for (size_t i = 0; i < into_.size(); ++i) {
      if (into_[i].numel() == 0) continue;
      std::vector<at::Tensor> buffers{into_[i]};
      works_.push_back(group.recv(buffers, (rank + world - 1) % world, tag + static_cast<int>(i)));
    }
    for (size_t i = 0; i < to_send_.size(); ++i) {
      if (to_send_[i].numel() == 0) continue;
      std::vector<at::Tensor> buffers{to_send_[i]};
      works_.push_back(group.send(buffers, (rank + 1) % world, tag + static_cast<int>(i)));
    }
  }

  void wait() {
    for (auto& work : works_) work->wait();
    works_.clear();
  }

 private:
  std::vector<at::Tensor> to_send_;  // kept alive until sent
  std::vector<at::Tensor> into_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// Tags a ring takes: a block per step, as many as the most messages a piece can go in.
int64_t tags_per_step(const at::Tensor& x, int64_t dim) {
  return std::max<int64_t>(1, c10::multiply_integers(x.sizes().begin(), x.sizes().begin() + dim));
}

// The ring reduce-scatter's state. At step k a rank sends its running sum of piece
// (rank - k - 1) and receives the previous rank's running sum of piece (rank - k - 2), adding its
// own part of that piece; after world - 1 steps the piece it holds is its own, summed over all.
class RingReduceScatter {
 public:
  RingReduceScatter(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes, c10d::ProcessGroup& group)
      : x_(x), dim_(dim), sizes_(sizes), starts_(starts_of(sizes)), group_(&group), world_(group.getSize()),
        rank_(group.getRank()), per_step_(tags_per_step(x, dim)), tag_(reserve_tags(group, (world_ - 1) * per_step_)) {
    out_ = at::empty(piece(rank_).sizes(), x.options());
  }

  const at::Tensor& out() const { return out_; }

  // Starts step 0: this rank's own part of the next piece, sent from where it lies.
  void start() { post(0, messages_to_send(piece(wrapped(rank_ - 1, world_)), dim_)); }

  // Finishes the step in flight and runs the rest; the result is then in out().
  void finish() {
    if (!exchange_) return;
    for (int64_t k = step_;; ++k) {
      exchange_->wait();
      const at::Tensor own = piece(wrapped(rank_ - k - 2, world_));
      if (k == world_ - 2) {
        at::add_out(out_, receiving_, own);
        break;
      }
      post(k + 1, messages_of_copy(receiving_.add(own), dim_));
    }
    exchange_.reset();
  }

 private:
  at::Tensor piece(int64_t r) const { return x_.narrow(dim_, starts_[r], sizes_[r]); }

  void post(int64_t k, std::vector<at::Tensor> to_send) {
    step_ = k;
    receiving_ = at::empty(piece(wrapped(rank_ - k - 2, world_)).sizes(), x_.options());
    exchange_ = std::make_unique<Exchange>(*group_, tag_ + static_cast<int>(k * per_step_), std::move(to_send),
                                           messages_of_copy(receiving_, dim_));
  }

  at::Tensor x_;
  int64_t dim_;
  std::vector<int64_t> sizes_, starts_;
  c10d::ProcessGroup* group_;
  int64_t world_, rank_, per_step_;
  int tag_;
  at::Tensor out_, receiving_;
  std::unique_ptr<Exchange> exchange_;
  int64_t step_ = 0;
};

// The handle wait_tensor waits on for a ring started with async_op: its wait runs the ring's
// remaining steps. The calling thread does the adds, as a synchronous collective's would.
class RingWork : public c10d::Work {
 public:
  explicit RingWork(std::shared_ptr<RingReduceScatter> ring)
      : c10d::Work(-1, c10d::OpType::REDUCE_SCATTER), ring_(std::move(ring)) {}

  bool wait(std::chrono::milliseconds /*timeout*/) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (ring_) {
      ring_->finish();
      ring_.reset();
    }
    return true;
  }

  bool isCompleted() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    return !ring_;
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<RingReduceScatter> ring_;
};

}  // namespace

bool takes_ring(const at::Tensor& t, c10d::ProcessGroup& group) {
  if (!t.device().is_cpu()) return false;
  const char* rings = std::getenv("AUTOSHARD_GLOO_RINGS");
  if (rings != nullptr && std::string_view(rings) == "0") return false;
  try {
    return group.getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const c10::Error&) {
    return false;  // no CPU backend on this group: not ours to route
  }
}

at::Tensor ring_reduce_scatter(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes,
                               c10d::ProcessGroup& group, bool async_op) {
  auto ring = std::make_shared<RingReduceScatter>(x, dim, sizes, group);
  ring->start();
  at::Tensor out = ring->out();
  if (async_op) {
    c10d::register_work(out, c10::make_intrusive<RingWork>(std::move(ring)));
  } else {
    ring->finish();
  }
  return out;
}

at::Tensor ring_all_gather(const at::Tensor& local, int64_t dim, const std::vector<int64_t>& sizes,
                           c10d::ProcessGroup& group) {
  const int64_t world = group.getSize();
  const int64_t rank = group.getRank();
  const std::vector<int64_t> starts = starts_of(sizes);
  std::vector<int64_t> shape = local.sizes().vec();
  shape[dim] = starts.back() + sizes.back();
  at::Tensor out = at::empty(shape, local.options());
  out.narrow(dim, starts[rank], sizes[rank]).copy_(local);
  const int64_t per_step = tags_per_step(out, dim);
  const int tag = reserve_tags(group, (world - 1) * per_step);
  // At step k a rank passes on piece (rank - k), its own first, then the one it last received,
  // each received where it belongs in `out` when its runs allow, else through a buffer.
  std::vector<at::Tensor> held = messages_in_place(out.narrow(dim, starts[rank], sizes[rank]), dim);
  if (held.empty()) held = messages_of_copy(local.contiguous(), dim);
  for (int64_t k = 0; k < world - 1; ++k) {
    const int64_t received = wrapped(rank - k - 1, world);
    const at::Tensor place = out.narrow(dim, starts[received], sizes[received]);
    std::vector<at::Tensor> into = messages_in_place(place, dim);
    const at::Tensor buffer = into.empty() ? at::empty(place.sizes(), local.options()) : at::Tensor();
    if (buffer.defined()) into = messages_of_copy(buffer, dim);
    Exchange exchange(group, tag + static_cast<int>(k * per_step), held, into);
    exchange.wait();
    if (buffer.defined()) place.copy_(buffer);
    held = into;
  }
  return out;
}

}  // namespace autoshard::comm
