// The forward pass of the planner, continued: ops that combine, reduce, multiply, split and
// concatenate tensors.
#include <algorithm>

#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

// Aligns input axis `axis` of an input with `ndim` dims to the output's (numpy broadcasting).
int aligned(int axis, size_t ndim, size_t out_ndim) { return axis + static_cast<int>(out_ndim - ndim); }

}  // namespace

// Elementwise ops and concatenation: every sharded input must agree on one output axis,
// and a replicated input may only be broadcast along it (size 1 or absent).
bool Propagation::merge_elementwise(const Node& node, Layout& merged, int skip_axis_check) {
  const size_t out_ndim = shape(node.outputs.at(0)).size();
  for (int id : node.inputs) {
    const Layout& l = layouts[id];
    if (!l.sharded) continue;
    AxisFactor f = l.factor;
    f.axis = aligned(f.axis, shape(id).size(), out_ndim);
    if (!merged.sharded) {
      merged = l;
      merged.factor = f;
      continue;
    }
    if (f.axis != merged.factor.axis || f.outer != merged.factor.outer || f.size != merged.factor.size) {
      conflict(l.region, node.label + " combines tensors sharded differently");
      conflict(merged.region, node.label + " combines tensors sharded differently");
      return false;
    }
    unite(merged.region, l.region);
    if (merged.source == kAnySource) {
      merged.source = l.source;
    } else if (l.source != kAnySource && merged.source != l.source) {
      merged.source = -1;
    }
    if (merged.repeat_next != l.repeat_next) merged.repeat_next = 0;
  }
  if (!merged.sharded) return true;
  for (int id : node.inputs) {
    if (layouts[id].sharded) continue;
    const auto& s = shape(id);
    const int axis = merged.factor.axis - static_cast<int>(out_ndim - s.size());
    if (axis >= 0 && axis != skip_axis_check && s[axis] != 1) {
      // A bias over the heads (ALiBi) cut to this rank's heads where a module receives it.
      if (s[axis] == merged.factor.outer * merged.factor.size && request_cut(id, axis, merged.factor)) continue;
      // A parameter over the heads (a per-head scale) split with them.
      std::string why;
      if (s[axis] == merged.factor.outer * merged.factor.size && request_head_param(id, axis, merged.factor, merged.source, why)) continue;
      conflict(merged.region, node.label + (why.empty() ? " combines the sharded axis with a replicated tensor" : why));
      return false;
    }
  }
  return true;
}

void Propagation::visit_pointwise(const Node& node) {
  Layout merged;
  const bool ok = merge_elementwise(node, merged);
  for (int id : node.outputs) {
    layouts[id] = Layout{};
    if (ok && merged.sharded && shape(id).size() == shape(node.outputs[0]).size()) {
      set_sharded(id, merged.factor, merged.region, merged.source, merged.repeat_next);
    }
  }
}

void Propagation::visit_reduce(const Node& node) {
  const int in = node.inputs.at(0);
  const Layout x = layouts[in];
  for (int id : node.outputs) layouts[id] = Layout{};
  for (size_t i = 1; i < node.inputs.size(); ++i) {
    if (layouts[node.inputs[i]].sharded) conflict(layouts[node.inputs[i]].region, node.label + " takes a sharded parameter");
  }
  if (!x.sharded) return;
  int removed_before = 0;
  for (int64_t axis : node.axes) {
    if (axis == x.factor.axis) return conflict(x.region, node.label + " reduces over the sharded axis");
    if (axis < x.factor.axis) ++removed_before;
  }
  for (int id : node.outputs) {
    AxisFactor f = x.factor;
    if (shape(id).size() != shape(in).size()) f.axis -= removed_before;
    // Reduced over other axes, the features stay where they were (for a split into parts).
    if (f.axis < static_cast<int>(shape(id).size()) && shape(id)[f.axis] == shape(in)[x.factor.axis]) {
      set_sharded(id, f, x.region, x.source);
    }
  }
}

void Propagation::visit_matmul(const Node& node) {
  const int a = node.inputs.at(0), b = node.inputs.at(1), out = node.outputs.at(0);
  const Layout la = layouts[a], lb = layouts[b];
  layouts[out] = Layout{};
  const int nd = static_cast<int>(shape(out).size());
  const int a_nd = static_cast<int>(shape(a).size()), b_nd = static_cast<int>(shape(b).size());
  auto is_batch = [&](const Layout& l, int ndim) { return l.sharded && l.factor.axis < ndim - 2; };
  if (la.sharded && lb.sharded) {
    if (is_batch(la, a_nd) && is_batch(lb, b_nd)) {
      Layout merged;
      if (!merge_elementwise(node, merged)) return;
      AxisFactor f = la.factor;
      f.axis = aligned(la.factor.axis, a_nd, nd);
      set_sharded(out, f, la.region);
      return;
    }
    conflict(la.region, node.label + " multiplies two tensors sharded on different axes");
    return conflict(lb.region, node.label + " multiplies two tensors sharded on different axes");
  }
  const Layout& l = la.sharded ? la : lb;
  if (!l.sharded) return;
  const int ndim = la.sharded ? a_nd : b_nd;
  const int other = la.sharded ? b : a;
  const int contracted = la.sharded ? ndim - 1 : ndim - 2;
  if (l.factor.axis == contracted) return conflict(l.region, node.label + " contracts the sharded axis");
  AxisFactor f = l.factor;
  if (l.factor.axis < ndim - 2) {
    const auto& s = shape(other);
    const int axis = aligned(l.factor.axis, ndim, nd) - (nd - static_cast<int>(s.size()));
    // One KV head broadcast to every query head (multi-query attention's repeat) is made at
    // this rank's heads where it is broadcast.
    const bool cut = axis >= 0 && s[axis] == l.factor.outer * l.factor.size && request_cut(other, axis, l.factor);
    if (axis >= 0 && s[axis] != 1 && !cut) return conflict(l.region, node.label + " multiplies by a replicated batch");
    f.axis = aligned(l.factor.axis, ndim, nd);
  } else {
    f.axis = la.sharded ? nd - 2 : nd - 1;
  }
  set_sharded(out, f, l.region);
}

void Propagation::visit_attention(const Node& node) {
  Layout merged;
  Node qkv = node;
  qkv.inputs.resize(std::min<size_t>(3, node.inputs.size()));
  for (int id : node.outputs) layouts[id] = Layout{};
  const Layout q = layouts[qkv.inputs.at(0)];
  if (!q.sharded) return block(node, node.label + " attends over replicated queries");
  if (q.factor.axis != static_cast<int>(shape(qkv.inputs[0]).size()) - 3) {
    return conflict(q.region, node.label + " is not sharded over heads");
  }
  for (int id : qkv.inputs) {
    const Layout& l = layouts[id];
    const int heads = static_cast<int>(shape(id).size()) - 3;
    if (!l.sharded && heads >= 0 && shape(id)[heads] == q.factor.outer * q.factor.size &&
        request_cut(id, heads, q.factor)) {
      continue;  // one KV head broadcast to every query head, made at this rank's heads
    }
    if (!l.sharded && heads >= 0 && shape(id)[heads] == 1 && id != qkv.inputs[0]) {
      continue;  // one KV head the attention broadcasts to every query head itself
    }
    if (!l.sharded || l.factor.axis != q.factor.axis) return conflict(q.region, node.label + " needs q, k and v sharded alike");
    if (l.factor.size < q.factor.size && q.factor.size % l.factor.size == 0 && l.factor.outer == q.factor.outer) {
      link(l.region, q.region);  // grouped-query attention: fewer KV heads than query heads
      continue;
    }
    // A tiled repeat of the KV heads (head h reads KV head h % kv) leaves them as an outer
    // factor: no contiguous split of the query heads meets its KV heads on one rank.
    if (l.factor.outer != q.factor.outer) return conflict(q.region, node.label + " pairs heads laid out differently");
    unite(q.region, l.region);
    constrain(q.region, l.factor.size);
  }
  for (size_t i = 3; i < node.inputs.size(); ++i) {
    const int id = node.inputs[i];
    const auto& s = shape(id);
    const int axis = q.factor.axis - static_cast<int>(shape(qkv.inputs[0]).size() - s.size());
    if (layouts[id].sharded || (axis >= 0 && s[axis] != 1)) return conflict(q.region, node.label + " has a mask per head");
  }
  set_sharded(node.outputs.at(0), q.factor, q.region);
}

void Propagation::visit_split(const Node& node) {
  const int in = node.inputs.at(0);
  const Layout x = layouts[in];
  const int64_t dim = node.dim;
  for (int id : node.outputs) layouts[id] = Layout{};
  if (!x.sharded) return;
  if (dim != x.factor.axis) {
    AxisFactor f = x.factor;
    if (node.drop_dim && dim < f.axis) f.axis -= 1;  // unbind: each piece without the axis
    for (int id : node.outputs) {
      set_sharded(id, f, x.region);
      layouts[id].whole = x.whole;
    }
    return;
  }
  if (node.drop_dim) return conflict(x.region, node.label + " takes the sharded axis apart");
  if (x.whole) {
    std::vector<int64_t> partition;
    for (int id : node.outputs) partition.push_back(shape(id)[dim]);
    if (x.source < 0 || parts.count(x.source)) {
      return conflict(x.region, node.label + " splits a fused output other than into its parts");
    }
    parts[x.source] = partition;
    for (size_t p = 0; p < node.outputs.size(); ++p) set_part(node.outputs[p], x, partition, p);
    return;
  }
  // Splitting a fused layer's output (QKV in one Linear): each part is sharded on its own,
  // which the layer's weight layout must mirror.
  if (x.source < 0 || x.factor.outer != 1) {
    return conflict(x.region, node.label + " splits the sharded axis of something that is not a layer's output");
  }
  const auto known = parts.find(x.source);
  if (known != parts.end()) {
    // Parts already known (a concatenation's, or a second split of a fused output): the same
    // parts again, each sharded as before.
    std::vector<int64_t> partition;
    for (int id : node.outputs) partition.push_back(shape(id)[dim]);
    if (known->second != partition) {
      return conflict(x.region, node.label + " splits a fused output other than into its parts");
    }
    for (int id : node.outputs) set_sharded(id, {x.factor.axis, 1, shape(id)[dim]}, x.region);
    return;
  }
  std::vector<int64_t>& layer_parts = parts[x.source];
  for (int id : node.outputs) {
    const int64_t size = shape(id)[dim];
    layer_parts.push_back(size);
    constrain(x.region, size);
    regions[find(x.region)].localize.push_back(size);
    set_sharded(id, {x.factor.axis, 1, size}, x.region);
  }
}

void Propagation::visit_cat(const Node& node) {
  Layout merged;
  const int64_t dim = node.dim;
  if (cat_parts(node)) return;
  const bool ok = merge_elementwise(node, merged, static_cast<int>(dim));
  const int out = node.outputs.at(0);
  layouts[out] = Layout{};
  if (!ok || !merged.sharded) return;
  if (merged.factor.axis == dim) return conflict(merged.region, node.label + " concatenates along the sharded axis");
  set_sharded(out, merged.factor, merged.region);
}

// Layers' outputs each split by heads, concatenated along their features (q, k and v of separate
// projections joined for one convolution over all of them): the result is laid out as a fused
// layer's output would be, its parts the inputs, each split alike by the region's units. The cat
// node stands for the layer (the parts' source), so that a split into the same parts later
// finds each part sharded again, and a parameter over all of them splits part by part.
bool Propagation::cat_parts(const Node& node) {
  const int64_t dim = node.dim;
  if (node.inputs.size() < 2) return false;
  for (int id : node.inputs) {
    const Layout& l = layouts[id];
    if (!l.sharded || l.factor.axis != dim || l.factor.outer != 1 || l.whole || l.sequence ||
        l.factor.size != shape(id)[dim]) {
      return false;
    }
  }
  const int out = node.outputs.at(0);
  const int region = layouts[node.inputs[0]].region;
  std::vector<int64_t> sizes;
  for (int id : node.inputs) {
    const int64_t size = shape(id)[dim];
    unite(region, layouts[id].region);
    constrain(region, size);
    regions[find(region)].localize.push_back(size);
    sizes.push_back(size);
  }
  parts[current_node_] = sizes;
  set_sharded(out, {static_cast<int>(dim), 1, shape(out)[dim]}, region, current_node_);
  return true;
}

// Slices that together cover a fused layer's output axis in order are its parts, as a split
// would make them: the first registers the layout, each later one must find the same.
void Propagation::slice_part(const Node& node, const Layout& x) {
  if (x.source < 0 || x.factor.outer != 1) {
    return conflict(x.region, node.label + " slices the sharded axis of something that is not a layer's output");
  }
  if (x.whole) {
    const auto known = parts.find(x.source);
    if (known != parts.end() && known->second != node.partition) {
      return conflict(x.region, node.label + " slices a layer's output into other parts than it was split into");
    }
    parts[x.source] = node.partition;
    return set_part(node.outputs.at(0), x, node.partition, static_cast<size_t>(node.part));
  }
  const auto known = parts.find(x.source);
  if (known == parts.end()) {
    std::vector<int64_t>& layer_parts = parts[x.source];
    for (int64_t size : node.partition) {
      layer_parts.push_back(size);
      constrain(x.region, size);
      regions[find(x.region)].localize.push_back(size);
    }
  } else if (known->second != node.partition) {
    return conflict(x.region, node.label + " slices a layer's output into other parts than it was split into");
  }
  set_sharded(node.outputs.at(0), {x.factor.axis, 1, node.partition.at(node.part)}, x.region);
}

// The parts smaller than the largest are those the layer holds whole (see visit_linear): replicated
// outputs; the others sharded in the layer's region, as for any fused layer.
void Propagation::set_part(int id, const Layout& x, const std::vector<int64_t>& partition, size_t part) {
  const int64_t largest = *std::max_element(partition.begin(), partition.end());
  int64_t whole = 0;
  std::vector<int64_t> whole_indices;
  for (size_t p = 0; p < partition.size(); ++p) {
    if (partition[p] < largest) {
      whole += partition[p];
      whole_indices.push_back(static_cast<int64_t>(p));
    }
  }
  if (whole != x.whole) {
    return conflict(x.region, "a fused output is split into other parts than its layer holds whole");
  }
  whole_parts[x.source] = whole_indices;
  layouts[id] = Layout{};
  const int64_t size = partition.at(part);
  if (size < largest) return;
  constrain(x.region, size);
  regions[find(x.region)].localize.push_back(size);
  set_sharded(id, {x.factor.axis, 1, size}, x.region);
}

void Propagation::visit_slice(const Node& node) {
  const int in = node.inputs.at(0), out = node.outputs.at(0);
  const Layout x = layouts[in];
  layouts[out] = Layout{};
  if (!x.sharded) return;
  const int64_t dim = node.dim, start = node.start, stop = node.stop;
  const bool drop = node.drop_dim;
  if (dim == x.factor.axis) {
    const int64_t length = shape(in)[dim];
    if (start <= 0 && stop >= length && !drop) {
      set_sharded(out, x.factor, x.region, x.source);
      layouts[out].whole = x.whole;
      return;
    }
    if (!node.partition.empty() && !drop) return slice_part(node, x);
    return conflict(x.region, node.label + " slices the sharded axis");
  }
  // A slice of another axis (the tokens a causal convolution's padding adds) keeps every
  // feature of the layer's output where it was: still its output for a split into its parts.
  AxisFactor f = x.factor;
  if (drop && dim < f.axis) f.axis -= 1;
  set_sharded(out, f, x.region, x.source);
  layouts[out].whole = x.whole;
}

}  // namespace autoshard::plan
