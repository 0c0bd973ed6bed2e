#include "comm/counters.h"

#include <array>
#include <map>
#include <mutex>

namespace autoshard::comm {
namespace {

using Tally = std::array<int64_t, 2 * kCollectiveKinds>;  // (count, bytes) per kind

// Collectives come from the training thread, autograd's threads and checkpoint writers.
std::mutex& tallies_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::string, Tally>& tallies() {
  static std::map<std::string, Tally> by_group;
  return by_group;
}

}  // namespace

void count_collective(Collective kind, int64_t bytes, const std::string& group_name) {
  const int k = static_cast<int>(kind);
  const std::lock_guard<std::mutex> lock(tallies_mutex());
  auto [it, inserted] = tallies().try_emplace(group_name);
  if (inserted) it->second.fill(0);
  it->second[2 * k] += 1;
  it->second[2 * k + 1] += bytes;
}

std::vector<std::string> comm_counter_kinds() {
  return {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
}

std::vector<int64_t> comm_counters() {
  std::vector<int64_t> totals(2 * kCollectiveKinds, 0);
  const std::lock_guard<std::mutex> lock(tallies_mutex());
  for (const auto& [name, tally] : tallies()) {
    for (size_t i = 0; i < tally.size(); ++i) totals[i] += tally[i];
  }
  return totals;
}

std::tuple<std::vector<std::string>, std::vector<int64_t>> comm_group_counters() {
  std::vector<std::string> names;
  std::vector<int64_t> flat;
  const std::lock_guard<std::mutex> lock(tallies_mutex());
  for (const auto& [name, tally] : tallies()) {
    names.push_back(name);
    flat.insert(flat.end(), tally.begin(), tally.end());
  }
  return {names, flat};
}

}  // namespace autoshard::comm
