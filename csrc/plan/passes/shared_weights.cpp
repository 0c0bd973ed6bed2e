// A parameter shared by several layers (tied embeddings) is sharded only if every layer shards
// it on the same dimension into the same pieces: a token table and a column layer over the
// vocabulary. A parameter read outside its layers stays whole.
#include <set>

#include "plan/passes/settling.h"

namespace autoshard::plan {

bool replicate_disagreeing_shared_weights(Settling& state, Propagation& pass) {
  bool changed = false;
  for (const auto& [param, layers] : state.layers_of_param) {
    bool agree = !state.params_read_elsewhere.count(param) || state.functional_biases.count(param);
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
      if (role == Style::Vocab) units.insert(state.graph.nodes[n].num_embeddings);
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
    const bool elsewhere = state.params_read_elsewhere.count(param) > 0;
    for (int n : layers) {
      changed |= state.force(n, Force::Replicate,
                             elsewhere ? Why{"weight_read_elsewhere", "replicated: its weight is also read outside the layer"}
                                       : Why{"weight_shared", "replicated: it shares its weight with a layer split differently"});
    }
  }
  return changed;
}

}  // namespace autoshard::plan
