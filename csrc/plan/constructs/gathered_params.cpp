// Large parameters outside the layers (a position table held as a Parameter, a vision tower's
// position embedding, experts the planner keeps whole): in a plan asked to gather what cannot be
// paired (Graph::gather_unpaired, where the fewest collectives leave a rank far more than its
// share), each is stored split over the ranks on its longest axis and all-gathered whole where the
// call of the module holding it begins, as a fully sharded data-parallel parameter is. Only a
// parameter read inside that one call (Graph::gatherable) and whose every reader computes on
// tensors held whole qualifies: its gradient is then the same on every rank, and each keeps its
// own piece of it with no collective in backward.
//
// Records (python/autoshard/constructs/gathered_parameter.py): {"tensor", "param", "axis", "size",
// "elements"}: stored split on axis `axis` (of length `size`); one all-gather of `elements` each
// where its module's call begins.
#include <algorithm>
#include <set>

#include "plan/constructs/registry.h"

namespace autoshard::plan {
namespace {

void make_gathered_params(const ConstructInput& in, Plan& plan) {
  const Graph& graph = in.graph;
  const Propagation& pass = in.pass;
  std::vector<Record>& chosen = plan.records["gathered_params"];
  if (graph.gather_unpaired <= 0 || in.world_size <= 1) return;
  // Parameters a layer, a norm or an adapter holds are split (or kept) by their own rules.
  std::set<int64_t> owned;
  for (const Node& node : graph.nodes) {
    owned.insert(node.weight_param);
    owned.insert(node.bias_param);
    for (const AdapterFactors& a : node.adapters) {
      owned.insert(a.a);
      owned.insert(a.b);
    }
  }
  for (const auto& [tensor, region] : pass.head_param_region) owned.insert(graph.tensor(tensor).param);
  std::set<int64_t> seen;
  for (size_t t = 0; t < graph.tensors.size(); ++t) {
    const TensorInfo& info = graph.tensors[t];
    if (info.param < 0 || !graph.gatherable.count(info.param) || owned.count(info.param) ||
        pass.partial_params.count(info.param) ||
        !seen.insert(info.param).second || pass.layouts[t].sharded || info.shape.empty()) {
      continue;
    }
    int64_t elements = 1;
    for (int64_t s : info.shape) elements *= s;
    if (elements < graph.gather_unpaired) continue;
    bool read = false, whole = true;
    for (size_t n = 0; n < graph.nodes.size() && whole; ++n) {
      const Node& node = graph.nodes[n];
      if (std::find(node.inputs.begin(), node.inputs.end(), static_cast<int>(t)) == node.inputs.end()) continue;
      read = true;
      for (int id : node.inputs) whole = whole && !pass.layouts[id].sharded;
      for (int id : node.outputs) whole = whole && !pass.layouts[id].sharded;
    }
    if (!read || !whole) continue;
    const auto longest = std::max_element(info.shape.begin(), info.shape.end());
    if (*longest < in.world_size) continue;
    Record record;
    record.add("tensor", t).add("param", info.param).add("axis", longest - info.shape.begin());
    record.add("size", *longest).add("elements", elements);
    chosen.push_back(std::move(record));
    in.count(plan, "forward", "all_gather", elements);
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"gathered_params", 90, make_gathered_params});

}  // namespace

}  // namespace autoshard::plan
