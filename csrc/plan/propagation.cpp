// The forward pass of the planner: regions and layers. The ops that move the sharded axis
// (reshapes, permutes, broadcasts) are in propagation_views.cpp, the ops that combine tensors
// in propagation_ops.cpp.
#include "plan/propagation.h"

#include <algorithm>
#include <numeric>

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

}  // namespace autoshard::plan
