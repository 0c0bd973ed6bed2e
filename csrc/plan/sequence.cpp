// Sequence parallelism: after the tensor-parallel roles are settled, the tensors between a
// layer that ends a region with an all-reduce (a row layer, a vocabulary-parallel embedding)
// and the column layers that start the next are split on their token axis instead of held
// whole. The all-reduce becomes a reduce-scatter over the tokens, and each column layer's
// input copy an all-gather of them; the per-token ops in between (norms over the features,
// elementwise ops, dropout, residual adds) run on this rank's tokens only.
//
// A sequence region is every tensor reached from its row layers through per-token ops, merged
// where two meet (the residual stream joins every block's). A tensor held whole that meets one
// (the embedding output entering the first block's residual add) is cut to this rank's tokens
// where a module receives it, if every op reading it is inside that module's call: a model
// reads such tensors' shapes before its blocks (position ids from the embedding output's
// length), which must still see every token. A region is refused as a whole, keeping its
// all-reduces, when a tensor of it reaches anything else: an op that mixes tokens, a reshape
// (which may spell the global token count), a layer that does not start a tensor-parallel
// region, a tensor held whole that no module entry can cut, a model output, or a reader
// standing for a module that may read the tokens' count (length_reads.cpp). Replicated
// parameters read inside a region (norm weights, a row layer's bias) receive a partial
// gradient there, summed by the plan's partial-gradient buckets. What only the module calls
// around a planned region can decide follows in replan.cpp (sequence_rules.h).
#include "plan/propagation.h"

#include <algorithm>

#include "plan/reasons.h"

namespace autoshard::plan {
namespace {

int token_axis(const std::vector<int64_t>& shape) { return static_cast<int>(shape.size()) - 2; }

bool sizeless_view(const std::string& label) {
  for (const char* op : {"aten.alias", "aten.view_as", "aten.lift_fresh", "aten.unsqueeze", "aten.squeeze"}) {
    const std::string name(op);
    if (label.compare(0, name.size(), name) == 0 && (label.size() == name.size() || label[name.size()] == '.')) {
      return true;
    }
  }
  return false;
}

}  // namespace

// The entry (a module's first call receiving `tensor`) whose call holds every op reading the
// tensor, the outermost if several; -1 if none.
// Whether `tensor` is computed by elementwise ops from a parameter cast to a narrower
// floating-point dtype (the capture marks such casts): Gemma's norms scale by
// (1 + weight.float()).
bool Propagation::narrowed_parameter(int tensor, int depth) const {
  if (depth > 8) return false;
  for (const Node& node : graph_.nodes) {
    if (std::find(node.outputs.begin(), node.outputs.end(), tensor) == node.outputs.end()) continue;
    if (node.kind != Kind::Pointwise) return false;
    for (int id : node.inputs) {
      if (node.narrowing && graph_.tensor(id).param >= 0) return true;
      if (narrowed_parameter(id, depth + 1)) return true;
    }
    return false;
  }
  return false;
}

int Propagation::find_entry(int tensor) const {
  if (graph_.tensor(tensor).is_output) return -1;
  std::vector<int> readers;
  for (size_t n = 0; n < graph_.nodes.size(); ++n) {
    for (int id : graph_.nodes[n].inputs) {
      if (id == tensor) readers.push_back(static_cast<int>(n));
    }
  }
  int best = -1;
  for (size_t e = 0; e < graph_.entries.size(); ++e) {
    const ModuleEntry& entry = graph_.entries[e];
    if (entry.tensor != tensor) continue;
    bool inside = true;
    for (int n : readers) inside = inside && n >= entry.first && n < entry.end;
    const ModuleEntry* other = best < 0 ? nullptr : &graph_.entries[best];
    if (inside && (!other || entry.end - entry.first > other->end - other->first)) best = static_cast<int>(e);
  }
  return best;
}

void Propagation::run_sequence(const std::set<int>& refused, const std::map<int, int>& entries) {
  // A Linear layer called more than once (ALBERT's shared layer) has one input copy and one
  // output for every call: its calls keep their tokens whole, so that each meets it alike.
  std::map<int64_t, int> calls;
  for (const Node& node : graph_.nodes) {
    if (node.kind == Kind::Linear) ++calls[node.weight_param];
  }
  called_again_.clear();
  for (const auto& [param, count] : calls) {
    if (count > 1) called_again_.insert(param);
  }
  for (const auto& [tensor, axis] : entries) {
    const int entry = find_entry(tensor);
    if (entry < 0) continue;
    const int64_t length = graph_.tensor(tensor).shape.at(axis);
    const int region = new_region(length);
    regions[region].sequence = true;
    set_sharded(tensor, {axis, 1, length}, region);
    layouts[tensor].sequence = true;
    entry_of[tensor] = entry;
  }
  for (size_t n = 0; n < graph_.nodes.size(); ++n) sequence_visit(static_cast<int>(n), graph_.nodes[n], refused);
  // A region that replaces no all-reduce (only cut entries) would add collectives, and one
  // that no column layer reads has no use for split tokens.
  std::set<int> replacing, gathered;
  for (const auto& [n, role] : sequence_roles) {
    if (role == SequenceRole::ReduceScatter) replacing.insert(find(sequence_region.at(n)));
    if (role == SequenceRole::Gather) gathered.insert(find(sequence_region.at(n)));
  }
  for (const auto& [tensor, entry] : entry_of) {
    if (!replacing.count(find(layouts[tensor].region))) conflict(layouts[tensor].region, "it replaces no all-reduce");
  }
  for (const auto& [n, role] : sequence_roles) {
    const int root = find(sequence_region.at(n));
    if (role != SequenceRole::Gather && !gathered.count(root)) conflict(root, "no column layer reads its tokens");
  }
  // Column layers gather their input's tokens where the outermost module receiving it holds
  // every op reading it (an attention reads its input's length before its q/k/v layers),
  // which must then all be those column layers; a layer called on it directly gathers inside.
  for (const auto& [n, role] : sequence_roles) {
    if (role != SequenceRole::Gather) continue;
    const int input = graph_.nodes[n].inputs.at(0);
    if (gather_entry.count(input)) continue;
    const int entry = find_entry(input);
    if (entry < 0) {
      // Gathered inside the column layers: only if no other module receives the tokens (one
      // with ops of its own could read their length, as Phi's attention does beside its MLP).
      for (const ModuleEntry& other : graph_.entries) {
        if (other.tensor == input && other.end > other.first) {
          conflict(sequence_region.at(n), other.module + " receives tokens that not all of its readers are inside");
        }
      }
      continue;
    }
    for (size_t m = 0; m < graph_.nodes.size(); ++m) {
      for (int id : graph_.nodes[m].inputs) {
        const auto it = sequence_roles.find(static_cast<int>(m));
        if (id == input && (it == sequence_roles.end() || it->second != SequenceRole::Gather)) {
          conflict(sequence_region.at(n), graph_.entries[entry].module + " receives tokens that " +
                                              graph_.nodes[m].label + " reads besides its column layers");
        }
      }
    }
    gather_entry[input] = entry;
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
  const bool called_again = node.kind == Kind::Linear && called_again_.count(node.weight_param) > 0;
  if (x.sequence) {
    if (called_again) {
      conflict(x.region, "its tokens reach " + node.label + ", a layer called more than once");
    } else if ((role == Style::Column || role == Style::ColumnGather) && node.kind == Kind::Linear) {
      sequence_roles[n] = SequenceRole::Gather;
      sequence_axis[n] = x.factor.axis;
      sequence_region[n] = x.region;
    } else {
      conflict(x.region, "its tokens reach " + node.label + ", which does not start a tensor-parallel region");
    }
  }
  const int out = node.outputs.at(0);
  const auto& shape = graph_.tensor(out).shape;
  const bool starts = role == Style::Row && node.kind == Kind::Linear;
  if (!starts || called_again || refused.count(n) || shape.size() < 2) return;
  const int axis = token_axis(shape);
  if (shape[axis] < 1) return;
  const int region = new_region(shape[axis]);
  regions[region].sequence = true;
  set_sharded(out, {axis, 1, shape[axis]}, region);
  layouts[out].sequence = true;
  sequence_roles[n] = SequenceRole::ReduceScatter;
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
        if (a < 0 || shape(id)[a] == 1) {
          if (narrowed_parameter(id)) {
            return refuse(node.label + " reads a parameter cast to a narrower dtype: its partial gradients would "
                          "be rounded to that dtype on each rank before they are summed");
          }
          continue;
        }
        // A tensor held whole meets the tokens: cut where a module receives it, if one can.
        if (shape(id)[a] == x.factor.size && graph_.tensor(id).param < 0 && find_entry(id) >= 0) {
          wanted_entries[id] = a;
          continue;
        }
        return refuse(node.label + " combines its tokens with a tensor held whole that no module entry can cut");
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
      for (int64_t axis : node.axes) {
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
    case Kind::Norm: {  // over the features: per token, its weight read like any parameter
      if (!layouts[in].sequence) return refuse(node.label + " takes its tokens as a parameter");
      if (node.per_channel) return refuse(node.label + " takes its statistics over every token of the batch");
      if (x.factor.axis == static_cast<int>(shape(in).size()) - 1) return refuse(node.label + " mixes tokens");
      return mark(node.outputs.at(0), x.factor.axis);
    }
    case Kind::View: {
      const ReshapeResult r = map_reshape(shape(in), shape(node.outputs.at(0)), x.factor);
      if (!r.ok || r.factor.outer != 1 || r.factor.size != x.factor.size) {
        return refuse(node.label + " merges the token axis with another");
      }
      // One given sizes may be written with the global token count even where it keeps the
      // axis (GPT-2 views its final hidden states to the input's shape); those given none
      // (an alias, a view like another tensor, an added or dropped axis of one) cannot.
      if (!sizeless_view(node.label)) {
        return refuse(node.label + " reshapes the tokens (its sizes may hold the global token count)");
      }
      return mark(node.outputs.at(0), r.factor.axis);
    }
    case Kind::Permute: {
      for (size_t j = 0; j < node.permutation.size(); ++j) {
        if (node.permutation[j] == x.factor.axis) return mark(node.outputs.at(0), static_cast<int>(j));
      }
      return refuse(node.label + ": malformed permutation");
    }
    case Kind::Split: {
      if (node.dim == x.factor.axis) return refuse(node.label + " splits the token axis");
      for (int id : node.outputs) mark(id, node.drop_dim && node.dim < x.factor.axis ? x.factor.axis - 1 : x.factor.axis);
      return;
    }
    case Kind::Slice: {
      const int64_t dim = node.dim, start = node.start, stop = node.stop;
      const bool drop = node.drop_dim;
      if (dim == x.factor.axis) {
        if (start <= 0 && stop >= shape(in)[dim] && !drop) return mark(node.outputs.at(0), x.factor.axis);
        return refuse(node.label + " selects some tokens");
      }
      return mark(node.outputs.at(0), drop && dim < x.factor.axis ? x.factor.axis - 1 : x.factor.axis);
    }
    default:
      if (!node.length_read_by.empty()) return refuse(length_may_be_read(node.length_read_by));
      return refuse(node.label + " mixes tokens, or autoshard cannot follow the token axis through it");
  }
}

}  // namespace autoshard::plan
