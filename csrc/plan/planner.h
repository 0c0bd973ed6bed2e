#pragma once
// The planner: from a model's dataflow graph to a sharding decision for every layer.
//
// A layer whose input is replicated starts a *region* as a column layer (its output features
// sharded). The sharded axis is followed through reshapes (a feature axis becoming heads x
// head_dim), transposes, elementwise ops, batched matmuls and fused splits; a layer that
// contracts the sharded axis closes the region as a row layer (one all-reduce). Every region
// splits its axis into the same number of units (the gcd of the sizes it passes through, so
// heads stay whole, and KV heads for grouped-query attention). A region whose axis reaches
// something that would need it whole (a norm over features, an op autoshard cannot follow)
// is replicated; one that reaches a model output gathers there. Decisions repeat until stable.
//
// KV heads meet query heads through a repeat (repeat_kv's expand and reshape) or a grouped
// attention; the two sides are kept as a coarse and a fine region. Where their common units
// cover the ranks they become one region, as before; otherwise the query heads are split alone
// and each rank holds the KV heads its query heads use (LayerDecision::repeat), whose
// gradients the holders sum in backward (one all-reduce per KV projection, in the plan's count).
#include <string>
#include <vector>

#include "plan/graph.h"

namespace autoshard::plan {

enum class Style { Replicate, Column, ColumnGather, Row, Vocab };

struct LayerDecision {
  int node = -1;
  Style style = Style::Replicate;
  int region = -1;
  int64_t units = 0;           // the region's units (heads, or features)
  std::vector<int64_t> parts;  // fused output layout, if the output is split into parts
  int copy_group = -1;         // column layers reading the same input share one input copy
  int64_t letter = 0;          // einsum layers: the weight letter split (a character code)
  // A KV projection whose KV heads are fewer than the ranks need: each of its `units` serves
  // `repeat` consecutive units of its region, and a rank holds the units its share uses.
  int64_t repeat = 0;
  std::string note;            // why, when it is not the obvious choice
};

struct RegionSummary {
  int id = -1;
  int64_t units = 0;
  std::vector<int64_t> localize;  // global sizes, seen on the sharded axis, that become local
  // With KV heads replicated where needed: the KV projections' repeat and units, and the
  // sizes seen on their side (KV heads, their features), which become local per KV run.
  int64_t repeat = 0;
  int64_t coarse_units = 0;
  std::vector<int64_t> coarse_localize;
};

struct CommCount {
  std::string phase;  // "forward" or "backward"
  std::string kind;   // "all_reduce" or "all_gather"
  int64_t count = 0;
  int64_t elements = 0;  // summed over collectives, at the graph's example shapes
};

struct Plan {
  std::vector<LayerDecision> layers;
  std::vector<RegionSummary> regions;
  std::vector<CommCount> comm;
};

Plan make_plan(const Graph& graph, int64_t world_size);

// Line format of the result, read by the Python layer:
//   layer <node> <style> <region> <units> <copy group> parts <n> <size>... letter <code> repeat <r> note <text>
//   region <id> <units> localize <n> <size>... repeat <r> <coarse units> <n> <size>...
//   comm <phase> <kind> <count> <elements>
std::string format_plan(const Plan& plan);

}  // namespace autoshard::plan
