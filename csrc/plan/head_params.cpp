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
// the split is dropped (settle.cpp) and the attention stays whole, saying why.
#include <algorithm>

#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

// How a parameter is named in messages; the Python layer puts its name in place of the index.
std::string parameter(int64_t index) { return "parameter #" + std::to_string(index); }

}  // namespace

bool Propagation::request_head_param(int tensor, int axis, const AxisFactor& merged, int source, std::string& why) {
  const int n = current_node_;
  if (n < 0) return false;
  int t = tensor, earliest = n;
  AxisFactor f{axis, merged.outer, merged.size};
  for (int step = 0; step < 16; ++step) {
    const TensorInfo& info = graph_.tensor(t);
    if (layouts[t].sharded || info.is_output) return false;
    const int p = producer_before(t, earliest);
    if (p < 0) {
      const int64_t param = info.param;
      if (param < 0) return false;  // a model input: a head cut's, if any
      const std::string name = " reads " + parameter(param) + " over the heads";
      const auto dropped = dropped_head_params.find(t);
      if (dropped != dropped_head_params.end()) {
        why = name + ", which stays whole (" + dropped->second + ")";
        return false;
      }
      for (const Node& node : graph_.nodes) {
        // A bias the model adds apart from its layer's product is split with the layer's channels.
        const bool functional_bias = node.functional && !node.functional_bias && node.bias_param == param;
        if (is_layer(node) && (node.weight_param == param || node.bias_param == param) && !functional_bias) {
          why = name + ", which is also the parameter of layer " + node.label;
          return false;
        }
      }
      if (f.outer != 1) {
        why = name + ", whose axis does not hold the heads as its outer factor";
        return false;
      }
      wanted_head_params[t] = f;
      wanted_head_param_sources[t] = source;
      return true;
    }
    const Node& node = graph_.nodes[p];
    if (is_layer(node) || node.inputs.empty()) return false;
    const auto& out_shape = info.shape;
    int in = node.inputs[0];
    if (node.kind == Kind::Pointwise && node.inputs.size() > 1) {
      // The heads come from the one input holding them; the others are broadcast along them.
      int full = -1;
      for (int id : node.inputs) {
        const auto& s = graph_.tensor(id).shape;
        const int ax = f.axis - static_cast<int>(out_shape.size() - s.size());
        if (ax < 0 || s[ax] == 1) continue;
        if (full >= 0 || s[ax] != out_shape.at(f.axis) || layouts[id].sharded) return false;
        full = id;
      }
      if (full < 0) return false;
      f.axis -= static_cast<int>(out_shape.size() - graph_.tensor(full).shape.size());
      t = full;
      earliest = p;
      continue;
    }
    const auto& in_shape = graph_.tensor(in).shape;
    switch (node.kind) {
      case Kind::Permute:
        f.axis = static_cast<int>(node.permutation.at(f.axis));
        break;
      case Kind::Slice:
        if (node.drop_dim && node.dim <= f.axis) ++f.axis;
        if (node.dim == f.axis && (node.start > 0 || node.stop < in_shape.at(f.axis))) return false;
        break;
      case Kind::Pointwise:
        if (in_shape != out_shape) return false;
        break;
      case Kind::View: {
        // all_head_size viewed as (heads, head_dim): the factor grows to the whole axis. Its
        // outer factor may change too; the parameter's must be 1 (checked there).
        const ReshapeResult r = map_reshape(out_shape, in_shape, f);
        if (!r.ok) return false;
        f = r.factor;
        break;
      }
      case Kind::Expand: {
        const int in_axis = f.axis - static_cast<int>(out_shape.size() - in_shape.size());
        if (in_axis < 0 || in_shape.at(in_axis) != out_shape.at(f.axis)) return false;
        f.axis = in_axis;
        break;
      }
      case Kind::Reduce: {
        // A reduction over other axes (the taps of a depthwise convolution, summed per
        // channel) keeps each head's elements to itself.
        if (node.inputs.size() != 1) return false;
        const bool kept = in_shape.size() == out_shape.size();
        int in_axis = -1;
        for (int a = 0, o = 0; a < static_cast<int>(in_shape.size()); ++a) {
          const bool reduced = std::find(node.axes.begin(), node.axes.end(), a) != node.axes.end();
          if (reduced && !kept) continue;
          if (o == f.axis) {
            if (reduced) return false;
            in_axis = a;
            break;
          }
          ++o;
        }
        if (in_axis < 0 || in_shape.at(in_axis) != out_shape.at(f.axis)) return false;
        f.axis = in_axis;
        break;
      }
      default:
        return false;
    }
    t = in;
    earliest = p;
  }
  return false;
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
