#pragma once
#include <cstdint>
#include <string>

namespace autoshard::plan {

// Parses the graph, plans it for `world_size` ranks and formats the result.
std::string plan_graph(const std::string& graph, int64_t world_size);

}  // namespace autoshard::plan
