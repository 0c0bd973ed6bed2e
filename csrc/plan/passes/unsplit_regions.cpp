// The column layers (and vocabulary-parallel embeddings) starting a region that cannot be split
// (it conflicts, or has fewer units than ranks) are replicated, or split and gathered where that
// costs less than holding them whole; those reaching a model output gather there.
//
// A row layer of a region replicated now reads a whole input in the next pass: it becomes a
// column layer, and what the layers after it saw in this pass (a column layer reading its
// all-reduced output, say) may not hold then. Column layers after the first such layer are
// judged again in the next pass instead (RemBERT's projection into its first block).
#include <algorithm>
#include <sstream>
#include <string>

#include "plan/passes/settling.h"

namespace autoshard::plan {
namespace {

// A layer that cannot be paired is worth gathering only for the memory its weight takes.
//
// Its weight's elements (every expert's for an experts layer; in * out where the graph does not
// tell).
int64_t weight_size(const Node& node) {
  return node.weight_elements > 0 || node.kind != Kind::Linear ? node.weight_elements
                                                               : node.in_features * node.out_features;
}

// A grouped convolution splits only with its input, so it can never be split and gathered alone.
bool is_grouped(const Node& layer) {
  return std::any_of(layer.letters.begin(), layer.letters.end(),
                     [](const EinsumLetter& l) { return l.role == EinsumLetter::Batch && l.size > 0; });
}

// KV heads are replicated where needed, so the query heads they feed decide whether they split.
Region& decided_by(Propagation& pass, int root) {
  const auto kv = pass.kv_fine.find(root);
  return pass.regions[kv == pass.kv_fine.end() ? root : kv->second];
}

// Gathering costs one all-gather in forward and none in backward only where no gradient flows
// to the input.
//
// A convolution split as a column layer alone in its region, over an input no gradient flows
// to (a patch or feature embedding over pixels or audio), whose output must be whole: split on
// its output channels and gathered, instead of held whole on every rank. Linear layers over
// such inputs stay whole: an attention's projections would each pay an all-gather, a trade left
// to `overrides`.
bool gathers_alone(const Settling& state, Propagation& pass, int node) {
  const Node& layer = state.graph.nodes[node];
  if (!layer.convolution || state.forced[node] != Force::None || pass.roles[node] != Style::Column ||
      pass.carries_grad(layer.inputs.at(0))) {
    return false;
  }
  if (is_grouped(layer)) return false;
  const int root = pass.find(pass.node_region[node]);
  if (pass.kv_fine.count(root)) return false;
  for (size_t m = 0; m < state.count; ++m) {
    if (static_cast<int>(m) != node && is_layer(state.graph.nodes[m]) && pass.roles[m] != Style::Replicate &&
        pass.find(pass.node_region[m]) == root) {
      return false;
    }
  }
  return true;
}

// Where the fewest collectives leave a rank much more than its share, a large layer is worth a
// gather in forward and an all-reduce in backward.
//
// With gather_unpaired (asked for in python/autoshard/plan/__init__.py), a layer that cannot be
// paired (its output must be whole) and whose weight holds at least that many elements is split
// on its output features and gathered, as Megatron's gather_output does, rather than held whole
// on every rank. Smaller layers (a router, a gate of a few features) stay whole: their gather
// would cost a collective for little memory.
bool gathers_unpaired(const Settling& state, Propagation& pass, int node) {
  const Node& layer = state.graph.nodes[node];
  if (state.graph.gather_unpaired <= 0 || layer.kind == Kind::Embedding || state.forced[node] != Force::None ||
      pass.roles[node] != Style::Column) {
    return false;
  }
  if (is_grouped(layer)) return false;
  if (pass.kv_fine.count(pass.find(pass.node_region[node])) || pass.parts.count(node)) return false;
  return weight_size(layer) >= state.graph.gather_unpaired;
}

// A replicated layer says how far its units fall short, so that a reader can pick a world size.
std::string units_note(int64_t units, int64_t world) {
  std::ostringstream s;
  s << "only " << units << " whole unit(s) (heads) to split across " << world << " ranks";
  return s.str();
}

}  // namespace

bool force_unsplit_regions(Settling& state, Propagation& pass) {
  const size_t count = state.count;
  const int64_t world_size = state.world_size;
  size_t flip = count;
  for (size_t n = 0; n < count && flip == count; ++n) {
    if (pass.roles[n] != Style::Row && pass.roles[n] != Style::Batch) continue;
    const Region& region = decided_by(pass, pass.find(pass.node_region[n]));
    if (region.conflict || region.units < world_size) flip = n;
  }
  bool changed = false;
  for (size_t n = 0; n < count; ++n) {
    const Style role = pass.roles[n];
    if (role != Style::Column && role != Style::Vocab) continue;
    if (n > flip) continue;  // its region may be united with one replicated now: judged next pass
    Region& region = decided_by(pass, pass.find(pass.node_region[n]));
    const int node = static_cast<int>(n);
    if (region.conflict && gathers_alone(state, pass, node)) {
      changed |= state.force(node, Force::Gather,
                             {"gathered_alone", "gathered: its output " + region.reason + "; its input carries no gradient"});
    } else if (region.conflict && gathers_unpaired(state, pass, node)) {
      changed |= state.force(node, Force::Gather, {"gathered_unpaired", "gathered: its output " + region.reason});
    } else if (region.conflict) {
      changed |= state.force(node, Force::Replicate, {"conflict", "replicated: its output " + region.reason});
    } else if (region.units < world_size) {
      changed |= state.force(node, Force::Replicate,
                             {"too_few_units", "replicated: " + units_note(region.units, world_size), region.units});
    } else if (region.reaches_output && state.forced[node] == Force::WholeSmallParts) {
      changed |= state.force(node, Force::Replicate, {"model_output", "replicated: its output is a model output"});
    } else if (region.reaches_output) {
      changed |= state.force(node, Force::Gather, {"model_output", "gathered: its output is a model output"});
    }
  }
  return changed;
}

}  // namespace autoshard::plan
