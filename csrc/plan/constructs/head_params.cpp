// Head parameters: a parameter (not a layer's) laid out over the attention heads, met by the
// heads-sharded attention in an elementwise op (a per-head scale multiplying the heads or the
// scores, DeBERTa's q_bias and v_bias added to the query and value heads), is split with the
// heads: each rank holds the slice for its heads, a plain local parameter.
//
// The op pairs element i of its inputs, so the rank computing heads [start, stop) reads exactly
// those heads of the parameter, and the gradient of that slice comes only from those heads: it
// is exact on the rank with no collective. The parameter's axis holding the heads must have
// them as its outer factor (heads alone, or all_head_size = heads x head_dim, like a column
// layer's bias), reached from the op through views, transposes, broadcasts and elementwise ops
// of the parameter alone. The split is asked for here and made in the next pass, from the
// parameter itself: every read of it then sees it sharded, so a parameter also read where it
// must stay whole (a reduction over its heads, a replicated tensor, another layout) conflicts,
// the split is dropped (passes/settle_head_params.cpp) and the attention stays whole, saying why.
//
// Records (python/autoshard/constructs/head_parameter.py): {"tensor", "param", "axis", "size",
// "region", "layer", "parts"}: axis `axis` (of length `size`) holds the heads as its outer factor,
// split like the region's units; `layer`, a fused layer whose parts it is split by, as its
// output's features are (-1: none); or `parts`, those of a concatenation of split layer outputs,
// each split like the region.
#include <numeric>
#include <set>
#include <string>

#include <c10/util/Exception.h>

#include "plan/constructs/registry.h"
#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

// How a parameter is named in messages; the Python layer puts its name in place of the index.
std::string parameter(int64_t index) { return "parameter #" + std::to_string(index); }

}  // namespace

bool Propagation::request_head_param(int tensor, int axis, const AxisFactor& merged, int source, std::string& why) {
  HeadsWalk walk;
  walk.through_reductions = true;
  walk.at_step = [&](const HeadsTrace& at, int p) {
    if (p >= 0) return WalkVerdict::Further;
    const int64_t param = graph_.tensor(at.tensor).param;
    if (param < 0) return WalkVerdict::Refused;  // a model input: a head cut's, if any
    const std::string name = " reads " + parameter(param) + " over the heads";
    const auto dropped = dropped_head_params.find(at.tensor);
    if (dropped != dropped_head_params.end()) {
      why = name + ", which stays whole (" + dropped->second + ")";
      return WalkVerdict::Refused;
    }
    for (const Node& node : graph_.nodes) {
      // A bias the model adds apart from its layer's product is split with the layer's channels.
      const bool functional_bias = node.functional && !node.functional_bias && node.bias_param == param;
      if (is_layer(node) && (node.weight_param == param || node.bias_param == param) && !functional_bias) {
        why = name + ", which is also the parameter of layer " + node.label;
        return WalkVerdict::Refused;
      }
    }
    // all_head_size viewed as (heads, head_dim) may leave the heads an outer factor on the way.
    if (at.heads.outer != 1) {
      why = name + ", whose axis does not hold the heads as its outer factor";
      return WalkVerdict::Refused;
    }
    wanted_head_params[at.tensor] = at.heads;
    wanted_head_param_sources[at.tensor] = source;
    return WalkVerdict::Found;
  };
  return walk_heads_back(tensor, axis, merged, walk);
}

// Before the first node: each parameter split with its heads is sharded from the start, in a
// region of its own that the heads it meets join.
void Propagation::open_head_params() {
  for (const auto& [tensor, factor] : head_params) {
    const int region = new_region(factor.size);
    const auto source = head_param_sources.find(tensor);
    set_sharded(tensor, factor, region, source == head_param_sources.end() ? -1 : source->second);
    head_param_region[tensor] = region;
  }
}


namespace {

// Local parameters: no communication. The bias of a column layer whose weight the model
// multiplies itself is split by the layer already.
void make_head_params(const ConstructInput& in, Plan& plan) {
  const Graph& graph = in.graph;
  const Propagation& pass = in.pass;
  std::vector<Record>& params = plan.records["head_params"];
  std::set<int64_t> split_by_layer;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (is_layer(node) && node.functional && pass.roles[n] == Style::Column) split_by_layer.insert(node.bias_param);
  }
  for (const auto& [tensor, region] : pass.head_param_region) {
    const int root = in.pass.find(region);
    if (pass.regions[root].conflict || split_by_layer.count(graph.tensor(tensor).param)) continue;
    const AxisFactor& f = pass.head_params.at(tensor);
    const auto source = pass.head_param_sources.find(tensor);
    const int from = source == pass.head_param_sources.end() ? -1 : source->second;
    int layer = -1;
    std::vector<int64_t> parts;
    // Split part by part only with a layer (or a concatenation) whose output has parts here.
    if (from >= 0 && pass.parts.count(from) && pass.parts.at(from).size() > 1) {
      if (is_layer(graph.nodes[from])) {
        layer = from;
      } else {
        parts = pass.parts.at(from);
        const int64_t total = std::accumulate(parts.begin(), parts.end(), int64_t{0});
        TORCH_CHECK(total > 0 && f.size % total == 0, "[plan.internal] parts ", total, " do not divide ", f.size);
        for (int64_t& size : parts) size *= f.size / total;
      }
    }
    Record record;
    record.add("tensor", tensor).add("param", graph.tensor(tensor).param).add("axis", f.axis).add("size", f.size);
    record.add("region", root).add("layer", layer).add("parts", std::move(parts));
    params.push_back(std::move(record));
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"head_params", 80, make_head_params});

}  // namespace

}  // namespace autoshard::plan
