// A region's module: the smallest module holding all of its layers. The sizes a region makes
// local (head counts, split sizes) are attributes of that module; the Python layer chooses
// which, by tracing it.
#include <algorithm>
#include <map>
#include <sstream>

#include "plan/emit.h"

namespace autoshard::plan {
namespace {

std::vector<std::string> path(const std::string& name) {
  std::vector<std::string> parts;
  std::stringstream in(name);
  for (std::string part; std::getline(in, part, '.');) parts.push_back(part);
  return parts;
}

// The longest common prefix of the layers' module paths; a layer's own name is not its parent
// module, so where the prefix is a whole name (or there is one layer) its last part is dropped.
std::string common_module(const std::vector<std::string>& names) {
  if (names.empty()) return "";
  std::vector<std::vector<std::string>> paths;
  for (const std::string& name : names) paths.push_back(path(name));
  std::vector<std::string> common = paths[0];
  for (const auto& p : paths) {
    size_t k = 0;
    while (k < common.size() && k < p.size() && common[k] == p[k]) ++k;
    common.resize(k);
  }
  bool whole_name = paths.size() == 1;
  for (const auto& p : paths) whole_name = whole_name || common.size() == p.size();
  if (whole_name && !common.empty()) common.pop_back();
  std::string joined;
  for (size_t k = 0; k < common.size(); ++k) joined += (k ? "." : "") + common[k];
  return joined;
}

std::string parent(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

}  // namespace

void name_region_modules(const Graph& graph, Plan& plan) {
  for (RegionSummary& region : plan.regions) {
    std::vector<std::string> members;
    std::map<std::string, std::vector<std::string>> by_parent;  // split layers, by their parent module
    for (const LayerDecision& layer : plan.layers) {
      if (layer.region != region.id) continue;
      const std::string& name = graph.nodes.at(layer.node).label;
      members.push_back(name);
      if (layer.style != Style::Replicate) by_parent[parent(name)].push_back(name);
    }
    region.module = common_module(members);
    if (by_parent.size() < 2) continue;
    std::vector<std::vector<std::string>> groups;
    for (const auto& [owner, names] : by_parent) groups.push_back(names);
    std::sort(groups.begin(), groups.end());
    for (const auto& names : groups) region.part_modules.push_back(common_module(names));
  }
}

}  // namespace autoshard::plan
