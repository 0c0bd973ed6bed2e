// Head cuts: a tensor held whole that is added to sharded attention scores along their heads
// axis (an ALiBi bias, built from the head count and passed to every attention) is cut to this
// rank's heads where a module receives it, as sequence parallelism cuts tokens. A tensor made
// along the heads (zeros, a replicated embedding's output, one KV head broadcast to every query
// head) is made at this rank's heads instead.
//
// An elementwise op pairs element i of its inputs, so the rank computing heads [start, stop)
// of the scores needs exactly those heads of the bias: the cut is exact whatever the bias
// holds. It is made on the module call that holds the op reading the bias and every op between
// the entry and that read (slices of other axes, transposes, copies), and only for a tensor no
// gradient reaches (a bias made from the mask or from positions), so backward never crosses it.
// Inside the call the tensor is sharded like the scores; outside it is held whole, so one bias
// passed to every block is cut once per attention.
//
// Records (python/autoshard/constructs/head_cut.py): head_entries, a tensor cut where a module
// receives it, {"tensor", "module", "leaf" (its place among the call's flattened inputs), "axis",
// "outer", "size", "region"}: its axis `axis` is `outer` x `size`, and `size` is split like the
// region's units; head_outputs, a replicated embedding's output cut as it leaves the embedding,
// {"tensor" (the output), "module", "axis", "outer", "size", "region"}.
#include "plan/constructs/registry.h"
#include "plan/propagation.h"

namespace autoshard::plan {

bool is_uniform_source(const Node& node) {
  if (node.kind != Kind::Source) return false;
  for (const char* op : {"aten.zeros.", "aten.ones.", "aten.full."}) {
    if (node.label.rfind(op, 0) == 0) return true;
  }
  return false;
}

bool Propagation::request_cut(int tensor, int axis, const AxisFactor& wanted) {
  const int n = current_node_;
  HeadsWalk walk;
  walk.views_keep_heads = true;
  walk.at_step = [&](const HeadsTrace& at, int p) {
    const int t = at.tensor, a = at.heads.axis;
    const AxisFactor& cut = at.heads;
    int best = -1;
    for (size_t e = 0; e < graph_.entries.size() && !carries_grad_.at(t); ++e) {
      const ModuleEntry& entry = graph_.entries[e];
      if (entry.tensor != t || entry.end <= entry.first || entry.first > at.before || entry.end <= n) continue;
      if (best < 0 || entry.end - entry.first < graph_.entries[best].end - graph_.entries[best].first) {
        best = static_cast<int>(e);
      }
    }
    const auto& out_shape = graph_.tensor(t).shape;
    if (best >= 0) {
      if (out_shape.at(a) != cut.outer * cut.size || dropped_cuts.count(best)) return WalkVerdict::Refused;
      wanted_cuts[best] = cut;
      return WalkVerdict::Found;
    }
    if (p < 0) return WalkVerdict::Further;
    const Node& node = graph_.nodes[p];
    const bool embedding = node.kind == Kind::Embedding && roles[p] == Style::Replicate;
    if ((embedding && a == static_cast<int>(out_shape.size()) - 1) || is_uniform_source(node)) {
      if (out_shape.at(a) != cut.outer * cut.size || dropped_node_cuts.count(p)) return WalkVerdict::Refused;
      wanted_node_cuts[p] = cut;
      return WalkVerdict::Found;
    }
    if (node.kind != Kind::Expand || node.inputs.empty()) return WalkVerdict::Further;
    const auto& in_shape = graph_.tensor(node.inputs[0]).shape;
    const int in_axis = a - static_cast<int>(out_shape.size() - in_shape.size());
    if (in_axis >= 0 && in_shape.at(in_axis) == 1 && out_shape.at(a) > 1) {
      // A broadcast along the heads (repeat_kv's expand of one KV head): made at this rank's
      // size it holds this rank's heads. Its input gets a partial gradient (the sum over
      // this rank's heads), which settle_gradients follows.
      if (out_shape.at(a) != cut.outer * cut.size || cut.outer != 1 || dropped_node_cuts.count(p)) {
        return WalkVerdict::Refused;
      }
      wanted_node_cuts[p] = cut;
      return WalkVerdict::Found;
    }
    return WalkVerdict::Further;
  };
  return walk_heads_back(tensor, axis, wanted, walk);
}

// Before node `n`: the cuts whose module call ends here give their tensor back whole, those
// whose call begins here hold it sharded, each in a region of its own that the scores join.
void Propagation::open_cuts(int n, const std::map<int, AxisFactor>& cuts) {
  for (const auto& [index, factor] : cuts) {
    const ModuleEntry& entry = graph_.entries.at(index);
    if (entry.end == n && cut_region.count(index)) layouts[entry.tensor] = Layout{};
  }
  for (const auto& [index, factor] : cuts) {
    const ModuleEntry& entry = graph_.entries.at(index);
    // A tensor sharded where it is made (a bias passed on from the first attention) needs no cut.
    if (entry.first != n || entry.end <= entry.first || layouts[entry.tensor].sharded) continue;
    const int region = new_region(factor.size);
    set_sharded(entry.tensor, factor, region);
    cut_region[index] = region;
    cut_factor[index] = factor;
  }
}


namespace {

// A slice of a tensor no gradient reaches: no communication.
void make_head_entries(const ConstructInput& in, Plan& plan) {
  for (const auto& [index, region] : in.pass.cut_region) {
    const ModuleEntry& entry = in.graph.entries.at(index);
    const int root = in.pass.find(region);
    if (in.pass.regions[root].conflict) continue;
    const AxisFactor& f = in.pass.cut_factor.at(index);
    Record record;
    record.add("tensor", entry.tensor).add("module", entry.module).add("leaf", entry.leaf);
    record.add("axis", f.axis).add("outer", f.outer).add("size", f.size).add("region", root);
    plan.records["head_entries"].push_back(std::move(record));
  }
}

// Embedding outputs cut as they leave the layer: their gradient gathered back in backward.
void make_head_outputs(const ConstructInput& in, Plan& plan) {
  for (const auto& [n, region] : in.pass.node_cut_region) {
    const Node& node = in.graph.nodes.at(n);
    const int root = in.pass.find(region);
    if (in.pass.regions[root].conflict || node.kind != Kind::Embedding) continue;
    const AxisFactor& f = in.pass.node_cut_factor.at(n);
    const int output = node.outputs.at(0);
    Record record;
    record.add("tensor", output).add("module", node.label);
    record.add("axis", f.axis).add("outer", f.outer).add("size", f.size).add("region", root);
    plan.records["head_outputs"].push_back(std::move(record));
    if (in.flow.needs(output)) in.count(plan, "backward", "all_gather", in.elements(output));
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"head_entries", 30, make_head_entries}) &&
                                         register_record_kind({"head_outputs", 40, make_head_outputs});

}  // namespace

}  // namespace autoshard::plan
