#include "comm/ring.h"

#include "comm/group.h"

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

// A piece along `dim` of a contiguous tensor is a grid of `rows` runs of memory (one per index of
// the axes before `dim`), each `cols` elements long. It goes over the wire as messages of about
// kSegmentBytes: a long run in segments, short runs a few at a time. Messages are small enough
// that the ring works on one (adds it, forwards it) while the next is on the wire, and few
// enough that posting them (tens of microseconds each on gloo) stays cheap beside the transfer.
// Both ends derive the messages from the piece's shape alone, so they match.
constexpr int64_t kSegmentBytes = int64_t{1} << 20;

struct Message {
  int64_t row, rows, col, cols;
};

std::vector<Message> messages_of(int64_t rows, int64_t cols, int64_t element_size) {
  std::vector<Message> messages;
  if (rows == 0 || cols == 0) return messages;
  const int64_t run_bytes = cols * element_size;
  if (run_bytes >= kSegmentBytes) {
    const int64_t segments = (run_bytes + kSegmentBytes - 1) / kSegmentBytes;
    for (int64_t r = 0; r < rows; ++r) {
      // numpy's array_split of the run: the first (cols % segments) segments one longer.
      for (int64_t s = 0, col = 0; s < segments; ++s) {
        const int64_t length = cols / segments + (s < cols % segments ? 1 : 0);
        messages.push_back({r, 1, col, length});
        col += length;
      }
    }
  } else {
    const int64_t together = std::max<int64_t>(1, kSegmentBytes / run_bytes);
    for (int64_t r = 0; r < rows; r += together) messages.push_back({r, std::min(together, rows - r), 0, cols});
  }
  return messages;
}

// The pieces of a contiguous tensor along `dim` (starts[r], sizes[r] there), each seen as its
// grid of rows x cols, and their messages.
class Pieces {
 public:
  Pieces(const at::Tensor& whole, int64_t dim, const std::vector<int64_t>& sizes)
      : sizes_(sizes), starts_(starts_of(sizes)) {
    rows_ = c10::multiply_integers(whole.sizes().begin(), whole.sizes().begin() + dim);
    inner_ = c10::multiply_integers(whole.sizes().begin() + dim + 1, whole.sizes().end());
    grid_ = whole.numel() == 0 ? at::Tensor() : whole.view({rows_, -1});
    element_size_ = static_cast<int64_t>(whole.element_size());
  }

  std::vector<Message> messages(int64_t r) const { return messages_of(rows_, sizes_[r] * inner_, element_size_); }

  // The most messages any piece goes in: the tags a ring step reserves.
  int64_t most_messages() const {
    size_t most = 1;
    for (size_t r = 0; r < sizes_.size(); ++r) most = std::max(most, messages(static_cast<int64_t>(r)).size());
    return static_cast<int64_t>(most);
  }

  // Piece r's part of a message, where it lies in the whole tensor (rows x cols, strided).
  at::Tensor part(int64_t r, const Message& m) const {
    return grid_.narrow(0, m.row, m.rows).narrow(1, (starts_[r] * inner_) + m.col, m.cols);
  }

 private:
  std::vector<int64_t> sizes_, starts_;
  int64_t rows_ = 0, inner_ = 0, element_size_ = 0;
  at::Tensor grid_;
};

// A message's part of a contiguous piece-shaped buffer (rows x cols of the piece alone), always
// one run of memory.
at::Tensor part_of_piece(const at::Tensor& piece, int64_t rows, const Message& m) {
  return piece.view({rows, -1}).narrow(0, m.row, m.rows).narrow(1, m.col, m.cols);
}

std::mutex return_groups_mutex;
std::unordered_map<std::string, std::string> return_groups;  // group name -> its return group's

// The group carrying the data from the higher rank to the lower at two ranks (see ring.h), or
// `group` itself where none is registered.
c10::intrusive_ptr<c10d::ProcessGroup> return_group_of(c10d::ProcessGroup& group) {
  const c10::intrusive_ptr<c10d::ProcessGroup> same = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&group);
  if (group.getSize() != 2) return same;
  std::string name;
  {
    const std::lock_guard<std::mutex> lock(return_groups_mutex);
    const auto it = return_groups.find(group.getGroupName());
    if (it == return_groups.end()) return same;
    name = it->second;
  }
  return resolve_group(name, "ring collectives (the two-rank group's return group)");
}

// Point-to-point transfers in flight; each send's tensor kept alive until it is sent.
class Transfers {
 public:
  explicit Transfers(c10d::ProcessGroup& group)
      : next_((group.getRank() + 1) % group.getSize()),
        previous_((group.getRank() + group.getSize() - 1) % group.getSize()) {
    const c10::intrusive_ptr<c10d::ProcessGroup> returning = return_group_of(group);
    const c10::intrusive_ptr<c10d::ProcessGroup> same = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(&group);
    // Data from a lower rank to a higher goes on `group`, the other way on the return group.
    sending_ = group.getRank() < next_ ? same : returning;
    receiving_ = previous_ < group.getRank() ? same : returning;
  }

  void send(const at::Tensor& t, int tag) {
    std::vector<at::Tensor> buffers{t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1})};
    sends_.push_back(sending_->send(buffers, next_, tag));
    sent_.push_back(buffers.front());
  }

  // A receive into `t`, which must be one run of memory; its handle.
  c10::intrusive_ptr<c10d::Work> receive(const at::Tensor& t, int tag) {
    std::vector<at::Tensor> buffers{t.view({-1})};
    return receiving_->recv(buffers, previous_, tag);
  }

  void wait_sends() {
    for (auto& work : sends_) work->wait();
    sends_.clear();
    sent_.clear();
  }

 private:
  int next_, previous_;
  c10::intrusive_ptr<c10d::ProcessGroup> sending_, receiving_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
  std::vector<at::Tensor> sent_;
};

// The ring reduce-scatter's state. At step k a rank sends its running sum of piece
// (rank - k - 1) and receives the previous rank's running sum of piece (rank - k - 2), adding its
// own part of that piece; after world - 1 steps the piece it holds is its own, summed over all.
// Message by message: each received message is added to and forwarded while later ones are
// still arriving. The last step receives into the output itself.
class RingReduceScatter {
 public:
  RingReduceScatter(const at::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes, c10d::ProcessGroup& group)
      : x_(x.contiguous()), dim_(dim), sizes_(sizes), pieces_(x_, dim, sizes),
        world_(group.getSize()), rank_(group.getRank()), rows_(c10::multiply_integers(x.sizes().begin(), x.sizes().begin() + dim)),
        per_step_(pieces_.most_messages()), tag_(reserve_tags(group, (world_ - 1) * per_step_)), transfers_(group) {
    out_ = at::empty(piece_shape(rank_), x.options());
  }

  const at::Tensor& out() const { return out_; }

  // Starts step 0: the receives of its running sums, and this rank's own part of the next
  // piece sent from where it lies.
  void start() {
    post_receives(0);
    const int64_t sent = wrapped(rank_ - 1, world_);
    const std::vector<Message> messages = pieces_.messages(sent);
    for (size_t i = 0; i < messages.size(); ++i) transfers_.send(pieces_.part(sent, messages[i]), tag(0, i));
    started_ = true;
  }

  // Runs the steps after those posted; the result is then in out().
  void finish() {
    if (!started_) return;
    for (int64_t k = 0; k < world_ - 1; ++k) {
      const int64_t summed = wrapped(rank_ - k - 2, world_);
      const std::vector<Message> messages = pieces_.messages(summed);
      const at::Tensor running = receiving_;
      std::vector<c10::intrusive_ptr<c10d::Work>> arriving = std::move(arriving_);
      if (k + 1 < world_ - 1) post_receives(k + 1);
      for (size_t i = 0; i < messages.size(); ++i) {
        arriving[i]->wait();
        at::Tensor sum = part_of_piece(running, rows_, messages[i]);
        sum.add_(pieces_.part(summed, messages[i]));
        if (k + 1 < world_ - 1) transfers_.send(sum, tag(k + 1, i));
      }
    }
    transfers_.wait_sends();
    started_ = false;
  }

 private:
  std::vector<int64_t> piece_shape(int64_t r) const {
    std::vector<int64_t> shape = x_.sizes().vec();
    shape[dim_] = sizes_[r];
    return shape;
  }

  int tag(int64_t k, size_t i) const { return tag_ + static_cast<int>(k * per_step_ + static_cast<int64_t>(i)); }

  // Step k's receives, into the output at the last step, else into a fresh buffer.
  void post_receives(int64_t k) {
    const int64_t summed = wrapped(rank_ - k - 2, world_);
    receiving_ = k == world_ - 2 ? out_ : at::empty(piece_shape(summed), x_.options());
    const std::vector<Message> messages = pieces_.messages(summed);
    arriving_.clear();
    for (size_t i = 0; i < messages.size(); ++i) {
      arriving_.push_back(transfers_.receive(part_of_piece(receiving_, rows_, messages[i]), tag(k, i)));
    }
  }

  at::Tensor x_;
  int64_t dim_;
  std::vector<int64_t> sizes_;
  Pieces pieces_;
  int64_t world_, rank_, rows_, per_step_;
  int tag_;
  Transfers transfers_;
  at::Tensor out_, receiving_;
  std::vector<c10::intrusive_ptr<c10d::Work>> arriving_;
  bool started_ = false;
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

void set_ring_return_group(c10::string_view group_name, c10::string_view return_group_name) {
  const std::lock_guard<std::mutex> lock(return_groups_mutex);
  if (return_group_name.empty()) {
    return_groups.erase(std::string(group_name));
  } else {
    return_groups[std::string(group_name)] = std::string(return_group_name);
  }
}

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
  std::vector<int64_t> shape = local.sizes().vec();
  shape[dim] = starts_of(sizes).back() + sizes.back();
  at::Tensor out = at::empty(shape, local.options());
  const Pieces pieces(out, dim, sizes);
  const int64_t rows = c10::multiply_integers(shape.begin(), shape.begin() + dim);
  const int64_t per_step = pieces.most_messages();
  const int tag = reserve_tags(group, (world - 1) * per_step);
  const auto tag_of = [&](int64_t k, size_t i) { return tag + static_cast<int>(k * per_step + static_cast<int64_t>(i)); };
  Transfers transfers(group);

  // Step k's receives of piece (rank - k - 1): into `out` where a message is one run of memory
  // there, else into a buffer of its own, copied into place once it has arrived.
  struct Arriving {
    at::Tensor into, place;
    c10::intrusive_ptr<c10d::Work> work;
  };
  const auto post_receives = [&](int64_t k) {
    const int64_t received = wrapped(rank - k - 1, world);
    std::vector<Arriving> arriving;
    for (const Message& m : pieces.messages(received)) {
      const at::Tensor place = pieces.part(received, m);
      const at::Tensor into = place.is_contiguous() ? place : at::empty(place.sizes(), out.options());
      arriving.push_back({into, place, transfers.receive(into, tag_of(k, arriving.size()))});
    }
    return arriving;
  };

  // At step k a rank passes on piece (rank - k): its own first, sent from `local` and copied
  // into `out` while the transfers run, then each message as it arrives.
  std::vector<Arriving> arriving = post_receives(0);
  const at::Tensor own = local.contiguous();
  const std::vector<Message> own_messages = pieces.messages(rank);
  for (size_t i = 0; i < own_messages.size(); ++i) transfers.send(part_of_piece(own, rows, own_messages[i]), tag_of(0, i));
  out.narrow(dim, starts_of(sizes)[rank], sizes[rank]).copy_(own);
  for (int64_t k = 0; k < world - 1; ++k) {
    std::vector<Arriving> now = std::move(arriving);
    if (k + 1 < world - 1) arriving = post_receives(k + 1);
    for (size_t i = 0; i < now.size(); ++i) {
      now[i].work->wait();
      if (!now[i].into.is_same(now[i].place)) now[i].place.copy_(now[i].into);
      if (k + 1 < world - 1) transfers.send(now[i].into, tag_of(k + 1, i));
    }
  }
  transfers.wait_sends();
  return out;
}

}  // namespace autoshard::comm
