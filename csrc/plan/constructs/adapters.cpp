// LoRA adapters (python/autoshard/nn/lora.py): the planner sees a LoRA layer as the Linear it
// wraps and decides its style; the style carries over to the factor that shares the base
// layer's split axis.
//   column (output features split): B ([out, rank]) split like the base weight's rows; A whole,
//     its gradient partial (it meets only this rank's rows of B);
//   row (input features split): A ([rank, in]) split like the base weight's columns; B whole,
//     its gradient partial (it meets only this rank's partial A output);
//   replicate: both whole.
// The partial gradients of trained whole factors are summed over the group in backward, in
// buckets of their own after the plan's, one all-reduce each. A B split like KV heads held by
// several ranks, or with parts held whole, sums its gradient as its base layer does.
//
// Records (python/autoshard/constructs/linear.py): {"node", "split", "whole"}, a LoRA layer's
// factors split with its base layer and those held whole, parameter indices.
#include "plan/constructs/registry.h"
#include "plan/emit.h"

namespace autoshard::plan {
namespace {

void make_adapters(const ConstructInput& in, Plan& plan) {
  const Graph& graph = in.graph;
  const int64_t world_size = in.world_size, bucket_elements = in.bucket_elements;
  std::vector<Record>& adapters = plan.records["adapters"];
  std::vector<std::pair<int64_t, int64_t>> partial;  // (parameter, elements), in forward order
  for (const LayerDecision& layer : plan.layers) {
    const Node& node = graph.nodes.at(layer.node);
    if (node.adapters.empty()) continue;
    const bool column = layer.style == Style::Column || layer.style == Style::ColumnGather;
    const bool split = column || layer.style == Style::Row;
    std::vector<int64_t> split_factors, whole_factors;
    for (const AdapterFactors& f : node.adapters) {
      for (int side = 0; side < 2; ++side) {
        const bool b = side == 1;
        const int64_t param = b ? f.b : f.a;
        if (split && b == column) {
          split_factors.push_back(param);
          continue;
        }
        whole_factors.push_back(param);
        const auto& shape = b ? f.b_shape : f.a_shape;
        if (split && (b ? f.b_trainable : f.a_trainable)) partial.emplace_back(param, shape[0] * shape[1]);
      }
      if (column && f.b_trainable && (layer.repeat || layer.summed_parts) && world_size > 1) {
        int64_t rows = f.b_shape[0];
        if (!layer.repeat) {
          rows = 0;
          for (int64_t i : layer.whole_parts) rows += layer.parts.at(i);
        }
        count_collective(plan, "backward", "all_reduce", rows * f.b_shape[1]);
      }
    }
    Record record;
    record.add("node", layer.node).add("split", std::move(split_factors)).add("whole", std::move(whole_factors));
    adapters.push_back(std::move(record));
  }
  if (world_size <= 1 || partial.empty()) return;
  // In the order backward produces them: the reverse of the forward's.
  std::vector<PartialBucket> buckets;
  for (auto it = partial.rbegin(); it != partial.rend(); ++it) {
    if (buckets.empty() || buckets.back().elements + it->second > bucket_elements) buckets.emplace_back();
    buckets.back().params.push_back(it->first);
    buckets.back().elements += it->second;
  }
  for (PartialBucket& bucket : buckets) {
    count_collective(plan, "backward", "all_reduce", bucket.elements);
    plan.partial.push_back(std::move(bucket));
  }
}

// After the plan's own partial gradients, whose buckets come first.
[[maybe_unused]] const bool registered = register_record_kind({"adapters", 100, make_adapters});

}  // namespace
}  // namespace autoshard::plan
