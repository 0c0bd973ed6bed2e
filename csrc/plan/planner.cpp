#include "plan/planner.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>

#include "plan/reshape.h"

namespace autoshard::plan {
namespace {

enum class Force { None, Replicate, Gather };

struct Layout {
  bool sharded = false;
  AxisFactor factor;
  int region = -1;
  int source = -1;  // the column layer whose output this is, unchanged (for fused splits)
  // The size the axis right after the sharded one was broadcast to from 1 (repeat_kv's
  // expand), so that a reshape merging the two repeats each unit that many times.
  int64_t repeat_next = 0;
};

// A coarse region (KV heads) whose units each feed `ratio` consecutive units of a fine region
// (the query heads that share a KV head), met through a repeat or a grouped attention.
struct Link {
  int coarse = -1;
  int fine = -1;
};

struct Region {
  int parent = 0;
  int64_t units = 0;  // gcd of every sharded size the region passes through
  bool conflict = false;
  bool reaches_output = false;
  std::string reason;
  std::vector<int64_t> localize;
};

// An einsum layer's equation, as the letters of its input, weight and output.
struct EinsumLetters {
  int64_t weight_param, bias_param;
  std::vector<int64_t> input, weight, output;

  explicit EinsumLetters(const Node& node) {
    size_t i = 0;
    auto take = [&](std::vector<int64_t>& into) {
      const int64_t n = node.args.at(i++);
      for (int64_t k = 0; k < n; ++k) into.push_back(node.args.at(i++));
    };
    weight_param = node.args.at(i++);
    bias_param = node.args.at(i++);
    take(input);
    take(weight);
    take(output);
  }

  static bool has(const std::vector<int64_t>& letters, int64_t letter) {
    return std::find(letters.begin(), letters.end(), letter) != letters.end();
  }
};

bool is_layer(const Node& node) {
  return node.kind == Kind::Linear || node.kind == Kind::Embedding || node.kind == Kind::Einsum;
}

int64_t weight_param(const Node& node) {
  return node.kind == Kind::Einsum ? EinsumLetters(node).weight_param : node.args.at(2);
}

int64_t bias_param(const Node& node) {
  if (node.kind == Kind::Einsum) return EinsumLetters(node).bias_param;
  return node.kind == Kind::Linear ? node.args.at(3) : -1;
}

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// One pass over the graph with some layers' decisions forced.
class Propagation {
 public:
  Propagation(const Graph& graph, const std::vector<Force>& forced) : graph_(graph), forced_(forced) {
    layouts.resize(graph.tensors.size());
    roles.assign(graph.nodes.size(), Style::Replicate);
    node_region.assign(graph.nodes.size(), -1);
  }

  void run(const std::set<int>& vocab_embeddings) {
    for (size_t n = 0; n < graph_.nodes.size(); ++n) visit(static_cast<int>(n), vocab_embeddings);
    for (size_t t = 0; t < graph_.tensors.size(); ++t) {
      const Layout& l = layouts[t];
      if (graph_.tensors[t].is_output && l.sharded) {
        regions[find(l.region)].reaches_output = true;
      }
    }
  }

  int find(int r) {
    while (regions[r].parent != r) r = regions[r].parent = regions[regions[r].parent].parent;
    return r;
  }

  std::vector<Layout> layouts;
  std::vector<Style> roles;
  std::vector<int> node_region;
  std::map<int, std::vector<int64_t>> parts;
  std::map<int, int64_t> letters;  // einsum layers: the weight letter split
  std::vector<Region> regions;
  std::vector<Link> links;
  // Coarse region root -> its fine region root, for links kept apart by settle_links: the
  // KV heads are then replicated on the ranks whose query heads use them.
  std::map<int, int> kv_fine;

  // Decides every link once the pass has run: a pair whose combined units (their gcd, as if
  // one region) still cover the ranks becomes one region, as does any pair that cannot be
  // split on the query heads alone; the others keep their KV heads replicated where needed.
  void settle_links(int64_t world_size) {
    std::map<int, std::set<int>> fines_of;
    for (const Link& l : links) fines_of[find(l.coarse)].insert(find(l.fine));
    std::map<int, std::set<int64_t>> ratios_of_fine;
    for (const auto& [coarse, fines] : fines_of) {
      if (fines.size() != 1 || coarse == *fines.begin()) continue;
      const int fine = *fines.begin();
      const Region& c = regions[coarse];
      const Region& f = regions[fine];
      if (std::gcd(c.units, f.units) >= world_size || c.conflict || f.conflict || f.units < world_size ||
          c.units <= 0 || f.units % c.units || !uniform_groups(f.units, f.units / c.units, world_size) ||
          !only_plain_columns(coarse)) {
        continue;
      }
      kv_fine[coarse] = fine;
      ratios_of_fine[fine].insert(f.units / c.units);
    }
    // One attention's KV projections must all repeat alike.
    for (auto it = kv_fine.begin(); it != kv_fine.end();) {
      it = ratios_of_fine[it->second].size() == 1 ? std::next(it) : kv_fine.erase(it);
    }
    for (const Link& l : links) {
      const int coarse = find(l.coarse);
      if (!kv_fine.count(coarse)) unite(coarse, l.fine);
    }
    std::map<int, int> rooted;
    for (const auto& [coarse, fine] : kv_fine) rooted[find(coarse)] = find(fine);
    kv_fine = rooted;
  }

  // Whether splitting `units` fine units over the ranks (split_sizes) gives every rank query
  // heads that its run of KV heads serves in equal consecutive groups, as repeat_kv and a
  // grouped attention compute locally (fine unit u uses coarse unit u / ratio).
  static bool uniform_groups(int64_t units, int64_t ratio, int64_t world_size) {
    int64_t start = 0;
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t count = units / world_size + (r < units % world_size ? 1 : 0);
      const int64_t first = start / ratio, last = (start + count - 1) / ratio;
      const int64_t kv = last - first + 1;
      if (count == 0 || count % kv) return false;
      const int64_t group = count / kv;
      for (int64_t i = 0; i < count; ++i) {
        if ((start + i) / ratio - first != i / group) return false;
      }
      start += count;
    }
    return true;
  }

 private:
  // A region kept coarse must hold nothing but plain column Linear layers (the KV projections).
  bool only_plain_columns(int coarse) {
    bool any = false;
    for (size_t n = 0; n < graph_.nodes.size(); ++n) {
      if (node_region[n] < 0 || find(node_region[n]) != coarse) continue;
      if (roles[n] != Style::Column || graph_.nodes[n].kind != Kind::Linear || parts.count(static_cast<int>(n))) {
        return false;
      }
      any = true;
    }
    return any;
  }

 public:

 private:
  int new_region(int64_t size) {
    Region r;
    r.parent = static_cast<int>(regions.size());
    r.units = size;
    regions.push_back(r);
    return r.parent;
  }

  void constrain(int region, int64_t size) {
    Region& r = regions[find(region)];
    r.units = std::gcd(r.units, size);
  }

  void unite(int a, int b) {
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

  void conflict(int region, const std::string& why) {
    Region& r = regions[find(region)];
    if (!r.conflict) r.reason = why;
    r.conflict = true;
  }

  const std::vector<int64_t>& shape(int id) const { return graph_.tensor(id).shape; }

  // Every sharded input stops here; outputs are replicated.
  void block(const Node& node, const std::string& why) {
    for (int id : node.inputs) {
      if (layouts[id].sharded) conflict(layouts[id].region, why);
    }
    for (int id : node.outputs) layouts[id] = Layout{};
  }

  void set_sharded(int id, AxisFactor factor, int region, int source = -1, int64_t repeat_next = 0) {
    Layout l;
    l.sharded = true;
    l.factor = factor;
    l.region = region;
    l.source = source;
    l.repeat_next = repeat_next;
    layouts[id] = l;
  }

  void link(int coarse, int fine) { links.push_back({coarse, fine}); }

  void visit(int n, const std::set<int>& vocab_embeddings) {
    const Node& node = graph_.nodes[n];
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
      case Kind::Split: return visit_split(node);
      case Kind::Cat: return visit_cat(node);
      case Kind::Slice: return visit_slice(node);
      case Kind::Source: return block(node, "");
      case Kind::Opaque: return block(node, "reaches " + node.label + ", which autoshard cannot follow");
    }
  }

  void visit_linear(int n, const Node& node) {
    const Layout x = layouts[node.inputs.at(0)];
    const int out = node.outputs.at(0);
    const int64_t in_features = node.args.at(0), out_features = node.args.at(1);
    layouts[out] = Layout{};
    if (forced_[n] == Force::Replicate) {
      if (x.sharded) conflict(x.region, "feeds " + node.label + ", which is replicated");
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
  // output (a head axis); over a sharded input it contracts that letter, as a row layer does.
  void visit_einsum(int n, const Node& node) {
    const EinsumLetters eq(node);
    const Layout x = layouts[node.inputs.at(0)];
    const int out = node.outputs.at(0);
    layouts[out] = Layout{};
    if (forced_[n] == Force::Replicate) {
      if (x.sharded) conflict(x.region, "feeds " + node.label + ", which is replicated");
      return;
    }
    if (!x.sharded) {
      for (size_t k = 0; k < eq.output.size(); ++k) {
        const int64_t letter = eq.output[k];
        if (!EinsumLetters::has(eq.weight, letter) || EinsumLetters::has(eq.input, letter)) continue;
        const int64_t size = shape(out)[k];
        node_region[n] = new_region(size);
        letters[n] = letter;
        if (forced_[n] == Force::Gather) {
          roles[n] = Style::ColumnGather;
        } else {
          roles[n] = Style::Column;
          set_sharded(out, {static_cast<int>(k), 1, size}, node_region[n], n);
        }
        return;
      }
      return;
    }
    const int64_t letter = eq.input.at(x.factor.axis);
    const bool contracted = EinsumLetters::has(eq.weight, letter) && !EinsumLetters::has(eq.output, letter);
    if (!contracted || x.factor.outer != 1) {
      return conflict(x.region, "reaches " + node.label + " on a letter it does not contract");
    }
    roles[n] = Style::Row;
    node_region[n] = x.region;
    letters[n] = letter;
  }

  void visit_embedding(int n, const Node& node, bool vocab_parallel) {
    block(node, "is used as embedding indices");
    if (vocab_parallel && forced_[n] != Force::Replicate) {
      roles[n] = Style::Vocab;
      node_region[n] = new_region(node.args.at(0));
    }
  }

  void visit_view(const Node& node) {
    const int in = node.inputs.at(0), out = node.outputs.at(0);
    const Layout x = layouts[in];
    layouts[out] = Layout{};
    if (!x.sharded) return;
    const ReshapeResult r = map_reshape(shape(in), shape(out), x.factor);
    if (!r.ok) return conflict(x.region, node.label + ": " + r.why);
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
    set_sharded(out, r.factor, x.region, unchanged ? x.source : -1);
  }

  void visit_permute(const Node& node) {
    const Layout x = layouts[node.inputs.at(0)];
    const int out = node.outputs.at(0);
    layouts[out] = Layout{};
    if (!x.sharded) return;
    for (size_t j = 0; j < node.args.size(); ++j) {
      if (node.args[j] == x.factor.axis) {
        AxisFactor f = x.factor;
        f.axis = static_cast<int>(j);
        set_sharded(out, f, x.region, x.source);
        return;
      }
    }
    conflict(x.region, node.label + ": malformed permutation");
  }

  void visit_expand(const Node& node) {
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

  // Aligns input axis `axis` of an input with `ndim` dims to the output's (numpy broadcasting).
  static int aligned(int axis, size_t ndim, size_t out_ndim) { return axis + static_cast<int>(out_ndim - ndim); }

  // Elementwise ops and concatenation: every sharded input must agree on one output axis,
  // and a replicated input may only be broadcast along it (size 1 or absent).
  bool merge_elementwise(const Node& node, Layout& merged, int skip_axis_check = -1) {
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
      if (merged.source != l.source) merged.source = -1;
      if (merged.repeat_next != l.repeat_next) merged.repeat_next = 0;
    }
    if (!merged.sharded) return true;
    for (int id : node.inputs) {
      if (layouts[id].sharded) continue;
      const auto& s = shape(id);
      const int axis = merged.factor.axis - static_cast<int>(out_ndim - s.size());
      if (axis >= 0 && axis != skip_axis_check && s[axis] != 1) {
        conflict(merged.region, node.label + " combines the sharded axis with a replicated tensor");
        return false;
      }
    }
    return true;
  }

  void visit_pointwise(const Node& node) {
    Layout merged;
    const bool ok = merge_elementwise(node, merged);
    for (int id : node.outputs) {
      layouts[id] = Layout{};
      if (ok && merged.sharded && shape(id).size() == shape(node.outputs[0]).size()) {
        set_sharded(id, merged.factor, merged.region, merged.source, merged.repeat_next);
      }
    }
  }

  void visit_reduce(const Node& node) {
    const int in = node.inputs.at(0);
    const Layout x = layouts[in];
    for (int id : node.outputs) layouts[id] = Layout{};
    for (size_t i = 1; i < node.inputs.size(); ++i) {
      if (layouts[node.inputs[i]].sharded) conflict(layouts[node.inputs[i]].region, node.label + " takes a sharded parameter");
    }
    if (!x.sharded) return;
    int removed_before = 0;
    for (int64_t axis : node.args) {
      if (axis == x.factor.axis) return conflict(x.region, node.label + " reduces over the sharded axis");
      if (axis < x.factor.axis) ++removed_before;
    }
    for (int id : node.outputs) {
      AxisFactor f = x.factor;
      if (shape(id).size() != shape(in).size()) f.axis -= removed_before;
      if (f.axis < static_cast<int>(shape(id).size()) && shape(id)[f.axis] == shape(in)[x.factor.axis]) {
        set_sharded(id, f, x.region);
      }
    }
  }

  void visit_matmul(const Node& node) {
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
      if (axis >= 0 && s[axis] != 1) return conflict(l.region, node.label + " multiplies by a replicated batch");
      f.axis = aligned(l.factor.axis, ndim, nd);
    } else {
      f.axis = la.sharded ? nd - 2 : nd - 1;
    }
    set_sharded(out, f, l.region);
  }

  void visit_attention(const Node& node) {
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
      if (!l.sharded || l.factor.axis != q.factor.axis) return conflict(q.region, node.label + " needs q, k and v sharded alike");
      if (l.factor.size < q.factor.size && q.factor.size % l.factor.size == 0 && l.factor.outer == q.factor.outer) {
        link(l.region, q.region);  // grouped-query attention: fewer KV heads than query heads
        continue;
      }
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

  void visit_split(const Node& node) {
    const int in = node.inputs.at(0);
    const Layout x = layouts[in];
    const int64_t dim = node.args.at(0);
    for (int id : node.outputs) layouts[id] = Layout{};
    if (!x.sharded) return;
    if (dim != x.factor.axis) {
      for (int id : node.outputs) set_sharded(id, x.factor, x.region);
      return;
    }
    // Splitting a fused layer's output (QKV in one Linear): each part is sharded on its own,
    // which the layer's weight layout must mirror.
    if (x.source < 0 || x.factor.outer != 1 || parts.count(x.source)) {
      return conflict(x.region, node.label + " splits the sharded axis of something that is not a layer's output");
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

  void visit_cat(const Node& node) {
    Layout merged;
    const int64_t dim = node.args.at(0);
    const bool ok = merge_elementwise(node, merged, static_cast<int>(dim));
    const int out = node.outputs.at(0);
    layouts[out] = Layout{};
    if (!ok || !merged.sharded) return;
    if (merged.factor.axis == dim) return conflict(merged.region, node.label + " concatenates along the sharded axis");
    set_sharded(out, merged.factor, merged.region);
  }

  void visit_slice(const Node& node) {
    const int in = node.inputs.at(0), out = node.outputs.at(0);
    const Layout x = layouts[in];
    layouts[out] = Layout{};
    if (!x.sharded) return;
    const int64_t dim = node.args.at(0), start = node.args.at(1), stop = node.args.at(2), drop = node.args.at(3);
    if (dim == x.factor.axis) {
      const int64_t length = shape(in)[dim];
      if (start <= 0 && stop >= length && !drop) return set_sharded(out, x.factor, x.region, x.source);
      return conflict(x.region, node.label + " slices the sharded axis");
    }
    AxisFactor f = x.factor;
    if (drop && dim < f.axis) f.axis -= 1;
    set_sharded(out, f, x.region);
  }

  const Graph& graph_;
  const std::vector<Force>& forced_;
};

// The largest embedding tables are the token tables; position and type tables stay replicated.
std::set<int> token_tables(const Graph& graph) {
  int64_t largest = 0;
  for (const Node& node : graph.nodes) {
    if (node.kind == Kind::Embedding) largest = std::max(largest, node.args.at(0));
  }
  std::set<int> chosen;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.kind == Kind::Embedding && node.args.at(0) == largest) chosen.insert(static_cast<int>(n));
  }
  return chosen;
}


std::string units_note(int64_t units, int64_t world) {
  std::ostringstream s;
  s << "only " << units << " whole unit(s) (heads) to split across " << world << " ranks";
  return s.str();
}

}  // namespace

Plan make_plan(const Graph& graph, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size > 0, "plan: world_size must be a positive integer, got ", world_size);
  const size_t count = graph.nodes.size();
  std::vector<Force> forced(count, Force::None);
  std::vector<std::string> notes(count);
  const std::set<int> vocab = token_tables(graph);
  for (const auto& [node, style] : graph.forced) {
    TORCH_CHECK_VALUE(node >= 0 && static_cast<size_t>(node) < count && is_layer(graph.nodes[node]),
                      "plan: override names node ", node, ", which is not a layer");
    forced[node] = style == "replicate" ? Force::Replicate : Force::Gather;
    notes[node] = style == "replicate" ? "replicated: by override" : "gathered: by override";
  }

  // Which layers hold each parameter, and which parameters other ops read directly.
  std::map<int64_t, std::vector<int>> layers_of_param;
  std::set<int64_t> params_read_elsewhere;
  for (size_t n = 0; n < count; ++n) {
    const Node& node = graph.nodes[n];
    if (is_layer(node)) {
      layers_of_param[weight_param(node)].push_back(static_cast<int>(n));
      if (bias_param(node) >= 0) layers_of_param[bias_param(node)].push_back(static_cast<int>(n));
    } else {
      for (int id : node.inputs) {
        if (graph.tensor(id).param >= 0) params_read_elsewhere.insert(graph.tensor(id).param);
      }
    }
  }

  auto force = [&](int n, Force f, const std::string& why) {
    if (forced[n] == f || forced[n] == Force::Replicate) return false;
    forced[n] = f;
    notes[n] = why;
    return true;
  };

  for (size_t iteration = 0;; ++iteration) {
    TORCH_CHECK(iteration <= count + 1, "plan: decisions did not settle");
    Propagation pass(graph, forced);
    pass.run(vocab);
    pass.settle_links(world_size);
    bool changed = false;
    for (size_t n = 0; n < count; ++n) {
      const Style role = pass.roles[n];
      if (role != Style::Column && role != Style::Vocab) continue;
      const int root = pass.find(pass.node_region[n]);
      const auto kv = pass.kv_fine.find(root);
      // KV heads replicated where needed: the query heads' region decides for both.
      Region& region = pass.regions[kv == pass.kv_fine.end() ? root : kv->second];
      if (region.conflict) {
        changed |= force(static_cast<int>(n), Force::Replicate, "replicated: its output " + region.reason);
      } else if (region.units < world_size) {
        changed |= force(static_cast<int>(n), Force::Replicate, "replicated: " + units_note(region.units, world_size));
      } else if (region.reaches_output) {
        changed |= force(static_cast<int>(n), Force::Gather, "gathered: its output is a model output");
      }
    }
    // A parameter shared by several layers (tied embeddings) is sharded only if every layer
    // shards it on the same dimension into the same pieces: a token table and a column layer
    // over the vocabulary. A parameter read outside its layers stays whole.
    for (const auto& [param, layers] : layers_of_param) {
      bool agree = !params_read_elsewhere.count(param);
      std::set<int64_t> units;
      for (int n : layers) {
        const Style role = pass.roles[n];
        if (role == Style::Replicate || role == Style::Row) agree = agree && layers.size() == 1;
        if (role == Style::Vocab) units.insert(graph.nodes[n].args.at(0));
        if (role == Style::Column || role == Style::ColumnGather) {
          units.insert(pass.regions[pass.find(pass.node_region[n])].units);
          agree = agree && (layers.size() == 1 || !pass.parts.count(n));
        }
      }
      agree = agree && units.size() <= 1;
      if (agree) continue;
      for (int n : layers) {
        changed |= force(n, Force::Replicate,
                         params_read_elsewhere.count(param) ? "replicated: its weight is also read outside the layer"
                                                            : "replicated: it shares its weight with a layer split differently");
      }
    }
    if (changed) continue;

    Plan plan;
    std::map<int, int> copy_groups;  // input tensor -> group
    std::map<int, RegionSummary> regions;
    auto comm = [&](const char* phase, const char* kind, int64_t elements) {
      if (world_size == 1) return;  // a group of one rank communicates nothing
      for (CommCount& c : plan.comm) {
        if (c.phase == phase && c.kind == kind) {
          c.count += 1;
          c.elements += elements;
          return;
        }
      }
      plan.comm.push_back({phase, kind, 1, elements});
    };
    // A model input needs no gradient, so the copy of one issues no backward all-reduce.
    std::vector<bool> produced(graph.tensors.size(), false);
    for (const Node& node : graph.nodes) {
      for (int id : node.outputs) produced[id] = true;
    }
    for (size_t n = 0; n < count; ++n) {
      const Node& node = graph.nodes[n];
      if (!is_layer(node)) continue;
      LayerDecision d;
      d.node = static_cast<int>(n);
      d.style = pass.roles[n];
      d.note = notes[n];
      if (d.style != Style::Replicate) {
        int root = pass.find(pass.node_region[n]);
        d.units = d.style == Style::Vocab ? node.args.at(0) : pass.regions[root].units;
        if (pass.kv_fine.count(root)) {
          // A KV projection: its units are KV heads, each serving `repeat` query-head units
          // of the attention's region; the ranks holding one sum its gradient in backward.
          root = pass.kv_fine.at(root);
          d.repeat = pass.regions[root].units / d.units;
          const int64_t weight = node.args.at(0) * node.args.at(1), bias = node.args.at(3) >= 0 ? node.args.at(1) : 0;
          comm("backward", "all_reduce", weight + bias);
          regions[root].repeat = d.repeat;
          regions[root].coarse_units = d.units;
          const auto& coarse = pass.regions[pass.find(pass.node_region[n])].localize;
          regions[root].coarse_localize.insert(regions[root].coarse_localize.end(), coarse.begin(), coarse.end());
          regions[root].coarse_localize.push_back(node.args.at(1));
        }
        d.region = root;
        if (pass.parts.count(static_cast<int>(n))) d.parts = pass.parts.at(static_cast<int>(n));
        if (pass.letters.count(static_cast<int>(n))) d.letter = pass.letters.at(static_cast<int>(n));
        if (d.style == Style::Column || d.style == Style::Row) {
          RegionSummary& summary = regions[root];
          summary.id = root;
          summary.units = pass.regions[root].units;
          summary.localize = pass.regions[root].localize;
        }
      }
      const int64_t out_elements = numel(graph.tensor(node.outputs.at(0)).shape);
      switch (d.style) {
        case Style::Row:
        case Style::Vocab: comm("forward", "all_reduce", out_elements); break;
        case Style::ColumnGather: comm("forward", "all_gather", out_elements); [[fallthrough]];
        case Style::Column: {
          const int input = node.inputs.at(0);
          auto [it, fresh] = copy_groups.emplace(input, static_cast<int>(copy_groups.size()));
          d.copy_group = it->second;
          if (fresh && produced[input]) comm("backward", "all_reduce", numel(graph.tensor(input).shape));
          break;
        }
        case Style::Replicate: break;
      }
      plan.layers.push_back(std::move(d));
    }
    auto sort_unique = [](std::vector<int64_t>& v) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    };
    for (auto& [id, summary] : regions) {
      sort_unique(summary.localize);
      sort_unique(summary.coarse_localize);
      plan.regions.push_back(summary);
    }
    return plan;
  }
}

std::string format_plan(const Plan& plan) {
  static const char* names[] = {"replicate", "column", "column_gather", "row", "vocab"};
  std::ostringstream out;
  for (const LayerDecision& d : plan.layers) {
    out << "layer " << d.node << ' ' << names[static_cast<int>(d.style)] << ' ' << d.region << ' ' << d.units << ' '
        << d.copy_group << " parts " << d.parts.size();
    for (int64_t p : d.parts) out << ' ' << p;
    out << " letter " << d.letter << " repeat " << d.repeat << " note " << d.note << '\n';
  }
  for (const RegionSummary& r : plan.regions) {
    out << "region " << r.id << ' ' << r.units << " localize " << r.localize.size();
    for (int64_t v : r.localize) out << ' ' << v;
    out << " repeat " << r.repeat << ' ' << r.coarse_units << ' ' << r.coarse_localize.size();
    for (int64_t v : r.coarse_localize) out << ' ' << v;
    out << '\n';
  }
  for (const CommCount& c : plan.comm) {
    out << "comm " << c.phase << ' ' << c.kind << ' ' << c.count << ' ' << c.elements << '\n';
  }
  return out.str();
}

}  // namespace autoshard::plan
