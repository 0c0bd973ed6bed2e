// RMS norms over a layer's output features (OLMo 2's q_norm and k_norm, over every head's
// features before the view into heads). Split by heads, each rank holds its heads' features
// and their weight: the mean of squares needs every rank's sum, one all-reduce of a value per
// token in forward, and the scale it gives, read by every rank's features, gets a partial
// gradient on each rank, summed in backward. Replicated, or split on its tokens, the norm is
// a per-token op like any other. A LayerNorm (ESM-C's q_norm and k_norm) splits alike, its mean
// all-reduced before its variance. A BatchNorm after a convolution split on its output channels
// splits with them: its statistics are per channel, so it needs no communication in forward or
// backward (its running statistics aside: nn/batch_norm.py).
//
// Records (python/autoshard/constructs/split_norm.py): {"node", "region", "features"}, the norm's
// global size; its weight is split like the features.
#include "plan/constructs/registry.h"
#include "plan/propagation.h"

namespace autoshard::plan {

void Propagation::visit_norm(int n, const Node& node) {
  const int in = node.inputs.at(0), out = node.outputs.at(0);
  const Layout x = layouts[in];
  layouts[out] = Layout{};
  for (size_t i = 1; i < node.inputs.size(); ++i) {  // its weight, and a LayerNorm's bias
    const Layout& param = layouts[node.inputs[i]];
    if (param.sharded) conflict(param.region, node.label + " takes a sharded weight or bias");
  }
  if (!x.sharded) return;
  if (node.per_channel) {
    // Statistics per channel over the batch and positions: exact on whole channels only.
    if (shape(in).size() < 2 || x.factor.axis != 1 || x.factor.outer != 1 || x.factor.size != shape(in).at(1)) {
      return conflict(x.region, node.label + " normalises each channel over an axis split otherwise than by "
                                              "its channels");
    }
    set_sharded(out, x.factor, x.region);
    split_norms[n] = x.region;
    return;
  }
  const int last = static_cast<int>(shape(in).size()) - 1;
  if (x.factor.axis != last || x.factor.outer != 1 || x.factor.size != shape(in).at(last)) {
    return conflict(x.region, node.label + " normalises over an axis split otherwise than by its features");
  }
  set_sharded(out, x.factor, x.region);
  split_norms[n] = x.region;
}

void Propagation::refuse_shared_norms() {
  for (const auto& [n, region] : split_norms) {
    if (kv_fine.count(find(region))) {
      conflict(region, graph_.nodes[n].label + " normalises over KV heads that several ranks hold");
    }
  }
}


namespace {

// The sum of squares all-reduced in forward, the scale's gradient in backward, one value per
// token each; a LayerNorm also its sum (the mean) and the mean's gradient.
void make_norms(const ConstructInput& in, Plan& plan) {
  std::vector<Record>& norms = plan.records["norms"];
  for (const auto& [n, region] : in.pass.split_norms) {
    const int root = in.pass.find(region);
    if (in.pass.regions[root].conflict) continue;
    const Node& node = in.graph.nodes.at(n);
    const int output = node.outputs.at(0);
    const auto& out = in.graph.tensor(output).shape;
    const int64_t features = node.per_channel ? out.at(1) : out.back();
    Record record;
    record.add("node", n).add("region", root).add("features", features);
    norms.push_back(std::move(record));
    if (node.per_channel) {
      // Per channel: nothing to sum. A training forward all-gathers the running mean and
      // variance of every rank's channels (ShardedBatchNorm); an evaluating one issues nothing.
      if (node.running_stats) in.count(plan, "forward", "all_gather", 2 * features);
      continue;
    }
    for (int pass_over = 0; pass_over < (node.centered ? 2 : 1); ++pass_over) {
      in.count(plan, "forward", "all_reduce", in.elements(output) / features);
      in.count(plan, "backward", "all_reduce", in.elements(output) / features);
    }
  }
}

[[maybe_unused]] const bool registered = register_record_kind({"norms", 60, make_norms});

}  // namespace

}  // namespace autoshard::plan
