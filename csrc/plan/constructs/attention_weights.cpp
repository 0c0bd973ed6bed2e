// The attention weights an nn.MultiheadAttention returns, when its heads are split.
//
// Averaged over the heads, they are a sum over every head divided by the head count: each rank
// sums its own heads, and one all-reduce of those sums (divided by the global count) gives every
// rank the exact average, replicated. Its gradient is the same on every rank and reaches each
// rank's heads unchanged, so backward needs no collective. Per head (average_attn_weights=False)
// they would have to be gathered whole: an attention whose model reads them stays whole. Weights
// the model never reads (`out, _ = attn(x, x, x)`) cost nothing: the sharded module returns None.
//
// Records (python/autoshard/constructs/attention.py): {"node", "region", "used"}, `used` when the
// model reads them.
#include "plan/constructs/registry.h"
#include "plan/propagation.h"

namespace autoshard::plan {

void Propagation::visit_attention_weights(int n, const Node& node) {
  const int in = node.inputs.at(0), out = node.outputs.at(0);
  const Layout x = layouts[in];
  layouts[out] = Layout{};
  if (!x.sharded) return;
  if (x.factor.axis != node.dim) return conflict(x.region, node.label + "'s attention weights are not split by heads");
  const bool read = read_[out];
  if (read && !node.average) {
    return conflict(x.region, node.label + " returns its attention weights per head (average_attn_weights=False) "
                                           "and the model reads them: they would need every head");
  }
  returned_weights[n] = {x.region, read};
}


namespace {

// An all-reduce of each rank's sum where the weights are read.
void make_attention_weights(const ConstructInput& in, Plan& plan) {
  for (const auto& [n, returned] : in.pass.returned_weights) {
    const int root = in.pass.find(returned.region);
    if (in.pass.regions[root].conflict) continue;
    Record record;
    record.add("node", n).add("region", root).add("used", returned.read);
    plan.records["attention_weights"].push_back(std::move(record));
    if (returned.read) in.count(plan, "forward", "all_reduce", in.elements(in.graph.nodes.at(n).outputs.at(0)));
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"attention_weights", 50, make_attention_weights});

}  // namespace

}  // namespace autoshard::plan
