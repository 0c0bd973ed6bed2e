// Sequence cuts (python/autoshard/constructs/sequence.py): a tensor held whole cut to this rank's
// tokens where a module receives it (sequence_entries), gathered whole where a module receives it
// (sequence_gathers), or where a module returns it (sequence_exits, made by token_indexing.cpp once
// the plan is settled). Records: {"tensor", "module", "leaf", "dim", "region"}.
#include "plan/constructs/sequence_cuts.h"

#include "plan/constructs/registry.h"

namespace autoshard::plan {

Record sequence_cut(int tensor, const std::string& module, int leaf, int dim, int region) {
  Record record;
  record.add("tensor", tensor).add("module", module).add("leaf", leaf).add("dim", dim).add("region", region);
  return record;
}

namespace {

Record cut_of(const ConstructInput& in, int tensor, int entry_index) {
  const ModuleEntry& entry = in.graph.entries.at(entry_index);
  const Layout& layout = in.pass.layouts[tensor];
  return sequence_cut(tensor, entry.module, entry.leaf, layout.factor.axis, in.pass.find(layout.region));
}

// Cut in forward, their gradient gathered back in backward.
void make_entries(const ConstructInput& in, Plan& plan) {
  for (const auto& [tensor, index] : in.pass.entry_of) {
    plan.records["sequence_entries"].push_back(cut_of(in, tensor, index));
    if (in.flow.needs(tensor)) in.count(plan, "backward", "all_gather", in.elements(tensor));
  }
}

void make_gathers(const ConstructInput& in, Plan& plan) {
  for (const auto& [tensor, index] : in.pass.gather_entry) {
    plan.records["sequence_gathers"].push_back(cut_of(in, tensor, index));
    in.count(plan, "forward", "all_gather", in.elements(tensor));
    if (in.flow.needs(tensor)) in.count(plan, "backward", "reduce_scatter", in.elements(tensor));
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"sequence_entries", 10, make_entries}) &&
                                         register_record_kind({"sequence_gathers", 20, make_gathers}) &&
                                         register_record_kind({kSequenceExits, 25, nullptr});

}  // namespace
}  // namespace autoshard::plan
