// The Plan as the JSON document the Python layer reads.
//
// The document (version 2), every record with named fields:
//   {"version": 2,
//    "layers": [{"node", "style", "region", "units", "copy_group", "deferred_copy", "parts", "whole_parts", "summed_parts", "letter", "repeat",
//                "reason", "note", "whole_units", "sequence", "sequence_dim", "sequence_region",
//                "sequence_note"}],
//    "regions": [{"id", "units", "localize", "repeat", "coarse_units", "coarse_localize", "module",
//                 "part_modules"}],
//    "comm": [{"phase", "kind", "count", "elements"}],
//    "partial_gradients": [{"params", "elements"}],
//    "tensors": [{"tensor", "region", "coarse", "axis", "outer", "size", "sequence", "whole",
//                 "repeat_axis" (only where there is one)}],
//    "sequence_entries": [{"tensor", "module", "leaf", "dim", "region"}],
//    "sequence_gathers": [{"tensor", "module", "leaf", "dim", "region"}],
//    "sequence_exits": [{"tensor", "module", "leaf", "dim", "region"}],
//    "head_entries": [{"tensor", "module", "leaf", "axis", "outer", "size", "region"}],
//    "head_outputs": [{"tensor", "module", "axis", "outer", "size", "region"}],
//    "attention_weights": [{"node", "region", "used"}],
//    "head_params": [{"tensor", "param", "axis", "size", "region", "layer", "parts"}],
//    "gathered_params": [{"tensor", "param", "axis", "size", "elements"}],
//    "norms": [{"node", "region", "features"}],
//    "adapters": [{"node", "split", "whole"}],
//    "summed_outputs": [{"node", "elements"}]}
// A layer's "sequence" is "reduce_scatter", "gather" (inside the layer), "gathered" (where a
// module receives or returns its input) or "". Version 1 left the gathers before ops indexing
// the token axis (sequence_exits) and the module inputs whose length may be read to the Python
// layer; a version 1 answer lacks them, so it is not read as version 2.
#include <sstream>

#include "plan/planner.h"

namespace autoshard::plan {

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
  static const char* styles[] = {"replicate", "column", "column_gather", "row", "vocab", "batch"};
  std::ostringstream out;
  out << "{\"version\":2,\"layers\":[";
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerDecision& d = plan.layers[i];
    out << (i ? "," : "") << "{\"node\":" << d.node << ",\"style\":\"" << styles[static_cast<int>(d.style)]
        << "\",\"region\":" << d.region << ",\"units\":" << d.units << ",\"copy_group\":" << d.copy_group
        << ",\"deferred_copy\":" << (d.deferred_copy ? "true" : "false") << ",\"parts\":";
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
    out << ",\"module\":";
    write_string(out, r.module);
    out << ",\"part_modules\":[";
    for (size_t k = 0; k < r.part_modules.size(); ++k) {
      if (k) out << ",";
      write_string(out, r.part_modules[k]);
    }
    out << "]";
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
        << ",\"size\":" << t.size << ",\"sequence\":" << (t.sequence ? "true" : "false") << ",\"whole\":" << t.whole;
    if (t.repeat_axis >= 0) out << ",\"repeat_axis\":" << t.repeat_axis;
    out << '}';
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
  write_entries("sequence_exits", plan.sequence_exits);
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
        << ",\"size\":" << p.size << ",\"region\":" << p.region << ",\"layer\":" << p.layer << ",\"parts\":[";
    for (size_t k = 0; k < p.parts.size(); ++k) out << (k ? "," : "") << p.parts[k];
    out << "]}";
  }
  out << "],\"gathered_params\":[";
  for (size_t i = 0; i < plan.gathered_params.size(); ++i) {
    const GatheredParam& p = plan.gathered_params[i];
    out << (i ? "," : "") << "{\"tensor\":" << p.tensor << ",\"param\":" << p.param << ",\"axis\":" << p.axis
        << ",\"size\":" << p.size << ",\"elements\":" << p.elements << '}';
  }
  out << "],\"adapters\":[";
  for (size_t i = 0; i < plan.adapters.size(); ++i) {
    const AdapterDecision& a = plan.adapters[i];
    out << (i ? "," : "") << "{\"node\":" << a.node << ",\"split\":";
    write_ints(out, a.split);
    out << ",\"whole\":";
    write_ints(out, a.whole);
    out << '}';
  }
  out << "],\"summed_outputs\":[";
  for (size_t i = 0; i < plan.summed_outputs.size(); ++i) {
    out << (i ? "," : "") << "{\"node\":" << plan.summed_outputs[i].first << ",\"elements\":"
        << plan.summed_outputs[i].second << '}';
  }
  out << "]}";
  return out.str();
}

}  // namespace autoshard::plan
