// The forward pass through the ops that move the sharded axis without combining tensors:
// reshapes (which may take a fused output apart into its parts), permutes and broadcasts.
#include <algorithm>
#include <set>

#include "plan/propagation.h"

namespace autoshard::plan {

int64_t Propagation::unbound_parts(int id, int axis) const {
  for (;;) {
    if (graph_.tensor(id).is_output) return 0;
    const int64_t selected = selected_parts(id, axis);
    if (selected) return selected;
    if (consumers_[id].size() != 1) return 0;
    const Node& next = graph_.nodes[consumers_[id][0]];
    if (next.kind == Kind::Split && next.drop_dim && next.dim == axis) {
      return static_cast<int64_t>(next.outputs.size());
    }
    if (next.kind != Kind::Permute) return 0;
    const auto found = std::find(next.permutation.begin(), next.permutation.end(), axis);
    if (found == next.permutation.end()) return 0;
    axis = static_cast<int>(found - next.permutation.begin());
    id = next.outputs.at(0);
  }
}

// Every index of the axis taken by its own select and nothing else reading the tensor
// (Moshi's gate and up: x.view(b, s, 2, -1), then [..., 0, :] and [..., 1, :]): the
// parts as an unbind would give them.
int64_t Propagation::selected_parts(int id, int axis) const {
  const int64_t size = shape(id).at(axis);
  std::set<int64_t> taken;
  for (int reader : consumers_[id]) {
    const Node& s = graph_.nodes[reader];
    if (s.kind != Kind::Slice || !s.drop_dim || s.dim != axis) return 0;
    taken.insert(s.start);
  }
  const bool every = static_cast<int64_t>(taken.size()) == size && size > 1 && *taken.begin() == 0 &&
                     *taken.rbegin() == size - 1;
  return every ? size : 0;
}

void Propagation::visit_view(const Node& node) {
  const int in = node.inputs.at(0), out = node.outputs.at(0);
  const Layout x = layouts[in];
  layouts[out] = Layout{};
  if (!x.sharded) return;
  // A fused q/k/v projection's output viewed as (3, heads, head_dim) and taken apart by an
  // unbind of the 3: the leading axis holds the layer's parts, and the heads after it are what
  // is split (each part by heads, as a split of the output into its parts does).
  if (!x.whole && x.source >= 0 && x.factor.outer == 1 && !parts.count(x.source)) {
    const auto& to = shape(out);
    const ReshapeResult at = map_reshape(shape(in), to, x.factor);
    const int k = at.factor.axis;
    const int64_t count = at.ok && at.factor.outer == 1 ? at.factor.size : 0;
    if (count > 1 && static_cast<size_t>(k + 1) < to.size() && to[k] == count && x.factor.size % count == 0 &&
        (x.factor.size / count) % to[k + 1] == 0 && to[k + 1] > 1 && unbound_parts(out, k) == count) {
      const int64_t part = x.factor.size / count;
      std::vector<int64_t>& layer_parts = parts[x.source];
      for (int64_t p = 0; p < count; ++p) layer_parts.push_back(part);
      constrain(x.region, part);
      constrain(x.region, to[k + 1]);
      regions[find(x.region)].localize.push_back(part);
      regions[find(x.region)].localize.push_back(to[k + 1]);
      return set_sharded(out, {k + 1, 1, to[k + 1]}, x.region);
    }
  }
  // A view given its sizes may spell one head as a dimension of length 1 (a single KV head);
  // a unit axis, once there, stays one through later views.
  const bool sized = node.label.rfind("aten.view.", 0) == 0 || node.label.rfind("aten._unsafe_view.", 0) == 0 ||
                     node.label.rfind("aten.reshape.", 0) == 0 || node.label.rfind("aten._reshape_alias.", 0) == 0;
  // Only a projection's feature axis (the last) spells a single head that way: a leading axis
  // of length 1 over a sharded batch-like axis is a batch of one (bmm's output viewed back as
  // [1, heads, q, k] in attention without a batch axis), and the heads stay after it.
  // A 1-d tensor (a per-head parameter, attention sinks) viewed as [1, heads, 1, 1] spells no
  // head as a unit axis either: its leading 1 is the batch it broadcasts over.
  const bool last = x.factor.axis + 1 == static_cast<int>(shape(in).size()) && shape(in).size() > 1;
  const ReshapeResult r = map_reshape(shape(in), shape(out), x.factor, (sized && last) || x.factor.size == 1);
  if (!r.ok) return conflict(x.region, node.label + ": " + r.why);
  // A layer's output viewed as (units, inner) (Falcon's fused q, k and v viewed as heads) is
  // still that layer's output: its parts may be sliced there, counted in those units.
  const bool inner_split = x.factor.outer == 1 && r.factor.outer == 1 && r.factor.size > 0 &&
                           x.factor.size % r.factor.size == 0;
  if (x.whole) {
    if (!inner_split || (x.whole * r.factor.size) % x.factor.size) {
      return conflict(x.region, node.label + " reshapes a fused output whose smaller parts are held whole");
    }
    set_sharded(out, r.factor, x.region, x.source);
    layouts[out].whole = x.whole * r.factor.size / x.factor.size;
    return;
  }
  if (x.repeat_next > 1 && r.factor.outer == x.factor.outer && r.factor.size == x.factor.size * x.repeat_next) {
    // repeat_kv: each KV head becomes repeat_next query heads' worth, a finer region.
    const int fine = new_region(r.factor.size);
    regions[fine].localize.push_back(r.factor.size);
    link(x.region, fine);
    return set_sharded(out, r.factor, fine);
  }
  constrain(x.region, r.factor.size);
  if (r.factor.size != x.factor.size) regions[find(x.region)].localize.push_back(r.factor.size);
  const bool unchanged = r.factor.size == x.factor.size && r.factor.outer == x.factor.outer;
  set_sharded(out, r.factor, x.region, unchanged || inner_split ? x.source : -1);
}

void Propagation::visit_permute(const Node& node) {
  const Layout x = layouts[node.inputs.at(0)];
  const int out = node.outputs.at(0);
  layouts[out] = Layout{};
  if (!x.sharded) return;
  for (size_t j = 0; j < node.permutation.size(); ++j) {
    if (node.permutation[j] == x.factor.axis) {
      AxisFactor f = x.factor;
      f.axis = static_cast<int>(j);
      set_sharded(out, f, x.region, x.source);
      layouts[out].whole = x.whole;
      return;
    }
  }
  conflict(x.region, node.label + ": malformed permutation");
}

void Propagation::visit_expand(const Node& node) {
  const int in = node.inputs.at(0), out = node.outputs.at(0);
  const Layout x = layouts[in];
  layouts[out] = Layout{};
  if (!x.sharded) return;
  AxisFactor f = x.factor;
  f.axis += static_cast<int>(shape(out).size() - shape(in).size());
  if (shape(out)[f.axis] != shape(in)[x.factor.axis]) return conflict(x.region, node.label + " broadcasts the sharded axis");
  const size_t next_in = static_cast<size_t>(x.factor.axis) + 1, next_out = static_cast<size_t>(f.axis) + 1;
  const bool repeats = next_in < shape(in).size() && shape(in)[next_in] == 1 && shape(out)[next_out] > 1;
  set_sharded(out, f, x.region, x.source, repeats ? shape(out)[next_out] : x.repeat_next);
}

}  // namespace autoshard::plan
