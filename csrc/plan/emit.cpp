// From the settled pass to a Plan, and the Plan as the JSON document the Python layer reads.
//
// The document (version 1), every record with named fields:
//   {"version": 1,
//    "layers": [{"node", "style", "region", "units", "copy_group", "parts", "whole_parts", "summed_parts", "letter", "repeat",
//                "reason", "note", "whole_units", "sequence", "sequence_dim", "sequence_region",
//                "sequence_note"}],
//    "regions": [{"id", "units", "localize", "repeat", "coarse_units", "coarse_localize"}],
//    "comm": [{"phase", "kind", "count", "elements"}],
//    "partial_gradients": [{"params", "elements"}],
//    "tensors": [{"tensor", "region", "coarse", "axis", "outer", "size", "sequence", "whole"}],
//    "sequence_entries": [{"tensor", "module", "leaf", "dim", "region"}],
//    "sequence_gathers": [{"tensor", "module", "leaf", "dim", "region"}],
//    "head_entries": [{"tensor", "module", "leaf", "axis", "outer", "size", "region"}],
//    "head_outputs": [{"tensor", "module", "axis", "outer", "size", "region"}],
//    "attention_weights": [{"node", "region", "used"}],
//    "head_params": [{"tensor", "param", "axis", "size", "region"}],
//    "norms": [{"node", "region", "features"}]}
#include "plan/emit.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <sstream>

#include <c10/util/Exception.h>

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

Plan emit_plan(const Graph& graph, Propagation& pass, const std::vector<Why>& why, int64_t world_size,
               const std::map<int, std::string>& sequence_refused) {
  Plan plan;
  std::map<int, int> copy_groups;  // input tensor -> group
  std::map<int, RegionSummary> regions;
  auto comm = [&](const char* phase, const char* kind, int64_t elements) {
    if (world_size == 1) return;  // a group of one rank communicates nothing
    for (CommCount& c : plan.comm) {
      if (c.phase == phase && c.kind == kind) {
        c.count += 1;
        c.elements += elements;
        return;
      }
    }
    plan.comm.push_back({phase, kind, 1, elements});
  };
  // A model input needs no gradient, so the copy of one issues no backward all-reduce.
  std::vector<bool> produced(graph.tensors.size(), false);
  for (const Node& node : graph.nodes) {
    for (int id : node.outputs) produced[id] = true;
  }
  for (size_t n = 0; n < graph.nodes.size(); ++n) {
    const Node& node = graph.nodes[n];
    if (!is_layer(node)) continue;
    LayerDecision d;
    d.node = static_cast<int>(n);
    d.style = pass.roles[n];
    d.reason = why[n].reason;
    d.note = why[n].note;
    d.whole_units = why[n].whole_units;
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
        const int64_t in_elements = numel(graph.tensor(input).shape);
        if (fresh && d.sequence == "gathered") {
          // counted once per gathered tensor, below
        } else if (fresh && seq == SequenceRole::Gather) {
          comm("forward", "all_gather", in_elements);
          comm("backward", "reduce_scatter", in_elements);
        } else if (fresh && produced[input]) {
          comm("backward", "all_reduce", in_elements);
        }
        break;
      }
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
    for (const PartialBucket& bucket : plan.partial) comm("backward", "all_reduce", bucket.elements);
  }

  // Entries: cut in forward, their gradient gathered back in backward.
  for (const auto& [tensor, index] : pass.entry_of) {
    const ModuleEntry& entry = graph.entries.at(index);
    plan.sequence_entries.push_back(
        {tensor, entry.module, entry.leaf, pass.layouts[tensor].factor.axis, pass.find(pass.layouts[tensor].region)});
    comm("backward", "all_gather", numel(graph.tensor(tensor).shape));
  }

  for (const auto& [tensor, index] : pass.gather_entry) {
    const ModuleEntry& entry = graph.entries.at(index);
    plan.sequence_gathers.push_back(
        {tensor, entry.module, entry.leaf, pass.layouts[tensor].factor.axis, pass.find(pass.layouts[tensor].region)});
    comm("forward", "all_gather", numel(graph.tensor(tensor).shape));
    comm("backward", "reduce_scatter", numel(graph.tensor(tensor).shape));
  }

  // Head cuts: a slice of a tensor no gradient reaches, no communication.
  for (const auto& [index, region] : pass.cut_region) {
    const ModuleEntry& entry = graph.entries.at(index);
    const int root = pass.find(region);
    if (pass.regions[root].conflict) continue;
    const AxisFactor& f = pass.cut_factor.at(index);
    plan.head_entries.push_back({entry.tensor, entry.module, entry.leaf, f.axis, f.outer, f.size, root});
  }

  // Embedding outputs cut as they leave the layer: their gradient gathered back in backward.
  for (const auto& [n, region] : pass.node_cut_region) {
    const Node& node = graph.nodes.at(n);
    const int root = pass.find(region);
    if (pass.regions[root].conflict || node.kind != Kind::Embedding) continue;
    const AxisFactor& f = pass.node_cut_factor.at(n);
    plan.head_outputs.push_back({node.outputs.at(0), node.label, 0, f.axis, f.outer, f.size, root});
    comm("backward", "all_gather", numel(graph.tensor(node.outputs.at(0)).shape));
  }

  // Attention weights averaged over split heads: an all-reduce of each rank's sum where read.
  for (const auto& [n, returned] : pass.returned_weights) {
    const int root = pass.find(returned.region);
    if (pass.regions[root].conflict) continue;
    plan.attention_weights.push_back({n, root, returned.read});
    if (returned.read) comm("forward", "all_reduce", numel(graph.tensor(graph.nodes.at(n).outputs.at(0)).shape));
  }

  // Norms split by heads: the sum of squares all-reduced in forward, the scale's gradient in
  // backward, one value per token each.
  for (const auto& [n, region] : pass.split_norms) {
    const int root = pass.find(region);
    if (pass.regions[root].conflict) continue;
    const auto& out = graph.tensor(graph.nodes.at(n).outputs.at(0)).shape;
    plan.norms.push_back({n, root, out.back()});
    comm("forward", "all_reduce", numel(out) / out.back());
    comm("backward", "all_reduce", numel(out) / out.back());
  }

  // Parameters split with their heads: local parameters, no communication.
  for (const auto& [tensor, region] : pass.head_param_region) {
    const int root = pass.find(region);
    if (pass.regions[root].conflict) continue;
    const AxisFactor& f = pass.head_params.at(tensor);
    plan.head_params.push_back({tensor, graph.tensor(tensor).param, f.axis, f.size, root});
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
    if (l.sequence) {
      layout.coarse = false;
      layout.region = root;
    }
    plan.tensors.push_back(layout);
  }
  return plan;
}

namespace {

void write_string(std::ostringstream& out, const std::string& s) {
  out << '"';
  for (char c : s) {
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\t': out << "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out << "\\u00" << "0123456789abcdef"[(c >> 4) & 0xf] << "0123456789abcdef"[c & 0xf];
        } else {
          out << c;
        }
    }
  }
  out << '"';
}

void write_ints(std::ostringstream& out, const std::vector<int64_t>& values) {
  out << '[';
  for (size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  out << ']';
}

}  // namespace

std::string plan_to_json(const Plan& plan) {
  static const char* styles[] = {"replicate", "column", "column_gather", "row", "vocab"};
  std::ostringstream out;
  out << "{\"version\":1,\"layers\":[";
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerDecision& d = plan.layers[i];
    out << (i ? "," : "") << "{\"node\":" << d.node << ",\"style\":\"" << styles[static_cast<int>(d.style)]
        << "\",\"region\":" << d.region << ",\"units\":" << d.units << ",\"copy_group\":" << d.copy_group
        << ",\"parts\":";
    write_ints(out, d.parts);
    out << ",\"whole_parts\":";
    write_ints(out, d.whole_parts);
    out << ",\"summed_parts\":" << (d.summed_parts ? "true" : "false");
    out << ",\"letter\":";
    write_string(out, d.letter ? std::string(1, static_cast<char>(d.letter)) : std::string());
    out << ",\"repeat\":" << d.repeat << ",\"reason\":";
    write_string(out, d.reason);
    out << ",\"note\":";
    write_string(out, d.note);
    out << ",\"whole_units\":" << d.whole_units << ",\"sequence\":";
    write_string(out, d.sequence);
    out << ",\"sequence_dim\":" << d.sequence_dim << ",\"sequence_region\":" << d.sequence_region
        << ",\"sequence_note\":";
    write_string(out, d.sequence_note);
    out << '}';
  }
  out << "],\"regions\":[";
  for (size_t i = 0; i < plan.regions.size(); ++i) {
    const RegionSummary& r = plan.regions[i];
    out << (i ? "," : "") << "{\"id\":" << r.id << ",\"units\":" << r.units << ",\"localize\":";
    write_ints(out, r.localize);
    out << ",\"repeat\":" << r.repeat << ",\"coarse_units\":" << r.coarse_units << ",\"coarse_localize\":";
    write_ints(out, r.coarse_localize);
    out << '}';
  }
  out << "],\"comm\":[";
  for (size_t i = 0; i < plan.comm.size(); ++i) {
    const CommCount& c = plan.comm[i];
    out << (i ? "," : "") << "{\"phase\":\"" << c.phase << "\",\"kind\":\"" << c.kind << "\",\"count\":" << c.count
        << ",\"elements\":" << c.elements << '}';
  }
  out << "],\"partial_gradients\":[";
  for (size_t i = 0; i < plan.partial.size(); ++i) {
    out << (i ? "," : "") << "{\"params\":";
    write_ints(out, plan.partial[i].params);
    out << ",\"elements\":" << plan.partial[i].elements << '}';
  }
  out << "],\"tensors\":[";
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const TensorLayout& t = plan.tensors[i];
    out << (i ? "," : "") << "{\"tensor\":" << t.tensor << ",\"region\":" << t.region
        << ",\"coarse\":" << (t.coarse ? "true" : "false") << ",\"axis\":" << t.axis << ",\"outer\":" << t.outer
        << ",\"size\":" << t.size << ",\"sequence\":" << (t.sequence ? "true" : "false") << ",\"whole\":" << t.whole
        << '}';
  }
  const auto write_entries = [&out](const char* name, const std::vector<SequenceEntry>& entries) {
    out << "],\"" << name << "\":[";
    for (size_t i = 0; i < entries.size(); ++i) {
      const SequenceEntry& e = entries[i];
      out << (i ? "," : "") << "{\"tensor\":" << e.tensor << ",\"module\":";
      write_string(out, e.module);
      out << ",\"leaf\":" << e.leaf << ",\"dim\":" << e.dim << ",\"region\":" << e.region << '}';
    }
  };
  write_entries("sequence_entries", plan.sequence_entries);
  write_entries("sequence_gathers", plan.sequence_gathers);
  out << "],\"head_entries\":[";
  for (size_t i = 0; i < plan.head_entries.size(); ++i) {
    const HeadEntry& e = plan.head_entries[i];
    out << (i ? "," : "") << "{\"tensor\":" << e.tensor << ",\"module\":";
    write_string(out, e.module);
    out << ",\"leaf\":" << e.leaf << ",\"axis\":" << e.axis << ",\"outer\":" << e.outer << ",\"size\":" << e.size
        << ",\"region\":" << e.region << '}';
  }
  out << "],\"head_outputs\":[";
  for (size_t i = 0; i < plan.head_outputs.size(); ++i) {
    const HeadEntry& e = plan.head_outputs[i];
    out << (i ? "," : "") << "{\"tensor\":" << e.tensor << ",\"module\":";
    write_string(out, e.module);
    out << ",\"axis\":" << e.axis << ",\"outer\":" << e.outer << ",\"size\":" << e.size
        << ",\"region\":" << e.region << '}';
  }
  out << "],\"attention_weights\":[";
  for (size_t i = 0; i < plan.attention_weights.size(); ++i) {
    const AttentionWeightsDecision& w = plan.attention_weights[i];
    out << (i ? "," : "") << "{\"node\":" << w.node << ",\"region\":" << w.region
        << ",\"used\":" << (w.used ? "true" : "false") << '}';
  }
  out << "],\"norms\":[";
  for (size_t i = 0; i < plan.norms.size(); ++i) {
    const NormDecision& d = plan.norms[i];
    out << (i ? "," : "") << "{\"node\":" << d.node << ",\"region\":" << d.region << ",\"features\":" << d.features
        << '}';
  }
  out << "],\"head_params\":[";
  for (size_t i = 0; i < plan.head_params.size(); ++i) {
    const HeadParam& p = plan.head_params[i];
    out << (i ? "," : "") << "{\"tensor\":" << p.tensor << ",\"param\":" << p.param << ",\"axis\":" << p.axis
        << ",\"size\":" << p.size << ",\"region\":" << p.region << '}';
  }
  out << "]}";
  return out.str();
}

}  // namespace autoshard::plan
