// Head cuts and node cuts (constructs/head_cuts.cpp): kept while the scores they meet are split,
// dropped for good once not, and the new ones a pass asked for taken for the next. A pass that
// found new cuts (or dropped some) saw bias tensors held whole that the next one cuts: its
// conflicts and partial gradients are not the model's, so nothing else is forced on them.
#include <sstream>
#include <string>
#include <vector>

#include "plan/passes/settling.h"

namespace autoshard::plan {
namespace {

// A cut is made where a module receives the bias, so it must be the attention's own module.
//
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

// Head cuts and node cuts are kept and dropped by the same rules, each in its own maps.
bool settle_cut_kind(Settling& state, Propagation& pass, const std::map<int, int>& in_use,
                     const std::map<int, AxisFactor>& wanted, std::map<int, AxisFactor>& kept, std::set<int>& dropped) {
  bool changed = false;
  for (const auto& [key, region] : in_use) {
    const int root = pass.find(region);
    bool meets_layer = false;
    for (size_t n = 0; n < state.count; ++n) {
      meets_layer = meets_layer || (pass.roles[n] == Style::Column && pass.find(pass.node_region[n]) == root);
    }
    // A bias is cut where the attention holding the region's layers receives it: there its
    // module's attributes are made local from inputs given at their local shapes.
    bool at_attention = true;
    if (&in_use == &pass.cut_region) {
      std::vector<std::string> names;
      for (size_t n = 0; n < state.count; ++n) {
        const Style role = pass.roles[n];
        if ((role == Style::Column || role == Style::Row) && pass.find(pass.node_region[n]) == root) {
          names.push_back(state.graph.nodes[n].label);
        }
      }
      const std::string& module = state.graph.entries.at(key).module;
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
}

}  // namespace

bool settle_cuts(Settling& state, Propagation& pass) {
  const bool entries_changed =
      settle_cut_kind(state, pass, pass.cut_region, pass.wanted_cuts, state.cuts, state.dropped_cuts);
  return settle_cut_kind(state, pass, pass.node_cut_region, pass.wanted_node_cuts, state.node_cuts,
                         state.dropped_node_cuts) ||
         entries_changed;
}

}  // namespace autoshard::plan
