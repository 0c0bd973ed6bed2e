// Sequence parallelism: after the tensor-parallel roles are settled, the tensors between a
// layer that ends a region with an all-reduce (a row layer, a vocabulary-parallel embedding)
// and the column layers that start the next are split on their token axis instead of held
// whole. The all-reduce becomes a reduce-scatter over the tokens, and each column layer's
// input copy an all-gather of them; the per-token ops in between (norms over the features,
// elementwise ops, dropout, residual adds) run on this rank's tokens only.
//
// A sequence region is every tensor reached from its starting layers through per-token ops,
// merged where two meet (the residual stream joins every block's). A replicated embedding
// whose output meets one (position embeddings added to the token embeddings) is sliced to
// this rank's tokens. A region is refused as a whole, keeping its all-reduces, when a tensor
// of it reaches anything else: an op that mixes tokens, a reshape that merges the token axis,
// a layer that does not start a tensor-parallel region, a tensor held whole on every rank, or
// a model output. Replicated parameters read inside a region (norm weights, a row layer's
// bias) receive a partial gradient there, summed by the plan's partial-gradient buckets.
#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

int token_axis(const std::vector<int64_t>& shape) { return static_cast<int>(shape.size()) - 2; }

}  // namespace

void Propagation::run_sequence(const std::set<int>& refused) {
  for (size_t n = 0; n < graph_.nodes.size(); ++n) sequence_visit(static_cast<int>(n), graph_.nodes[n], refused);
  // A region that replaces no all-reduce (only sliced embeddings) would add collectives, and
  // one that no column layer reads has no use for split tokens.
  std::set<int> replacing, gathered;
  for (const auto& [n, role] : sequence_roles) {
    if (role == SequenceRole::ReduceScatter) replacing.insert(find(sequence_region.at(n)));
    if (role == SequenceRole::Gather) gathered.insert(find(sequence_region.at(n)));
  }
  for (const auto& [n, role] : sequence_roles) {
    const int root = find(sequence_region.at(n));
    if (role == SequenceRole::Slice && !replacing.count(root)) conflict(root, "it replaces no all-reduce");
    if (role != SequenceRole::Gather && !gathered.count(root)) conflict(root, "no column layer reads its tokens");
  }
  for (size_t t = 0; t < graph_.tensors.size(); ++t) {
    if (graph_.tensors[t].is_output && layouts[t].sequence) {
      conflict(layouts[t].region, "its tokens reach a model output");
    }
  }
}

// A layer reading a sequence region must gather it (a column layer of a tensor-parallel
// region); a layer ending a tensor-parallel region starts one.
void Propagation::sequence_layer(int n, const Node& node, const std::set<int>& refused) {
  const Style role = roles[n];
  const Layout& x = layouts[node.inputs.at(0)];
  if (x.sequence) {
    if ((role == Style::Column || role == Style::ColumnGather) && node.kind == Kind::Linear) {
      sequence_roles[n] = SequenceRole::Gather;
      sequence_axis[n] = x.factor.axis;
      sequence_region[n] = x.region;
    } else {
      conflict(x.region, "its tokens reach " + node.label + ", which does not start a tensor-parallel region");
    }
  }
  const int out = node.outputs.at(0);
  const auto& shape = graph_.tensor(out).shape;
  const bool starts = (role == Style::Row && node.kind == Kind::Linear) || role == Style::Vocab ||
                      (role == Style::Replicate && node.kind == Kind::Embedding);
  if (!starts || refused.count(n) || shape.size() < 2) return;
  const int axis = token_axis(shape);
  if (shape[axis] < 1) return;
  const int region = new_region(shape[axis]);
  regions[region].sequence = true;
  set_sharded(out, {axis, 1, shape[axis]}, region);
  layouts[out].sequence = true;
  sequence_roles[n] = role == Style::Replicate ? SequenceRole::Slice : SequenceRole::ReduceScatter;
  sequence_axis[n] = axis;
  sequence_region[n] = region;
}

void Propagation::sequence_visit(int n, const Node& node, const std::set<int>& refused) {
  if (is_layer(node)) return sequence_layer(n, node, refused);
  int region = -1;
  const Layout* first = nullptr;
  for (int id : node.inputs) {
    if (layouts[id].sequence) {
      first = &layouts[id];
      region = layouts[id].region;
      break;
    }
  }
  if (!first) return;
  const Layout x = *first;
  const int in = node.inputs.at(0);
  auto refuse = [&](const std::string& why) {
    for (int id : node.inputs) {
      if (layouts[id].sequence) conflict(layouts[id].region, why);
    }
  };
  auto mark = [&](int id, int axis) {
    set_sharded(id, {axis, 1, x.factor.size}, region);
    layouts[id].sequence = true;
  };
  switch (node.kind) {
    case Kind::Pointwise: {
      const size_t out_ndim = graph_.tensor(node.outputs.at(0)).shape.size();
      // Every input's token axis, aligned to the output's (numpy broadcasting).
      int aligned_axis = -1;
      for (int id : node.inputs) {
        const Layout& l = layouts[id];
        const int offset = static_cast<int>(out_ndim) - static_cast<int>(shape(id).size());
        if (l.sequence) {
          const int a = l.factor.axis + offset;
          if (aligned_axis >= 0 && (a != aligned_axis || l.factor.size != x.factor.size)) {
            return refuse(node.label + " combines tokens split on different axes");
          }
          aligned_axis = a;
          unite(region, l.region);
        } else if (l.sharded) {
          return refuse(node.label + " combines its tokens with a tensor-parallel shard");
        }
      }
      for (int id : node.inputs) {
        if (layouts[id].sequence) continue;
        const int a = aligned_axis - (static_cast<int>(out_ndim) - static_cast<int>(shape(id).size()));
        if (a >= 0 && shape(id)[a] != 1) {
          return refuse(node.label + " combines its tokens with a tensor held whole on every rank");
        }
      }
      for (int id : node.outputs) {
        if (shape(id).size() == out_ndim) mark(id, aligned_axis);
      }
      return;
    }
    case Kind::Reduce: {
      if (!layouts[in].sequence) return refuse(node.label + " takes its tokens as a parameter");
      for (size_t i = 1; i < node.inputs.size(); ++i) {
        const int id = node.inputs[i];
        if (layouts[id].sharded) return refuse(node.label + " takes a sharded parameter");
        const int a = x.factor.axis - (static_cast<int>(shape(in).size()) - static_cast<int>(shape(id).size()));
        if (a >= 0 && shape(id)[a] != 1) return refuse(node.label + " takes a parameter that varies along the tokens");
      }
      int removed_before = 0;
      for (int64_t axis : node.args) {
        if (axis == x.factor.axis) return refuse(node.label + " mixes tokens (it reduces over them)");
        if (axis < x.factor.axis) ++removed_before;
      }
      for (int id : node.outputs) {
        int axis = x.factor.axis;
        if (shape(id).size() != shape(in).size()) axis -= removed_before;
        if (axis >= 0 && axis < static_cast<int>(shape(id).size()) && shape(id)[axis] == x.factor.size) {
          mark(id, axis);
        } else {
          return refuse(node.label + " gives a result that is not per token");
        }
      }
      return;
    }
    case Kind::View: {
      const ReshapeResult r = map_reshape(shape(in), shape(node.outputs.at(0)), x.factor);
      if (!r.ok || r.factor.outer != 1 || r.factor.size != x.factor.size) {
        return refuse(node.label + " merges the token axis with another");
      }
      return mark(node.outputs.at(0), r.factor.axis);
    }
    case Kind::Permute: {
      for (size_t j = 0; j < node.args.size(); ++j) {
        if (node.args[j] == x.factor.axis) return mark(node.outputs.at(0), static_cast<int>(j));
      }
      return refuse(node.label + ": malformed permutation");
    }
    case Kind::Split: {
      if (node.args.at(0) == x.factor.axis) return refuse(node.label + " splits the token axis");
      for (int id : node.outputs) mark(id, x.factor.axis);
      return;
    }
    case Kind::Slice: {
      const int64_t dim = node.args.at(0), start = node.args.at(1), stop = node.args.at(2), drop = node.args.at(3);
      if (dim == x.factor.axis) {
        if (start <= 0 && stop >= shape(in)[dim] && !drop) return mark(node.outputs.at(0), x.factor.axis);
        return refuse(node.label + " selects some tokens");
      }
      return mark(node.outputs.at(0), drop && dim < x.factor.axis ? x.factor.axis - 1 : x.factor.axis);
    }
    default:
      return refuse(node.label + " mixes tokens, or autoshard cannot follow the token axis through it");
  }
}

}  // namespace autoshard::plan
