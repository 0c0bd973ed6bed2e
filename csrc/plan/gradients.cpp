// The backward side of a pass: what each replicated tensor's gradient is on every rank.
//
// A sharded tensor's gradient is sharded alike, and a column layer's input copy sums its
// input's gradient over the ranks, so both are exact by construction. A replicated tensor
// read by an op whose output is sharded (a norm's weight applied to every head, a scale, a
// replicated weight multiplying each head) only receives, on each rank, the part of its
// gradient that comes from that rank's shard: a partial sum. Such a gradient stays partial
// backward through replicated ops, and a parameter that receives only partial gradients
// gets them summed over the ranks (the plan's partial-gradient all-reduce). A gradient that
// would be partly whole and partly partial (the parameter is also used outside the region,
// or the partial gradient reaches an activation) cannot be fixed by a sum: the regions that
// make it partial are replicated instead. The parts a fused layer holds whole (one KV head)
// are read by this rank's heads only: their rows' gradient is partial, summed over the ranks.
#include <set>

#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

struct GradState {
  bool whole = false;
  std::set<int> partial;  // regions whose shards make it partial
  // Column layers whose input copy sums this gradient: whole, unless a replicated layer upstream
  // sums it instead (then the copy sums nothing and their part is partial).
  std::set<int> copies;

  bool any() const { return whole || !partial.empty() || !copies.empty(); }
  void join(const GradState& other) {
    whole = whole || other.whole;
    partial.insert(other.partial.begin(), other.partial.end());
    copies.insert(other.copies.begin(), other.copies.end());
  }
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t size : shape) count *= size;
  return count;
}

}  // namespace

void Propagation::settle_gradients() {
  // A summed output whose deferred copies leave a partial gradient where a whole one is needed
  // (the copy's input read elsewhere too) is not summed after all, and the pass is made again:
  // its copies then sum as before, and only its own partial gradient is refused.
  std::set<int> unsummable;
  for (;;) {
    std::vector<std::pair<int, std::string>> refused;
    std::set<int> leaked;
    gradients_pass(unsummable, refused, leaked);
    if (leaked.empty()) {
      for (const auto& [region, why] : refused) conflict(region, why);
      return;
    }
    unsummable.insert(leaked.begin(), leaked.end());
  }
}

void Propagation::gradients_pass(const std::set<int>& unsummable, std::vector<std::pair<int, std::string>>& refused,
                                 std::set<int>& leaked) {
  const size_t tensor_count = graph_.tensors.size();
  // Which tensors carry a gradient at all: parameters and whatever is computed from one.
  std::vector<bool> needs_grad(tensor_count, false);
  for (size_t t = 0; t < tensor_count; ++t) needs_grad[t] = graph_.tensors[t].param >= 0;
  for (const Node& node : graph_.nodes) {
    bool any = is_layer(node);
    for (int id : node.inputs) any = any || needs_grad[id];
    if (any) {
      for (int id : node.outputs) needs_grad[id] = true;
    }
  }
  summed_outputs.clear();
  deferred_copies.clear();
  std::vector<GradState> grad(tensor_count);
  for (size_t t = 0; t < tensor_count; ++t) grad[t].whole = graph_.tensors[t].is_output;
  std::map<int64_t, GradState> param_grad;
  std::map<int64_t, int64_t> param_elements;
  // Fused layers with parts held whole: what the gradient of those parts is on every rank.
  std::map<int, GradState> whole_part_grad;
  auto refuse = [&](const GradState& state, const std::string& why) {
    for (int r : state.partial) refused.emplace_back(r, why);
  };
  std::map<int, int> deferred_by;  // deferred copy -> the summed output that took its sum over

  for (size_t i = graph_.nodes.size(); i-- > 0;) {
    const Node& node = graph_.nodes[i];
    GradState out;
    int sharded_region = -1;
    for (int id : node.outputs) {
      if (entry_of.count(id)) {
        // Cut to the tokens only where a module receives it: its gradient is gathered whole.
        GradState whole;
        whole.whole = needs_grad[id];
        out.join(whole);
      } else if (layouts[id].sharded) {
        sharded_region = find(layouts[id].region);
      } else if (needs_grad[id]) {
        out.join(grad[id]);
      }
    }
    if (is_layer(node)) {
      const Style role = roles[i];
      // A summed output: every reader of the layer's replicated output gives it a partial
      // gradient, or a whole one only through a column layer's input copy. The gradient is
      // summed once where the layer returns its output, and those copies sum nothing.
      auto sums_output = [&]() {
        return !out.partial.empty() && !out.whole && node.kind == Kind::Linear && !sequence_roles.count(i) &&
               node.outputs.size() == 1 && !unsummable.count(static_cast<int>(i));
      };
      auto sum_output = [&]() {
        summed_outputs[static_cast<int>(i)] = numel_of(graph_.tensor(node.outputs[0]).shape);
        for (int c : out.copies) {
          deferred_copies.insert(c);
          deferred_by[c] = static_cast<int>(i);
        }
      };
      if (role == Style::Column && node.functional) {
        // The model multiplies the layer's local rows itself: no input copy sums the input's
        // gradient, which is this rank's part, partial in the layer's region.
        GradState part;
        part.partial.insert(sharded_region);
        const int input = node.inputs.at(0);
        if (!layouts[input].sharded && needs_grad[input]) grad[input].join(part);
      } else if (role == Style::Column || role == Style::ColumnGather) {
        // The input copy sums the input's gradient over the ranks: whole again. A gathered
        // output's gradient is cut to this rank's piece, which must be whole to begin with.
        if (role == Style::ColumnGather) refuse(out, "gives a partial gradient to " + node.label + "'s output");
        GradState whole;
        const bool plain_copy = role == Style::Column && node.kind == Kind::Linear && !sequence_roles.count(i);
        if (plain_copy) {
          whole.copies.insert(static_cast<int>(i));
        } else {
          whole.whole = true;
        }
        grad[node.inputs.at(0)].join(whole);
      } else if (role == Style::Batch) {
        // Input, output and parameters split alike: each rank's gradients are its own
        // entries', whole, and its input's gradient stays split as its input is.
      } else if (role == Style::Row && sums_output()) {
        // Its output, all-reduced in forward, meets this rank's shards only (Mamba's x_proj,
        // whose B and C the rank's channels read): its gradient is summed in backward too.
        sum_output();
      } else if (role == Style::Row || role == Style::Vocab) {
        refuse(out, "gives a partial gradient to " + node.label + "'s output");
        // A row layer's bias added to this rank's tokens only: a partial gradient.
        const int64_t bias = node.bias_param;
        if (sharded_region >= 0 && node.kind == Kind::Linear && bias >= 0) {
          GradState state;
          state.partial.insert(sharded_region);
          param_grad[bias].join(state);
          param_elements[bias] = node.out_features;
        }
      } else if (sums_output()) {
        // A replicated layer whose output's gradient is summed: its input and weight then get
        // whole gradients.
        sum_output();
        GradState whole;
        whole.whole = true;
        for (int id : node.inputs) {
          if (!layouts[id].sharded) grad[id].join(whole);
        }
      } else {
        // A replicated layer passes its output's gradient on to its input and parameters; a
        // partial one would need its weights summed too, which the plan does not do.
        refuse(out, "gives a partial gradient to " + node.label + ", which is replicated");
        for (int id : node.inputs) {
          if (!layouts[id].sharded) grad[id].join(out);
        }
      }
      continue;
    }
    if ((node.kind == Kind::Split || node.kind == Kind::Slice) && layouts[node.inputs.at(0)].whole) {
      // The whole parts of a fused output: their gradient goes to the layer's whole rows.
      whole_part_grad[layouts[node.inputs.at(0)].source].join(out);
      continue;
    }
    // A norm split by heads holds this rank's part of its weight: a whole gradient.
    if (node.kind == Kind::Norm && split_norms.count(static_cast<int>(i))) continue;
    GradState contribution = out;
    if (sharded_region >= 0) {
      contribution = GradState{};
      contribution.partial.insert(sharded_region);
    }
    for (int id : node.inputs) {
      if (!layouts[id].sharded && needs_grad[id]) grad[id].join(contribution);
    }
  }

  // A column layer's copy is whole unless a summed output upstream takes its sum over: then the
  // gradient it passes is partial, in its region.
  auto settled = [&](GradState state) {
    for (int c : state.copies) {
      if (deferred_copies.count(c)) {
        state.partial.insert(find(node_region[c]));
      } else {
        state.whole = true;
      }
    }
    state.copies.clear();
    return state;
  };
  // What each gradient held before settling: the copies behind a refused partial gradient name
  // the summed outputs that leak.
  const std::vector<GradState> raw = grad;
  const std::map<int, GradState> raw_parts = whole_part_grad;
  std::map<int64_t, std::set<int>> param_copies;
  auto refuse_settled = [&](const std::set<int>& copies, const GradState& state, const std::string& why) {
    if (state.partial.empty()) return;
    for (int c : copies) {
      if (deferred_copies.count(c)) leaked.insert(deferred_by.at(c));
    }
    refuse(state, why);
  };
  for (GradState& state : grad) state = settled(state);
  for (auto& [layer, state] : whole_part_grad) state = settled(state);
  // A copy deferred for one summed output also leaves partial what it gave along other paths:
  // a layer other than a column one (and other than the summed ones) must still receive a whole
  // gradient on its output.
  if (!deferred_copies.empty()) {
    for (size_t i = 0; i < graph_.nodes.size(); ++i) {
      const Node& node = graph_.nodes[i];
      const Style role = roles[i];
      if (!is_layer(node) || role == Style::Column || role == Style::Batch || summed_outputs.count(static_cast<int>(i))) {
        continue;
      }
      for (int id : node.outputs) {
        if (!layouts[id].sharded && needs_grad[id]) {
          refuse_settled(raw[id].copies, grad[id], "gives a partial gradient to " + node.label + "'s output");
        }
      }
    }
  }
  for (size_t t = 0; t < tensor_count; ++t) {
    const GradState& state = grad[t];
    if (!needs_grad[t] || layouts[t].sharded || !state.any()) continue;
    const int64_t param = graph_.tensors[t].param;
    if (param >= 0) {
      param_grad[param].join(state);
      param_copies[param].insert(raw[t].copies.begin(), raw[t].copies.end());
      param_elements[param] = numel_of(graph_.tensors[t].shape);
    } else if (state.whole && !state.partial.empty()) {
      refuse_settled(raw[t].copies, state, "would make a gradient partly partial (a replicated activation meets its shards)");
    }
  }
  summed_parts.clear();
  for (const auto& [layer, state] : whole_part_grad) {
    if (state.partial.empty()) continue;
    if (state.whole) {
      refuse_settled(raw_parts.at(layer).copies, state, "would make the gradient of a fused layer's whole parts partly partial");
      continue;
    }
    const Node& node = graph_.nodes[layer];
    const int64_t whole = layouts[node.outputs.at(0)].whole;
    summed_parts[layer] = whole * node.in_features + (node.bias_param >= 0 ? whole : 0);
  }
  partial_params.clear();
  for (const auto& [param, state] : param_grad) {
    if (state.partial.empty()) continue;
    if (state.whole) {
      refuse_settled(param_copies[param], state,
                     "would make a parameter's gradient partly partial (it is also used outside the region)");
      continue;
    }
    partial_params[param] = param_elements.at(param);
  }
}

}  // namespace autoshard::plan
