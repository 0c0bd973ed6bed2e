// The planning state before the first pass: the embeddings split by their rows, the overrides,
// the layers the model was seen to compute otherwise with split, and which layers and ops read
// each parameter.
#include "plan/passes/settling.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

#include "plan/reasons.h"

namespace autoshard::plan {
namespace {

// Held whole, the largest tables would leave every rank the bulk of the model's parameters.
//
// The largest embedding tables are the token tables, split by their rows. Position and type
// tables stay replicated, unless the graph asks for unpaired layers to be gathered (where the
// fewest collectives leave a rank far more than its share): then a table added to the token
// embeddings (as wide as the token table) whose weight holds at least graph.gather_unpaired
// elements (BERT's or OPT's learned positions in a small model) is split by its rows too, for
// one more all-reduce of its output in forward and none in backward.
std::set<int> split_tables(const Graph& graph) {
  int64_t largest = 0;
  for (const Node& node : graph.nodes) {
    if (node.kind == Kind::Embedding) largest = std::max(largest, node.num_embeddings);
  }
  std::set<int64_t> token_widths;
  for (const Node& node : graph.nodes) {
    if (node.kind == Kind::Embedding && node.num_embeddings == largest) token_widths.insert(node.embedding_dim);
  }
  std::set<int> chosen;
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (node.kind != Kind::Embedding) continue;
    const bool large_table = graph.gather_unpaired > 0 && token_widths.count(node.embedding_dim) &&
                             node.num_embeddings * node.embedding_dim >= graph.gather_unpaired;
    if (node.num_embeddings == largest || large_table) chosen.insert(static_cast<int>(n));
  }
  return chosen;
}

}  // namespace

Settling::Settling(const Graph& graph, int64_t world_size)
    : graph(graph), world_size(world_size), count(graph.nodes.size()), forced(count, Force::None), why(count),
      vocab(split_tables(graph)) {
  int64_t token_rows = 0;
  for (int n : vocab) token_rows = std::max(token_rows, graph.nodes[n].num_embeddings);
  for (int n : vocab) {
    if (graph.nodes[n].num_embeddings < token_rows) {
      why[n] = {"split_table", "split by rows: held whole, it would leave a rank far more than its share"};
    }
  }
  for (const auto& [node, style] : graph.forced) {
    TORCH_CHECK_VALUE(node >= 0 && static_cast<size_t>(node) < count && is_layer(graph.nodes[node]),
                      "[plan.override_not_layer] plan: override names node ", node, ", which is not a layer");
    const bool replicate = style == "replicate";
    forced[node] = replicate ? Force::Replicate : Force::Gather;
    why[node] = replicate ? Why{"override_replicate", "replicated: by override"}
                          : Why{"override_gather", "gathered: by override"};
  }
  // Held whole from the start, whatever else asked: the model computed otherwise with it split.
  for (const Graph::Observation& seen : graph.observations) {
    TORCH_CHECK_VALUE(seen.node >= 0 && static_cast<size_t>(seen.node) < count && is_layer(graph.nodes[seen.node]),
                      "[plan.bad_graph] plan: an observation names node ", seen.node, ", which is not a layer");
    const std::string prefix = "plan: ";
    const bool prefixed = seen.detail.compare(0, prefix.size(), prefix) == 0;
    forced[seen.node] = Force::Replicate;
    why[seen.node] = {seen.kind, "replicated: " + (prefixed ? seen.detail.substr(prefix.size()) : seen.detail)};
  }
  for (size_t n = 0; n < count; ++n) {
    const Node& node = graph.nodes[n];
    if (is_layer(node)) {
      layers_of_param[node.weight_param].push_back(static_cast<int>(n));
      if (node.bias_param >= 0) layers_of_param[node.bias_param].push_back(static_cast<int>(n));
    } else {
      for (int id : node.inputs) {
        if (graph.tensor(id).param >= 0) params_read_elsewhere.insert(graph.tensor(id).param);
      }
    }
  }
  for (const Node& node : graph.nodes) {
    if (is_layer(node) && node.functional && !node.functional_bias && node.bias_param >= 0) {
      functional_biases.insert(node.bias_param);
    }
  }
}

bool Settling::force(int n, Force f, Why w) {
  if (graph.nodes[n].functional && f != Force::Replicate) {
    // Gathered, or with parts held whole, its split would need its call, which never runs.
    f = Force::Replicate;
    w = Why{"functional_layer", "replicated: the model multiplies its weight itself, so it is split only as a "
                                "column layer (" + w.note + ")"};
  }
  reason_text(w.reason);  // every code has its words in reasons.cpp
  if (forced[n] == f || forced[n] == Force::Replicate) return false;
  forced[n] = f;
  why[n] = std::move(w);
  return true;
}

Propagation Settling::run_pass() const {
  Propagation pass(graph, forced);
  pass.known_parts = known_parts;
  pass.dropped_cuts = dropped_cuts;
  pass.dropped_node_cuts = dropped_node_cuts;
  pass.head_params = head_params;
  pass.head_param_sources = head_param_sources;
  pass.dropped_head_params = dropped_head_params;
  pass.run(vocab, cuts, node_cuts);
  pass.settle_links(world_size);
  return pass;
}

}  // namespace autoshard::plan
