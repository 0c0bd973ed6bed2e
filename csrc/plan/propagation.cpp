// The forward pass of the planner: regions, layers, and the ops that move the sharded axis
// (reshapes, permutes, broadcasts); the ops that combine tensors are in propagation_ops.cpp.
#include "plan/propagation.h"

#include <algorithm>
#include <numeric>
#include <set>

#include <c10/util/Exception.h>

namespace autoshard::plan {
bool is_layer(const Node& node) {
  return node.kind == Kind::Linear || node.kind == Kind::Embedding || node.kind == Kind::Einsum;
}

Propagation::Propagation(const Graph& graph, const std::vector<Force>& forced) : graph_(graph), forced_(forced) {
  layouts.resize(graph.tensors.size());
  roles.assign(graph.nodes.size(), Style::Replicate);
  node_region.assign(graph.nodes.size(), -1);
}

void Propagation::run(const std::set<int>& vocab_embeddings, const std::map<int, AxisFactor>& cuts,
                      const std::map<int, AxisFactor>& node_cuts) {
  producer_.assign(graph_.tensors.size(), -1);
  consumers_.assign(graph_.tensors.size(), {});
  carries_grad_.assign(graph_.tensors.size(), false);
  read_.assign(graph_.tensors.size(), false);
  for (size_t t = 0; t < graph_.tensors.size(); ++t) {
    carries_grad_[t] = graph_.tensors[t].param >= 0;
    read_[t] = graph_.tensors[t].is_output;
  }
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    const Node& node = graph_.nodes[n];
    bool grad = is_layer(node);
    for (int id : node.inputs) {
      grad = grad || carries_grad_[id];
      read_[id] = true;
      consumers_[id].push_back(static_cast<int>(n));
    }
    for (int id : node.outputs) {
      producer_[id] = static_cast<int>(n);
      carries_grad_[id] = grad;
    }
  }
  open_head_params();
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    current_node_ = static_cast<int>(n);
    open_cuts(current_node_, cuts);
    visit(current_node_, vocab_embeddings);
    const auto cut = node_cuts.find(current_node_);
    if (cut != node_cuts.end()) {
      const int region = new_region(cut->second.size);
      const int source = is_uniform_source(graph_.nodes[n]) ? kAnySource : -1;
      set_sharded(graph_.nodes[n].outputs.at(0), cut->second, region, source);
      node_cut_region[current_node_] = region;
      node_cut_factor[current_node_] = cut->second;
    }
  }
  open_cuts(static_cast<int>(graph_.nodes.size()), cuts);
  current_node_ = -1;
  // A fused layer's output split into parts somewhere (its weight then split part by part) and
  // read whole by a row layer, which would split its input features as one run: known only once
  // every split is seen, so checked after the pass.
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    if (roles[n] != Style::Row) continue;
    const Layout& x = layouts[graph_.nodes[n].inputs.at(0)];
    const auto known = x.sharded && x.source >= 0 ? parts.find(x.source) : parts.end();
    if (known != parts.end() && known->second.size() > 1) {
      conflict(x.region, graph_.nodes[n].label + " reads a fused output split into parts as one run");
    }
  }
  for (size_t t = 0; t < graph_.tensors.size(); ++t) {
    const Layout& l = layouts[t];
    if (graph_.tensors[t].is_output && l.sharded) {
      regions[find(l.region)].reaches_output = true;
    }
  }
}

int Propagation::find(int r) {
  while (regions[r].parent != r) r = regions[r].parent = regions[regions[r].parent].parent;
  return r;
}

int Propagation::new_region(int64_t size) {
  Region r;
  r.parent = static_cast<int>(regions.size());
  r.units = size;
  regions.push_back(r);
  return r.parent;
}

void Propagation::constrain(int region, int64_t size) {
  Region& r = regions[find(region)];
  r.units = std::gcd(r.units, size);
}

void Propagation::unite(int a, int b) {
  a = find(a);
  b = find(b);
  if (a == b) return;
  Region& ra = regions[a];
  Region& rb = regions[b];
  rb.parent = a;
  ra.units = std::gcd(ra.units, rb.units);
  ra.reaches_output = ra.reaches_output || rb.reaches_output;
  if (!ra.conflict && rb.conflict) ra.reason = rb.reason;
  ra.conflict = ra.conflict || rb.conflict;
  ra.localize.insert(ra.localize.end(), rb.localize.begin(), rb.localize.end());
}

int Propagation::producer_before(int tensor, int before) const {
  const int last = producer_.at(tensor);
  if (last < before) return last;
  for (int n = std::min(before, static_cast<int>(graph_.nodes.size())) - 1; n >= 0; --n) {
    const auto& outs = graph_.nodes[n].outputs;
    if (std::find(outs.begin(), outs.end(), tensor) != outs.end()) return n;
  }
  return -1;
}

void Propagation::conflict(int region, const std::string& why) {
  const int root = find(region);
  for (int r : {root, kv_fine.count(root) ? kv_fine.at(root) : root}) {
    Region& target = regions[find(r)];
    if (!target.conflict) target.reason = why;
    target.conflict = true;
  }
}


// Every sharded input stops here; outputs are replicated.
void Propagation::block(const Node& node, const std::string& why) {
  for (int id : node.inputs) {
    if (layouts[id].sharded) conflict(layouts[id].region, why);
  }
  for (int id : node.outputs) layouts[id] = Layout{};
}

void Propagation::set_sharded(int id, AxisFactor factor, int region, int source, int64_t repeat_next) {
  Layout l;
  l.sharded = true;
  l.factor = factor;
  l.region = region;
  l.source = source;
  l.repeat_next = repeat_next;
  layouts[id] = l;
}


// A concatenation of split outputs along their split axis holds each part's shard, not one run
// of the axis: only ops that keep the axis as it is (elementwise with its own parameters, views
// and permutes that leave it alone, reductions over other axes) and the split into its parts may
// read it. An op that would read it as one run (a row layer, a view merging it) conflicts.
int Propagation::concatenated_parts(int tensor) const {
  const Layout& l = layouts[tensor];
  if (!l.sharded || l.source < 0 || is_layer(graph_.nodes[l.source]) || !parts.count(l.source)) return -1;
  return l.source;
}

void Propagation::visit(int n, const std::set<int>& vocab_embeddings) {
  const Node& node = graph_.nodes[n];
  int concatenated = -1;
  for (int id : node.inputs) concatenated = std::max(concatenated, concatenated_parts(id));
  const bool keeps_axis = node.kind == Kind::View || node.kind == Kind::Permute || node.kind == Kind::Pointwise ||
                          node.kind == Kind::Reduce || node.kind == Kind::Expand;
  if (concatenated >= 0 && !keeps_axis && node.kind != Kind::Split && node.kind != Kind::Slice) {
    for (int id : node.inputs) {
      if (layouts[id].sharded) conflict(layouts[id].region, node.label + " reads a concatenation of split outputs as one");
    }
  }
  visit_kind(n, node, vocab_embeddings);
  if (concatenated >= 0 && keeps_axis) {
    for (int id : node.outputs) {
      if (layouts[id].sharded && layouts[id].source != concatenated) {
        conflict(layouts[id].region, node.label + " reads a concatenation of split outputs as one");
      }
    }
  }
}

void Propagation::visit_kind(int n, const Node& node, const std::set<int>& vocab_embeddings) {
  if (node.kind != Kind::View && node.kind != Kind::Permute && node.kind != Kind::Split && node.kind != Kind::Slice) {
    for (int id : node.inputs) {
      if (layouts[id].sharded && layouts[id].whole) {
        conflict(layouts[id].region, node.label + " reads a fused output whose smaller parts are held whole");
      }
    }
  }
  switch (node.kind) {
    case Kind::Linear: return visit_linear(n, node);
    case Kind::Embedding: return visit_embedding(n, node, vocab_embeddings.count(n) > 0);
    case Kind::Einsum: return visit_einsum(n, node);
    case Kind::View: return visit_view(node);
    case Kind::Permute: return visit_permute(node);
    case Kind::Expand: return visit_expand(node);
    case Kind::Pointwise: return visit_pointwise(node);
    case Kind::Reduce: return visit_reduce(node);
    case Kind::Matmul: return visit_matmul(node);
    case Kind::Attention: return visit_attention(node);
    case Kind::AttentionWeights: return visit_attention_weights(n, node);
    case Kind::Norm: return visit_norm(n, node);
    case Kind::Split: return visit_split(node);
    case Kind::Cat: return visit_cat(node);
    case Kind::Slice: return visit_slice(node);
    case Kind::Source: return block(node, "");
    case Kind::Opaque: return block(node, "reaches " + node.label + ", which autoshard cannot follow");
  }
}

void Propagation::visit_linear(int n, const Node& node) {
  const Layout x = layouts[node.inputs.at(0)];
  const int out = node.outputs.at(0);
  const int64_t in_features = node.in_features, out_features = node.out_features;
  layouts[out] = Layout{};
  if (forced_[n] == Force::Replicate) {
    if (x.sharded) conflict(x.region, "feeds " + node.label + ", which is replicated");
    return;
  }
  if (!x.sharded && forced_[n] == Force::WholeSmallParts) {
    // The parts found by the pass that forced it (in the units they were cut in, heads or
    // features): those smaller than the largest stay whole.
    const std::vector<int64_t>& known = known_parts.at(n);
    const int64_t largest = *std::max_element(known.begin(), known.end());
    int64_t whole = 0, total = 0;
    for (int64_t size : known) {
      whole += size < largest ? size : 0;
      total += size;
    }
    whole = whole * out_features / total;
    node_region[n] = new_region(out_features - whole);
    roles[n] = Style::Column;
    set_sharded(out, {static_cast<int>(shape(out).size()) - 1, 1, out_features}, node_region[n], n);
    layouts[out].whole = whole;
    return;
  }
  if (!x.sharded) {
    node_region[n] = new_region(out_features);
    if (forced_[n] == Force::Gather) {
      roles[n] = Style::ColumnGather;
      return;
    }
    roles[n] = Style::Column;
    set_sharded(out, {static_cast<int>(shape(out).size()) - 1, 1, out_features}, node_region[n], n);
    return;
  }
  const bool contracts = x.factor.axis == static_cast<int>(shape(node.inputs[0]).size()) - 1 &&
                         x.factor.outer == 1 && x.factor.size == in_features;
  if (!contracts) {
    conflict(x.region, "reaches " + node.label + " on an axis it does not contract");
    return;
  }
  roles[n] = Style::Row;
  node_region[n] = x.region;
}

// An einsum layer over a replicated input splits the first letter its weight brings to the
// output (a head axis); over a sharded input it contracts that letter, as a row layer does, or
// carries it through to the output where the letter is a batch letter (a grouped convolution's
// groups): each rank then computes its own batch entries, with no collective. The region's
// units must divide the letter's extent, so that a split keeps every group whole.
void Propagation::visit_einsum(int n, const Node& node) {
  const Layout x = layouts[node.inputs.at(0)];
  const int out = node.outputs.at(0);
  layouts[out] = Layout{};
  if (forced_[n] == Force::Replicate) {
    if (x.sharded) conflict(x.region, "feeds " + node.label + ", which is replicated");
    return;
  }
  if (!x.sharded) {
    const EinsumLetter* first = nullptr;
    for (const auto& axis : node.letters) {
      if (axis.role == EinsumLetter::Output && (!first || axis.output_dim < first->output_dim)) first = &axis;
    }
    if (!first) return;
    const int64_t size = shape(out).at(first->output_dim);
    node_region[n] = new_region(size);
    letters[n] = first->letter;
    if (forced_[n] == Force::Gather) {
      roles[n] = Style::ColumnGather;
    } else {
      roles[n] = Style::Column;
      set_sharded(out, {static_cast<int>(first->output_dim), 1, size}, node_region[n], n);
    }
    return;
  }
  const EinsumLetter* contracted = nullptr;
  const EinsumLetter* batch = nullptr;
  for (const auto& axis : node.letters) {
    if (axis.input_dim == x.factor.axis && axis.role == EinsumLetter::Contracted) contracted = &axis;
    if (axis.input_dim == x.factor.axis && axis.role == EinsumLetter::Batch && axis.output_dim >= 0) batch = &axis;
  }
  if (batch && x.factor.outer == 1) {
    const int64_t extent = batch->size > 0 ? batch->size : x.factor.size;
    constrain(x.region, extent);
    roles[n] = Style::Batch;
    node_region[n] = x.region;
    letters[n] = batch->letter;
    const int axis = static_cast<int>(batch->output_dim);
    const int64_t size = shape(out).at(axis);  // a depthwise convolution's channel multiplier may change it
    if (size != x.factor.size) regions[find(x.region)].localize.push_back(size);
    return set_sharded(out, {axis, 1, size}, x.region);
  }
  if (!contracted || x.factor.outer != 1) {
    return conflict(x.region, "reaches " + node.label + " on a letter it does not contract");
  }
  roles[n] = Style::Row;
  node_region[n] = x.region;
  letters[n] = contracted->letter;
}

void Propagation::visit_embedding(int n, const Node& node, bool vocab_parallel) {
  block(node, "is used as embedding indices");
  if (vocab_parallel && forced_[n] != Force::Replicate) {
    roles[n] = Style::Vocab;
    node_region[n] = new_region(node.num_embeddings);
  }
}

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
