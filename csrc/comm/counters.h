#pragma once
// Process-wide tallies of the collectives autoshard issues, kept where they are issued so
// that those run by C++ autograd in backward, or from a hook, count too. Tallies are kept per
// kind and per process group (by name). Readers take snapshots and subtract, so any number
// of observers can nest without resetting each other.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace autoshard::comm {

enum class Collective : int { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2, kBroadcast = 3 };
constexpr int kCollectiveKinds = 4;

// `bytes`: the payload this rank puts on the wire (padding included).
void count_collective(Collective kind, int64_t bytes, const std::string& group_name);

// The kinds' names, in the order of comm_counters().
std::vector<std::string> comm_counter_kinds();

// For every kind in order: how many were issued, then their payload bytes (this rank's),
// summed over all groups.
std::vector<int64_t> comm_counters();

// The groups that saw a collective, and for each in turn what comm_counters() holds for it.
std::tuple<std::vector<std::string>, std::vector<int64_t>> comm_group_counters();

}  // namespace autoshard::comm
