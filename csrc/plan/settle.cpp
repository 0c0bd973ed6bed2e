// Settling the decisions: passes repeat, each forcing the layers whose regions cannot be
// split (replicated) or must end in a gather, until no decision changes. The reason code
// given to a forced layer (LayerDecision::reason) is one of reasons.cpp's table.
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>

#include "plan/emit.h"
#include "plan/propagation.h"
#include "plan/reasons.h"

namespace autoshard::plan {
namespace {

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

// The module a region's layers inside `module` have in common, as the Python layer names a
// region's module: their longest common dotted prefix, less a layer's own name.
std::string common_inside(const std::vector<std::string>& layers, const std::string& module) {
  std::vector<std::vector<std::string>> paths;
  for (const std::string& name : layers) {
    if (name.rfind(module + ".", 0) != 0) continue;
    std::vector<std::string> parts;
    std::stringstream in(name);
    for (std::string part; std::getline(in, part, '.');) parts.push_back(part);
    paths.push_back(parts);
  }
  if (paths.empty()) return "";
  std::vector<std::string> common = paths[0];
  bool whole_name = paths.size() == 1;
  for (const auto& p : paths) {
    size_t k = 0;
    while (k < common.size() && k < p.size() && common[k] == p[k]) ++k;
    common.resize(k);
  }
  for (const auto& p : paths) whole_name = whole_name || common.size() == p.size();
  if (whole_name && !common.empty()) common.pop_back();
  std::string joined;
  for (size_t k = 0; k < common.size(); ++k) joined += (k ? "." : "") + common[k];
  return joined;
}

std::string units_note(int64_t units, int64_t world) {
  std::ostringstream s;
  s << "only " << units << " whole unit(s) (heads) to split across " << world << " ranks";
  return s.str();
}

}  // namespace

Plan make_plan(const Graph& graph, int64_t world_size) {
  TORCH_CHECK_VALUE(world_size > 0, "[plan.world_size] plan: world_size must be a positive integer, got ", world_size);
  const size_t count = graph.nodes.size();
  std::vector<Force> forced(count, Force::None);
  std::vector<Why> why(count);
  const std::set<int> vocab = split_tables(graph);
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

  // The size a layer that cannot be paired is measured by: its weight's elements (every expert's
  // for an experts layer; in * out where the graph does not tell).
  auto weight_size = [](const Node& node) {
    return node.weight_elements > 0 || node.kind != Kind::Linear ? node.weight_elements
                                                                 : node.in_features * node.out_features;
  };
  // Which layers hold each parameter, and which parameters other ops read directly.
  std::map<int64_t, std::vector<int>> layers_of_param;
  std::set<int64_t> params_read_elsewhere;
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
  // The biases of layers whose weight the model multiplies itself and whose bias it adds
  // outside that product (Mamba's dt_proj): split with the layer as a parameter of its channels
  // (head_params.cpp) where every read of it meets them, or the layer stays whole (below).
  std::set<int64_t> functional_biases;
  for (const Node& node : graph.nodes) {
    if (is_layer(node) && node.functional && !node.functional_bias && node.bias_param >= 0) {
      functional_biases.insert(node.bias_param);
    }
  }

  // Head cuts (head_cuts.cpp): those in use, and those dropped because the scores they would
  // meet are not sharded after all (never asked for again, so the passes settle).
  // Likewise node cuts (an embedding's output, a tensor of one value), by node.
  std::map<int, AxisFactor> cuts, node_cuts;
  std::set<int> dropped_cuts, dropped_node_cuts;
  auto settle_kind = [&](Propagation& pass, const std::map<int, int>& in_use, const std::map<int, AxisFactor>& wanted,
                         std::map<int, AxisFactor>& kept, std::set<int>& dropped) {
    bool changed = false;
    for (const auto& [key, region] : in_use) {
      const int root = pass.find(region);
      bool meets_layer = false;
      for (size_t n = 0; n < count; ++n) {
        meets_layer = meets_layer || (pass.roles[n] == Style::Column && pass.find(pass.node_region[n]) == root);
      }
      // A bias is cut where the attention holding the region's layers receives it: there its
      // module's attributes are made local from inputs given at their local shapes.
      bool at_attention = true;
      if (&in_use == &pass.cut_region) {
        std::vector<std::string> names;
        for (size_t n = 0; n < count; ++n) {
          const Style role = pass.roles[n];
          if ((role == Style::Column || role == Style::Row) && pass.find(pass.node_region[n]) == root) {
            names.push_back(graph.nodes[n].label);
          }
        }
        const std::string& module = graph.entries.at(key).module;
        at_attention = common_inside(names, module) == module;
      }
      if (pass.regions[root].conflict || !meets_layer || !at_attention) {
        kept.erase(key);
        dropped.insert(key);
        changed = true;
      }
    }
    for (const auto& [key, factor] : wanted) {
      if (!kept.count(key) && !dropped.count(key)) {
        kept[key] = factor;
        changed = true;
      }
    }
    return changed;
  };
  auto settle_cuts = [&](Propagation& pass) {
    const bool entries_changed = settle_kind(pass, pass.cut_region, pass.wanted_cuts, cuts, dropped_cuts);
    return settle_kind(pass, pass.node_cut_region, pass.wanted_node_cuts, node_cuts, dropped_node_cuts) ||
           entries_changed;
  };

  // Head parameters (head_params.cpp): those split, and those dropped with why. A split is
  // dropped when the heads' region it joins cannot be split after all (the parameter is also
  // read where it must stay whole, or the region conflicts elsewhere), meets no split layer, or
  // holds KV heads that several ranks share.
  std::map<int, AxisFactor> head_params;
  std::map<int, int> head_param_sources;
  std::map<int, std::string> dropped_head_params;
  auto settle_head_params = [&](Propagation& pass) {
    bool changed = false;
    for (const auto& [tensor, region] : pass.head_param_region) {
      const int root = pass.find(region);
      bool meets_layer = false;
      for (size_t n = 0; n < count; ++n) {
        meets_layer = meets_layer || (pass.roles[n] == Style::Column && pass.find(pass.node_region[n]) == root);
      }
      std::string why;
      if (pass.regions[root].conflict) {
        why = "with it split, " + pass.regions[root].reason;
      } else if (!meets_layer) {
        why = "the heads it meets are not split by any layer";
      } else if (pass.kv_fine.count(root)) {
        why = "its heads are KV heads that several ranks hold";
      }
      if (!why.empty()) {
        head_params.erase(tensor);
        dropped_head_params[tensor] = why;
        changed = true;
      }
    }
    for (const auto& [tensor, factor] : pass.wanted_head_params) {
      if (!head_params.count(tensor) && !dropped_head_params.count(tensor)) {
        head_params[tensor] = factor;
        head_param_sources[tensor] = pass.wanted_head_param_sources.at(tensor);
        changed = true;
      }
    }
    return changed;
  };

  // Layers forced to WholeSmallParts, with their parts as found when forced.
  std::map<int, std::vector<int64_t>> known_parts;
  auto force = [&](int n, Force f, Why w) {
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
  };

  // A pass forward with every decision taken so far: forces, cuts, head parameters.
  auto run_pass = [&]() {
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
  };

  for (size_t iteration = 0;; ++iteration) {
    TORCH_CHECK(iteration <= 2 * count + 1, "[plan.unsettled] plan: decisions did not settle");
    Propagation pass = run_pass();
    pass.settle_gradients();
    // A pass that found new cuts (or dropped some) saw bias tensors held whole that the next one
    // cuts: its conflicts and partial gradients are not the model's, so nothing is forced on them.
    // Likewise parameters split with their heads.
    const bool params_changed = settle_head_params(pass);
    if (settle_cuts(pass) || params_changed) continue;
    // A layer called several times (ALBERT's one layer, run by every block) is a row layer where
    // a column layer feeds it and a column layer where its input is whole: the layers feeding
    // its row call are replicated, so that every call splits the weight as a column layer. Only
    // the first such call in the graph is settled per pass: later ones may follow from it.
    bool changed = false;
    for (size_t n = 0; n < count && !changed; ++n) {
      if (pass.roles[n] != Style::Row) continue;
      bool column_elsewhere = false;
      for (int other : layers_of_param[graph.nodes[n].weight_param]) {
        column_elsewhere = column_elsewhere || pass.roles[other] == Style::Column;
      }
      if (!column_elsewhere) continue;
      // The column layer whose region the row call reads, before the pass united it with others
      // (a region it meets only because of this very mismatch).
      const int fed_by = pass.node_region[n];
      for (size_t m = 0; m < count; ++m) {
        if (pass.roles[m] != Style::Column || pass.node_region[m] != fed_by) continue;
        changed |= force(static_cast<int>(m), Force::Replicate,
                         {"feeds_called_layer", "replicated: it feeds a layer called elsewhere as a column layer (" +
                                               graph.nodes[n].label + ")"});
      }
    }
    if (changed) continue;
    // A fused layer whose parts differ (query heads beside one KV head) and whose region cannot
    // be split whole is tried once with its smaller parts held whole on every rank, before
    // anything else is forced: what else conflicts now may follow from its split parts.
    for (size_t n = 0; n < count; ++n) {
      const int node = static_cast<int>(n);
      const auto fused = pass.parts.find(node);
      if (pass.roles[n] != Style::Column || fused == pass.parts.end() || graph.nodes[n].kind != Kind::Linear ||
          forced[node] != Force::None) {
        continue;
      }
      const Region& region = pass.regions[pass.find(pass.node_region[n])];
      const bool unequal = std::adjacent_find(fused->second.begin(), fused->second.end(),
                                              std::not_equal_to<int64_t>()) != fused->second.end();
      if (!unequal || !(region.conflict || region.units < world_size)) continue;
      known_parts[node] = fused->second;
      changed |= force(node, Force::WholeSmallParts,
                       {"small_parts_whole", "split by heads; its smaller parts (KV heads) are held whole on every "
                                             "rank, their gradient summed"});
    }
    if (changed) {
      // The cuts its split parts met were judged against a pass where every part was split:
      // they may be asked for again (once per such layer, so the passes still settle).
      dropped_cuts.clear();
      dropped_node_cuts.clear();
      continue;
    }
    // A row layer of a region replicated now reads a whole input in the next pass: it becomes
    // a column layer, and what the layers after it saw in this pass (a column layer reading its
    // all-reduced output, say) may not hold then. Column layers after the first such layer are
    // judged again in the next pass instead (RemBERT's projection into its first block).
    auto decided_by = [&](int root) -> Region& {
      const auto kv = pass.kv_fine.find(root);  // KV heads replicated where needed: the query heads decide
      return pass.regions[kv == pass.kv_fine.end() ? root : kv->second];
    };
    // A convolution split as a column layer alone in its region, over an input no gradient
    // flows to (a patch or feature embedding over pixels or audio), whose output must be whole:
    // split on its output channels and gathered, one all-gather in forward and no collective in
    // backward, instead of held whole on every rank. Linear layers over such inputs stay whole:
    // an attention's projections would each pay an all-gather, a trade left to `overrides`.
    auto gathers_alone = [&](int node) {
      const Node& layer = graph.nodes[node];
      if (!layer.convolution || forced[node] != Force::None || pass.roles[node] != Style::Column ||
          pass.carries_grad(layer.inputs.at(0))) {
        return false;
      }
      if (std::any_of(layer.letters.begin(), layer.letters.end(),
                      [](const EinsumLetter& l) { return l.role == EinsumLetter::Batch && l.size > 0; })) {
        return false;  // a grouped convolution splits only with its input
      }
      const int root = pass.find(pass.node_region[node]);
      if (pass.kv_fine.count(root)) return false;
      for (size_t m = 0; m < count; ++m) {
        if (static_cast<int>(m) != node && is_layer(graph.nodes[m]) && pass.roles[m] != Style::Replicate &&
            pass.find(pass.node_region[m]) == root) {
          return false;
        }
      }
      return true;
    };
    // With gather_unpaired (asked for where the fewest collectives leave a rank much more than
    // its share: python/autoshard/plan/__init__.py), a layer that cannot be paired (its output
    // must be whole) and whose weight holds at least that many elements is split on its output
    // features and gathered, as Megatron's gather_output does, rather than held whole on every
    // rank: one all-gather in forward and one all-reduce of its input's gradient in backward.
    // Smaller layers (a router, a gate of a few features) stay whole: their gather would cost a
    // collective for little memory.
    auto gathers_unpaired = [&](int node) {
      const Node& layer = graph.nodes[node];
      if (graph.gather_unpaired <= 0 || layer.kind == Kind::Embedding || forced[node] != Force::None ||
          pass.roles[node] != Style::Column) {
        return false;
      }
      if (std::any_of(layer.letters.begin(), layer.letters.end(),
                      [](const EinsumLetter& l) { return l.role == EinsumLetter::Batch && l.size > 0; })) {
        return false;  // a grouped convolution splits only with its input
      }
      if (pass.kv_fine.count(pass.find(pass.node_region[node])) || pass.parts.count(node)) return false;
      return weight_size(layer) >= graph.gather_unpaired;
    };
    size_t flip = count;
    for (size_t n = 0; n < count && flip == count; ++n) {
      if (pass.roles[n] != Style::Row && pass.roles[n] != Style::Batch) continue;
      const Region& region = decided_by(pass.find(pass.node_region[n]));
      if (region.conflict || region.units < world_size) flip = n;
    }
    for (size_t n = 0; n < count; ++n) {
      const Style role = pass.roles[n];
      if (role != Style::Column && role != Style::Vocab) continue;
      if (n > flip) continue;  // its region may be united with one replicated now: judged next pass
      Region& region = decided_by(pass.find(pass.node_region[n]));
      const int node = static_cast<int>(n);
      if (region.conflict && gathers_alone(node)) {
        changed |= force(node, Force::Gather,
                         {"gathered_alone", "gathered: its output " + region.reason + "; its input carries no gradient"});
      } else if (region.conflict && gathers_unpaired(node)) {
        changed |= force(node, Force::Gather, {"gathered_unpaired", "gathered: its output " + region.reason});
      } else if (region.conflict) {
        changed |= force(node, Force::Replicate, {"conflict", "replicated: its output " + region.reason});
      } else if (region.units < world_size) {
        changed |= force(node, Force::Replicate,
                         {"too_few_units", "replicated: " + units_note(region.units, world_size), region.units});
      } else if (region.reaches_output && forced[node] == Force::WholeSmallParts) {
        changed |= force(node, Force::Replicate, {"model_output", "replicated: its output is a model output"});
      } else if (region.reaches_output) {
        changed |= force(node, Force::Gather, {"model_output", "gathered: its output is a model output"});
      }
    }
    // Regions forced just now change what the layers sharing a weight see in the next pass (a
    // layer fed by a column layer that is now replicated becomes a column layer itself): the
    // shared weights are judged once the regions are settled, or ALBERT's one layer, called by
    // every block, would be replicated for what its first call saw.
    if (changed) continue;
    // A parameter shared by several layers (tied embeddings) is sharded only if every layer
    // shards it on the same dimension into the same pieces: a token table and a column layer
    // over the vocabulary. A parameter read outside its layers stays whole.
    for (const auto& [param, layers] : layers_of_param) {
      bool agree = !params_read_elsewhere.count(param) || functional_biases.count(param);
      std::set<int64_t> units;
      size_t rows = 0, batches = 0;
      for (int n : layers) {
        const Style role = pass.roles[n];
        if (role == Style::Replicate) agree = agree && layers.size() == 1;
        // A layer called several times as a row layer (ALBERT's shared layer) splits its weight
        // alike in every call when its regions have the same units.
        if (role == Style::Row) {
          ++rows;
          units.insert(pass.regions[pass.find(pass.node_region[n])].units);
        }
        if (role == Style::Vocab) units.insert(graph.nodes[n].num_embeddings);
        if (role == Style::Batch) {
          ++batches;  // split with its input, as a row layer is: alike only if every call is
          units.insert(pass.regions[pass.find(pass.node_region[n])].units);
        }
        if (role == Style::Column || role == Style::ColumnGather) {
          units.insert(pass.regions[pass.find(pass.node_region[n])].units);
          agree = agree && (layers.size() == 1 || !pass.parts.count(n));
        }
      }
      agree = agree && units.size() <= 1 && (rows == 0 || rows == layers.size()) &&
              (batches == 0 || batches == layers.size());
      if (agree) continue;
      const bool elsewhere = params_read_elsewhere.count(param) > 0;
      for (int n : layers) {
        changed |= force(n, Force::Replicate,
                         elsewhere ? Why{"weight_read_elsewhere", "replicated: its weight is also read outside the layer"}
                                   : Why{"weight_shared", "replicated: it shares its weight with a layer split differently"});
      }
    }
    // Layers that split only together: a column layer then a row layer, or both whole.
    for (const auto& [first, second] : graph.together) {
      const Style a = pass.roles[first], b = pass.roles[second];
      if ((a == Style::Column && b == Style::Row) || (a == Style::Replicate && b == Style::Replicate)) continue;
      const Why unpaired{"attention_unpaired", "replicated: " + graph.nodes[first].label + " and " +
                                                   graph.nodes[second].label + " split only together, by heads "
                                                   "(column, then row), which this model's dataflow does not allow"};
      changed |= force(first, Force::Replicate, unpaired);
      changed |= force(second, Force::Replicate, unpaired);
    }
    // A layer whose weight the model multiplies itself is exact only as a column layer: its
    // local rows give this rank's channels. As a row layer (its input split) the sum over the
    // ranks its call would take never runs. Its bias, added by the model apart, must be split
    // with those channels wherever it is read.
    for (size_t n = 0; n < count; ++n) {
      const Node& node = graph.nodes[n];
      if (!is_layer(node) || !node.functional) continue;
      const Style role = pass.roles[n];
      const int layer = static_cast<int>(n);
      if (role != Style::Column && role != Style::Replicate) {
        changed |= force(layer, Force::Replicate,
                         {"functional_layer", "replicated: the model multiplies its weight itself, so it is split "
                                              "only as a column layer, and its input is split"});
      } else if (role == Style::Column && functional_biases.count(node.bias_param)) {
        for (size_t t = 0; t < graph.tensors.size(); ++t) {
          if (graph.tensors[t].param != node.bias_param || head_params.count(static_cast<int>(t))) continue;
          changed |= force(layer, Force::Replicate,
                           {"functional_layer", "replicated: the model multiplies its weight itself and adds its "
                                                "bias apart, which is read where it cannot be split with the "
                                                "layer's channels"});
        }
      }
    }
    if (!changed) {
      if (!graph.sequence_parallel || world_size == 1) return emit_plan(graph, pass, why, world_size);
      break;
    }
  }
  // Sequence parallelism over the settled roles: a region refused (see sequence.cpp) refuses
  // the layers that start it, and the passes repeat until none is refused anew.
  std::set<int> refused;
  std::map<int, std::string> refusals;
  std::map<int, int> entries;
  for (size_t round = 0;; ++round) {
    TORCH_CHECK(round <= 2 * (count + graph.tensors.size()) + 2, "[plan.unsettled] plan: sequence parallelism did not settle");
    Propagation pass = run_pass();
    pass.run_sequence(refused, entries);
    pass.settle_gradients();
    // The settled passes asked for every cut they rely on (a bias let through uncut would be wrong).
    for (const auto& [entry, factor] : pass.wanted_cuts) {
      TORCH_CHECK(cuts.count(entry), "[plan.unsettled] plan: a head cut was asked for after the cuts settled");
    }
    for (const auto& [node, factor] : pass.wanted_node_cuts) {
      TORCH_CHECK(node_cuts.count(node), "[plan.unsettled] plan: a head cut was asked for after the cuts settled");
    }
    for (const auto& [tensor, factor] : pass.wanted_head_params) {
      TORCH_CHECK(head_params.count(tensor), "[plan.unsettled] plan: a head parameter was asked for after they settled");
    }
    bool more = false;
    for (const auto& [tensor, axis] : pass.wanted_entries) more |= entries.emplace(tensor, axis).second;
    if (more) continue;
    for (const auto& [tensor, entry] : pass.entry_of) {
      if (pass.regions[pass.find(pass.layouts[tensor].region)].conflict) {
        entries.erase(tensor);
        more = true;
      }
    }
    for (const auto& [n, role] : pass.sequence_roles) {
      if (role == SequenceRole::Gather || refused.count(n)) continue;
      const Region& region = pass.regions[pass.find(pass.sequence_region.at(n))];
      if (region.conflict) {
        refused.insert(n);
        refusals[n] = region.reason;
        more = true;
      }
    }
    if (!more) return emit_plan(graph, pass, why, world_size, refusals);
  }
}

}  // namespace autoshard::plan
