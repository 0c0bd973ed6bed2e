// RMS norms over a layer's output features (OLMo 2's q_norm and k_norm, over every head's
// features before the view into heads). Split by heads, each rank holds its heads' features
// and their weight: the mean of squares needs every rank's sum, one all-reduce of a value per
// token in forward, and the scale it gives, read by every rank's features, gets a partial
// gradient on each rank, summed in backward. Replicated, or split on its tokens, the norm is
// a per-token op like any other. A LayerNorm (ESM-C's q_norm and k_norm) splits alike, its mean
// all-reduced before its variance. A BatchNorm after a convolution split on its output channels
// splits with them: its statistics are per channel, so it needs no communication in forward or
// backward (its running statistics aside: nn/batch_norm.py).
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

}  // namespace autoshard::plan
