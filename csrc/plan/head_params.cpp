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
#include <string>

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

}  // namespace autoshard::plan
