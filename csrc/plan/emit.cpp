// From the settled pass to a Plan: the planner's own decisions here, each construct's records in
// its file under constructs/ (constructs/registry.h); plan_to_json (emit_json.cpp) writes it as
// the document the Python layer reads.
#include "plan/emit.h"

#include <algorithm>
#include <map>
#include <numeric>

#include <c10/util/Exception.h>

#include "plan/constructs/registry.h"
#include "plan/gradient_flow.h"
#include "plan/reasons.h"

namespace autoshard::plan {
namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// Partial gradients are summed in buckets of at most this many elements (100 MiB of fp32),
// each started once all of its gradients are ready.
constexpr int64_t kBucketElements = int64_t{25} << 20;

void sort_unique(std::vector<int64_t>& v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
}

}  // namespace

void count_collective(Plan& plan, const char* phase, const char* kind, int64_t elements) {
  for (CommCount& c : plan.comm) {
    if (c.phase == phase && c.kind == kind) {
      c.count += 1;
      c.elements += elements;
      return;
    }
  }
  plan.comm.push_back({phase, kind, 1, elements});
}

Plan emit_plan(const Graph& graph, Propagation& pass, const std::vector<Why>& why, int64_t world_size,
               const std::map<int, std::string>& sequence_refused) {
  Plan plan;
  std::map<int, int> copy_groups;  // input tensor -> group
  std::map<int, RegionSummary> regions;
  auto comm = [&](const char* phase, const char* kind, int64_t elements) {
    // A group of one rank communicates nothing; nor does a collective over no elements (a layer
    // called on the tokens a mask selects, none of them: csrc/comm returns at once).
    if (world_size == 1 || elements == 0) return;
    count_collective(plan, phase, kind, elements);
  };
  // A model input needs no gradient, so the copy of one issues no backward all-reduce; nor
  // does any collective of a tensor backward never reaches (see gradient_flow.h).
  const GradientFlow flow = gradient_flow(graph);
  std::vector<int> producer(graph.tensors.size(), -1);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    for (int id : graph.nodes[n].outputs) producer[id] = static_cast<int>(n);
  }
  // A column layer's copy (or gather) of its input runs in backward when the input requires a
  // gradient and backward reaches one of the column layers reading it (the input itself may
  // reach an output another way, by a residual).
  std::vector<bool> copy_read(graph.tensors.size(), false);
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!is_layer(node) || (pass.roles[n] != Style::Column && pass.roles[n] != Style::ColumnGather)) continue;
    if (node.no_grad) continue;  // called under the model's torch.no_grad(): backward never reaches it
    const auto sequence = pass.sequence_roles.find(static_cast<int>(n));
    const int input = node.inputs.at(0);
    if (sequence != pass.sequence_roles.end() && sequence->second == SequenceRole::Gather &&
        pass.gather_entry.count(input)) {
      continue;  // gathered where a module receives it: counted with the sequence gathers
    }
    for (int out : node.outputs) copy_read[input] = copy_read[input] || flow.reaches_output[out];
  }
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!is_layer(node)) continue;
    LayerDecision d;
    d.node = static_cast<int>(n);
    d.style = pass.roles[n];
    d.reason = why[n].reason;
    d.note = why[n].note;
    if (node.functional && d.style == Style::Column && d.note.empty()) {
      d.note = "the model multiplies its weight itself: its rows here give this rank's channels, and its "
               "input's gradient is summed upstream";
    }
    d.whole_units = why[n].whole_units;
    const bool has_batch_letter = std::any_of(node.letters.begin(), node.letters.end(), [](const EinsumLetter& l) {
      return l.role == EinsumLetter::Batch && l.size > 0;
    });
    if (d.style == Style::Replicate && d.reason.empty() && has_batch_letter) {
      // A grouped convolution splits only with its input: one arriving whole keeps it whole.
      d.reason = "groups_input_whole";
      reason_text(d.reason);  // every code has its words in reasons.cpp
      d.note = "replicated: its input is held whole on every rank";
    }
    if (d.style != Style::Replicate) {
      int root = pass.find(pass.node_region[n]);
      d.units = d.style == Style::Vocab ? node.num_embeddings : pass.regions[root].units;
      if (pass.kv_fine.count(root)) {
        // A KV projection: its units are KV heads, each serving `repeat` query-head units
        // of the attention's region; the ranks holding one sum its gradient in backward.
        root = pass.kv_fine.at(root);
        d.repeat = pass.regions[root].units / d.units;
        const int64_t weight = node.in_features * node.out_features, bias = node.bias_param >= 0 ? node.out_features : 0;
        comm("backward", "all_reduce", weight + bias);
        regions[root].repeat = d.repeat;
        regions[root].coarse_units = d.units;
        const auto& coarse = pass.regions[pass.find(pass.node_region[n])].localize;
        regions[root].coarse_localize.insert(regions[root].coarse_localize.end(), coarse.begin(), coarse.end());
        regions[root].coarse_localize.push_back(node.out_features);
      }
      d.region = root;
      if (pass.parts.count(static_cast<int>(n))) {
        // Parts cut after a view into units (heads) are given in the layer's features.
        d.parts = pass.parts.at(static_cast<int>(n));
        const int64_t total = std::accumulate(d.parts.begin(), d.parts.end(), int64_t{0});
        const int64_t features = node.kind == Kind::Linear ? node.out_features : total;
        TORCH_CHECK(total > 0 && features % total == 0, "[plan.internal] parts ", total, " do not divide ", features);
        for (int64_t& size : d.parts) size *= features / total;
      }
      if (pass.whole_parts.count(static_cast<int>(n))) d.whole_parts = pass.whole_parts.at(static_cast<int>(n));
      const auto summed = pass.summed_parts.find(static_cast<int>(n));
      if (summed != pass.summed_parts.end()) {
        d.summed_parts = true;  // the whole parts' rows: one all-reduce of their gradient
        comm("backward", "all_reduce", summed->second);
      }
      if (pass.letters.count(static_cast<int>(n))) d.letter = pass.letters.at(static_cast<int>(n));
      if (d.style == Style::Column || d.style == Style::Row) {
        RegionSummary& summary = regions[root];
        summary.id = root;
        summary.units = pass.regions[root].units;
        summary.localize = pass.regions[root].localize;
      }
    }
    const int64_t out_elements = numel(graph.tensor(node.outputs.at(0)).shape);
    const auto sequence = pass.sequence_roles.find(static_cast<int>(n));
    const SequenceRole seq = sequence == pass.sequence_roles.end() ? SequenceRole::None : sequence->second;
    if (seq != SequenceRole::None) {
      static const char* names[] = {"", "reduce_scatter", "gather"};
      d.sequence = names[static_cast<int>(seq)];
      if (seq == SequenceRole::Gather && pass.gather_entry.count(node.inputs.at(0))) d.sequence = "gathered";
      d.sequence_dim = pass.sequence_axis.at(static_cast<int>(n));
      d.sequence_region = pass.find(pass.sequence_region.at(static_cast<int>(n)));
    }
    if (sequence_refused.count(static_cast<int>(n))) {
      d.sequence_note = "sequence parallelism refused: " + sequence_refused.at(static_cast<int>(n));
    }
    // Counted elements are the full tensor's for a reduce-scatter and for the all-gather that
    // gives it back: the same data an all-reduce of that tensor moves, in two halves.
    switch (d.style) {
      case Style::Row:
      case Style::Vocab:
        if (seq == SequenceRole::ReduceScatter) {
          comm("forward", "reduce_scatter", out_elements);
          comm("backward", "all_gather", out_elements);
        } else {
          comm("forward", "all_reduce", out_elements);
        }
        break;
      case Style::ColumnGather: comm("forward", "all_gather", out_elements); [[fallthrough]];
      case Style::Column: {
        const int input = node.inputs.at(0);
        auto [it, fresh] = copy_groups.emplace(input, static_cast<int>(copy_groups.size()));
        d.copy_group = it->second;
        // A layer whose weight the model multiplies itself makes no input copy at all.
        d.deferred_copy = pass.deferred_copies.count(static_cast<int>(n)) > 0 || node.functional;
        const int64_t in_elements = numel(graph.tensor(input).shape);
        const bool backward = flow.requires_grad[input] && copy_read[input];
        if (fresh && d.sequence == "gathered") {
          // counted once per gathered tensor, below
        } else if (fresh && seq == SequenceRole::Gather) {
          comm("forward", "all_gather", in_elements);
          if (backward) comm("backward", "reduce_scatter", in_elements);
        } else if (fresh && producer[input] >= 0 && backward && !d.deferred_copy) {
          comm("backward", "all_reduce", in_elements);
        }
        break;
      }
      case Style::Batch:  // split with its input, its output split alike: nothing to exchange
      case Style::Replicate: break;
    }
    plan.layers.push_back(std::move(d));
  }
  for (auto& [id, summary] : regions) {
    sort_unique(summary.localize);
    sort_unique(summary.coarse_localize);
    plan.regions.push_back(summary);
  }

  // Partial gradients, in the order backward produces them (the reverse of the parameters').
  if (world_size > 1) {
    for (auto it = pass.partial_params.rbegin(); it != pass.partial_params.rend(); ++it) {
      const int64_t elements = it->second;
      if (plan.partial.empty() || plan.partial.back().elements + elements > kBucketElements) {
        plan.partial.emplace_back();
      }
      plan.partial.back().params.push_back(it->first);
      plan.partial.back().elements += elements;
    }
    // A bucket of frozen parameters only has nothing to sum.
    std::map<int64_t, bool> trainable;
    for (const TensorInfo& t : graph.tensors) {
      if (t.param >= 0) trainable[t.param] = trainable[t.param] || t.trainable;
    }
    for (const PartialBucket& bucket : plan.partial) {
      const bool any = std::any_of(bucket.params.begin(), bucket.params.end(), [&](int64_t param) {
        return !trainable.count(param) || trainable.at(param);
      });
      if (any) comm("backward", "all_reduce", bucket.elements);
    }
  }

  // An experts module's routing weights meet every rank's partial expert outputs in the
  // combine: once its experts are split, their gradient is a partial sum, all-reduced in
  // backward (one all-reduce per floating-point routing input, and one for an out bias).
  for (const Node& node : graph.nodes) {
    if ((node.routing_floating.empty() && node.summed_bias == 0) || node.inputs.empty()) continue;
    const int experts = producer[node.inputs[0]];
    if (experts < 0 || !is_layer(graph.nodes[experts]) || pass.roles[experts] == Style::Replicate) continue;
    for (size_t i = 0; i < node.routing_floating.size() && i + 1 < node.inputs.size(); ++i) {
      if (node.routing_floating[i]) comm("backward", "all_reduce", numel(graph.tensor(node.inputs[i + 1]).shape));
    }
    if (node.summed_bias > 0) comm("backward", "all_reduce", node.summed_bias);
  }

  // Every sharded tensor, named by the region the plan reports it under (an entry is held
  // whole where it is made).
  std::map<int, int> coarse_to_fine;
  for (const auto& [coarse, fine] : pass.kv_fine) coarse_to_fine[coarse] = fine;
  for (size_t t = 0; t < graph.tensors.size(); ++t) {
    const Layout& l = pass.layouts[t];
    if (!l.sharded || pass.entry_of.count(static_cast<int>(t))) continue;
    TensorLayout layout;
    layout.tensor = static_cast<int>(t);
    const int root = pass.find(l.region);
    layout.coarse = coarse_to_fine.count(root) > 0;
    layout.region = layout.coarse ? coarse_to_fine.at(root) : root;
    layout.axis = l.factor.axis;
    layout.outer = l.factor.outer;
    layout.size = l.factor.size;
    layout.sequence = l.sequence;
    layout.whole = l.whole;
    if (layout.coarse && l.repeat_next > 1 &&
        l.repeat_next == pass.regions[layout.region].units / pass.regions[root].units) {
      layout.repeat_axis = l.factor.axis + 1;
    }
    if (l.sequence) {
      layout.coarse = false;
      layout.region = root;
    }
    plan.tensors.push_back(layout);
  }
  name_region_modules(graph, plan);
  // The constructs' records and their collectives, counted after the plan's own.
  make_construct_records({graph, pass, flow, world_size, kBucketElements}, plan);
  return plan;
}

}  // namespace autoshard::plan
