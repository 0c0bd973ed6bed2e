#pragma once
// The state the planner settles its decisions in (settle.cpp's make_plan), and the passes that
// change it. Each pass reads the last Propagation and forces layers, or keeps or drops cuts and
// head parameters; it returns whether any decision changed, so that make_plan runs another
// Propagation before trying the passes after it.
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "plan/emit.h"
#include "plan/propagation.h"

namespace autoshard::plan {

struct Settling {
  Settling(const Graph& graph, int64_t world_size);
  // Every Propagation holds on to `forced`: the state stays where it was made.
  Settling(const Settling&) = delete;
  Settling& operator=(const Settling&) = delete;

  // Where the passes agree on a force, the first reason given stands; a layer replicated
  // stays replicated, so that the passes settle.
  bool force(int n, Force f, Why w);
  // Every Propagation sees every decision taken so far: forces, cuts, head parameters.
  Propagation run_pass() const;

  const Graph& graph;
  const int64_t world_size;
  const size_t count;  // nodes in the graph
  std::vector<Force> forced;
  std::vector<Why> why;
  std::set<int> vocab;  // the embeddings split by their rows (split_tables)

  // Which layers hold each parameter, and which parameters other ops read directly.
  std::map<int64_t, std::vector<int>> layers_of_param;
  std::set<int64_t> params_read_elsewhere;
  // The biases of layers whose weight the model multiplies itself and whose bias it adds
  // outside that product (Mamba's dt_proj): split with the layer as a parameter of its channels
  // (constructs/head_params.cpp) where every read of it meets them, or the layer stays whole.
  std::set<int64_t> functional_biases;

  // Head cuts (constructs/head_cuts.cpp): those in use, and those dropped because the scores they
  // would meet are not sharded after all (never asked for again, so the passes settle). Likewise
  // node cuts (an embedding's output, a tensor of one value), by node.
  std::map<int, AxisFactor> cuts, node_cuts;
  std::set<int> dropped_cuts, dropped_node_cuts;
  // Head parameters (constructs/head_params.cpp): those split (with the layer each meets), and
  // those dropped with why.
  std::map<int, AxisFactor> head_params;
  std::map<int, int> head_param_sources;
  std::map<int, std::string> dropped_head_params;
  // Layers forced to WholeSmallParts, with their parts as found when forced.
  std::map<int, std::vector<int64_t>> known_parts;
};

// The passes, in the order make_plan tries them (each in a file of its own, here).
bool settle_head_params(Settling& state, Propagation& pass);
bool settle_cuts(Settling& state, Propagation& pass);
bool replicate_feeders_of_called_layers(Settling& state, Propagation& pass);
bool hold_small_parts_whole(Settling& state, Propagation& pass);
bool force_unsplit_regions(Settling& state, Propagation& pass);
bool replicate_disagreeing_shared_weights(Settling& state, Propagation& pass);
bool replicate_unpaired_layers(Settling& state, Propagation& pass);
bool replicate_unsplit_functional_layers(Settling& state, Propagation& pass);
// Once the roles are settled: sequence parallelism over them, and the plan.
Plan settle_sequence_parallel(Settling& state);

}  // namespace autoshard::plan
