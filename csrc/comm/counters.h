#pragma once
// Process-wide tallies of the collectives autoshard issues, kept where they are issued so
// that those run by C++ autograd in backward count too. Readers take snapshots and
// subtract, so any number of observers can nest without resetting each other.
#include <cstdint>
#include <string>
#include <vector>

namespace autoshard::comm {

enum class Collective : int { kAllReduce = 0, kAllGather = 1 };
constexpr int kCollectiveKinds = 2;

void count_collective(Collective kind, int64_t bytes);

// The kinds' names, in the order of comm_counters().
std::vector<std::string> comm_counter_kinds();

// For every kind in order: how many were issued, then their payload bytes (this rank's).
std::vector<int64_t> comm_counters();

}  // namespace autoshard::comm
