#include "comm/counters.h"

#include <atomic>

namespace autoshard::comm {
namespace {

std::atomic<int64_t> issued[kCollectiveKinds];
std::atomic<int64_t> payload_bytes[kCollectiveKinds];

}  // namespace

void count_collective(Collective kind, int64_t bytes) {
  const int k = static_cast<int>(kind);
  issued[k].fetch_add(1, std::memory_order_relaxed);
  payload_bytes[k].fetch_add(bytes, std::memory_order_relaxed);
}

std::vector<std::string> comm_counter_kinds() {
  return {"all_reduce", "all_gather"};
}

std::vector<int64_t> comm_counters() {
  std::vector<int64_t> totals;
  totals.reserve(2 * kCollectiveKinds);
  for (int k = 0; k < kCollectiveKinds; ++k) {
    totals.push_back(issued[k].load(std::memory_order_relaxed));
    totals.push_back(payload_bytes[k].load(std::memory_order_relaxed));
  }
  return totals;
}

}  // namespace autoshard::comm
