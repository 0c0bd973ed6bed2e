// Summed outputs (python/autoshard/constructs/summed_output.py): a replicated Linear layer whose
// output's gradient is partial on every rank (gradients.cpp decides which) has it summed over the
// ranks where it returns the output, one all-reduce in backward, and the column layers' input
// copies reading it sum nothing. Records: {"node", "elements"}, the layer and its output's
// elements.
#include "plan/constructs/registry.h"

namespace autoshard::plan {
namespace {

void make_summed_outputs(const ConstructInput& in, Plan& plan) {
  std::vector<Record>& outputs = plan.records["summed_outputs"];
  for (const auto& [node, elements] : in.pass.summed_outputs) {
    Record record;
    record.add("node", node).add("elements", elements);
    outputs.push_back(std::move(record));
    in.count(plan, "backward", "all_reduce", elements);
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"summed_outputs", 70, make_summed_outputs});

}  // namespace
}  // namespace autoshard::plan
