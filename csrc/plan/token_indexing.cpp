// Ops that index the token axis after a sequence region: the tokens are gathered before them.
//
// A causal LM's head reads the last tokens of the final hidden states (transformers'
// hidden_states[:, slice_indices, :], logits_to_keep). Planned with every token kept, that
// indexing is recorded as an alias (or a slice covering the whole axis), which a sequence
// region passes (sequence.cpp). Called with logits_to_keep=1, as generate calls it, the same
// line picks the last token of this rank's piece instead of the sequence's, and the column
// layer's gather meets a piece of the wrong length, or the wrong tokens. An op indexing the
// token axis may select other tokens in another call, so it must see every token: the column
// layers reading tokens through such ops get them gathered where the module computing them
// returns them (a forward hook on its output, e.g. the final norm's), and the ops in between
// run on whole tokens. That gather is the one the column layers made, of the same tensor (the
// ops keep every token on the planned inputs), so the collectives stay as the plan counted
// them; its backward is the same reduce-scatter, summing the column layers' partial input
// gradients.
//
// Where no module returns that tensor, or something else reads it, there is no such place, and
// the graph is planned again without sequence parallelism (replan.cpp), which the row layers'
// notes say.
#include <algorithm>
#include <map>
#include <set>

#include "plan/constructs/sequence_cuts.h"
#include "plan/reasons.h"
#include "plan/sequence_rules.h"

namespace autoshard::plan {
namespace {

bool is_alias(const std::string& label) {
  const std::string alias = "aten.alias";
  return label == alias || label.rfind(alias + ".", 0) == 0;
}

// Whether `node`, reading a tensor split on its tokens (`layout`), indexes the token axis: an
// alias is what Python indexing that kept everything records (x[:, 0:, :]).
bool indexes_tokens(const Node& node, const TensorLayout* layout) {
  if (layout == nullptr || !layout->sequence) return false;
  if (node.kind == Kind::View && is_alias(node.label)) return true;
  return node.kind == Kind::Slice && node.dim == layout->axis;
}

// The smallest module call returning `tensor` that ends by node `before`; the first of equals.
const ModuleExit* innermost_exit(const Graph& graph, int tensor, int before) {
  const ModuleExit* best = nullptr;
  for (const ModuleExit& exit : graph.exits) {
    if (exit.end < exit.first || exit.end > before || exit.tensor != tensor) continue;
    if (best == nullptr || exit.end - exit.first < best->end - best->first) best = &exit;
  }
  return best;
}

}  // namespace

std::optional<std::string> gather_before_token_indexing(const Graph& graph, Plan& plan) {
  std::map<int, const TensorLayout*> layouts;
  for (const TensorLayout& layout : plan.tensors) layouts[layout.tensor] = &layout;
  const auto layout_of = [&](int tensor) -> const TensorLayout* {
    const auto it = layouts.find(tensor);
    return it == layouts.end() ? nullptr : it->second;
  };
  std::map<int, int> producer;
  std::map<int, std::vector<int>> readers;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    for (int id : graph.nodes[n].outputs) producer[id] = static_cast<int>(n);
    for (int id : graph.nodes[n].inputs) readers[id].push_back(static_cast<int>(n));
  }
  std::map<int, LayerDecision*> gathering;  // column layers gathering their input's tokens
  for (LayerDecision& d : plan.layers) {
    if (d.sequence == "gather") gathering[d.node] = &d;
  }
  // The tensor of the region each indexing chain starts from, with the chains' ops, in the
  // order the column layers reading them come.
  std::vector<std::pair<int, std::vector<int>>> chains;
  for (const auto& [n, decision] : gathering) {
    int tensor = graph.nodes[n].inputs.at(0);
    std::vector<int> chain;
    for (auto it = producer.find(tensor); it != producer.end(); it = producer.find(tensor)) {
      const Node& op = graph.nodes[it->second];
      if (op.inputs.empty() || !indexes_tokens(op, layout_of(op.inputs[0]))) break;
      chain.push_back(it->second);
      tensor = op.inputs[0];
    }
    if (chain.empty()) continue;
    auto known = std::find_if(chains.begin(), chains.end(), [&](const auto& c) { return c.first == tensor; });
    if (known == chains.end()) known = chains.emplace(chains.end(), tensor, std::vector<int>{});
    known->second.insert(known->second.end(), chain.begin(), chain.end());
  }
  std::vector<Record> exits;
  std::set<int> whole, gathered;
  for (const auto& [source, ops] : chains) {
    const int first_op = *std::min_element(ops.begin(), ops.end());
    const std::string& indexing = graph.nodes[first_op].label;
    const ModuleExit* where = innermost_exit(graph, source, first_op);
    if (where == nullptr) return indexed_tokens_without_exit(indexing);
    // After the gather the tokens are whole: every reader must be one of these ops or a column
    // layer that would have gathered them.
    std::vector<int> held = {source};
    for (int op : ops) held.push_back(graph.nodes[op].outputs.at(0));
    std::set<int> layers;
    for (int tensor : held) {
      if (graph.tensor(tensor).is_output) return indexed_tokens_reach_output(indexing);
      for (int reader : readers[tensor]) {
        const bool indexing_op = std::find(ops.begin(), ops.end(), reader) != ops.end();
        if (!indexing_op && !gathering.count(reader)) {
          return indexed_tokens_read_elsewhere(where->module, graph.nodes[reader].label, indexing);
        }
        if (gathering.count(reader)) layers.insert(reader);
      }
    }
    whole.insert(held.begin() + 1, held.end());
    gathered.insert(layers.begin(), layers.end());
    exits.push_back(sequence_cut(source, where->module, where->leaf, layout_of(source)->axis,
                                 gathering.at(*layers.begin())->sequence_region));
  }
  for (int n : gathered) gathering.at(n)->sequence = "gathered";
  plan.tensors.erase(std::remove_if(plan.tensors.begin(), plan.tensors.end(),
                                    [&](const TensorLayout& t) { return whole.count(t.tensor) > 0; }),
                     plan.tensors.end());
  plan.records[kSequenceExits] = std::move(exits);
  return std::nullopt;
}

}  // namespace autoshard::plan
