// The walk back from a tensor held whole and read against heads-sharded ones, shared by head
// cuts (constructs/head_cuts.cpp) and head parameters (constructs/head_params.cpp). It goes back
// through the ops that keep each head's elements to themselves (permutes, slices of other axes,
// elementwise ops, views, broadcasts of other axes), tracking the axis holding the heads, for at
// most 16 steps: past those ops a cut or split at the start would no longer give each rank its own
// heads.
#include <algorithm>

#include "plan/propagation.h"

namespace autoshard::plan {

bool Propagation::walk_heads_back(int tensor, int axis, const AxisFactor& heads, const HeadsWalk& walk) {
  if (current_node_ < 0) return false;
  HeadsTrace at{tensor, {axis, heads.outer, heads.size}, current_node_};
  for (int step = 0; step < 16; ++step) {
    const TensorInfo& info = graph_.tensor(at.tensor);
    if (layouts[at.tensor].sharded || info.is_output) return false;
    const int p = producer_before(at.tensor, at.before);
    const WalkVerdict verdict = walk.at_step(at, p);
    if (verdict != WalkVerdict::Further) return verdict == WalkVerdict::Found;
    if (p < 0) return false;
    const Node& node = graph_.nodes[p];
    if (is_layer(node) || node.inputs.empty()) return false;
    const auto& out_shape = info.shape;
    AxisFactor& f = at.heads;
    if (node.kind == Kind::Pointwise && node.inputs.size() > 1) {
      // An elementwise op with one input holding the heads, the others broadcast along them (a
      // mask applied with where): the heads come from that input.
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
      at.tensor = full;
      at.before = p;
      continue;
    }
    const int in = node.inputs[0];
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
        // A batch merged with the heads (bmm's (batch * heads) axis) is the heads again before
        // it; all_head_size viewed as (heads, head_dim) grows the factor to the whole axis.
        const ReshapeResult r = map_reshape(out_shape, in_shape, f);
        if (!r.ok || (walk.views_keep_heads && r.factor.size != f.size)) return false;
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
        if (!walk.through_reductions || node.inputs.size() != 1) return false;
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
    at.tensor = in;
    at.before = p;
  }
  return false;
}

}  // namespace autoshard::plan
