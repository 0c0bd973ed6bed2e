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
//    and then each construct's records under its kind, every kind present, [] when it has none,
//    written from the records its file under constructs/ makes:
//    "sequence_entries", "sequence_gathers", "sequence_exits" (constructs/sequence_cuts.cpp):
//        [{"tensor", "module", "leaf", "dim", "region"}],
//    "head_entries": [{"tensor", "module", "leaf", "axis", "outer", "size", "region"}] and
//    "head_outputs": [{"tensor", "module", "axis", "outer", "size", "region"}]
//        (constructs/head_cuts.cpp),
//    "attention_weights": [{"node", "region", "used"}] (constructs/attention_weights.cpp),
//    "norms": [{"node", "region", "features"}] (constructs/norms.cpp),
//    "summed_outputs": [{"node", "elements"}] (constructs/summed_outputs.cpp),
//    "head_params": [{"tensor", "param", "axis", "size", "region", "layer", "parts"}]
//        (constructs/head_params.cpp),
//    "gathered_params": [{"tensor", "param", "axis", "size", "elements"}]
//        (constructs/gathered_params.cpp),
//    "adapters": [{"node", "split", "whole"}] (constructs/adapters.cpp)}
// A layer's "sequence" is "reduce_scatter", "gather" (inside the layer), "gathered" (where a
// module receives or returns its input) or "". Version 1 left the gathers before ops indexing
// the token axis (sequence_exits) and the module inputs whose length may be read to the Python
// layer; a version 1 answer lacks them, so it is not read as version 2.
#include <algorithm>
#include <sstream>
#include <type_traits>
#include <variant>

#include <c10/util/Exception.h>

#include "plan/constructs/registry.h"
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

void write_value(std::ostringstream& out, const FieldValue& value) {
  std::visit(
      [&out](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          out << v;
        } else if constexpr (std::is_same_v<T, bool>) {
          out << (v ? "true" : "false");
        } else if constexpr (std::is_same_v<T, std::string>) {
          write_string(out, v);
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          write_ints(out, v);
        } else {
          out << '[';
          for (size_t i = 0; i < v.size(); ++i) {
            if (i) out << ',';
            write_string(out, v[i]);
          }
          out << ']';
        }
      },
      value);
}

// Every registered kind, in the registry's order, each one's records as objects of their fields
// in the order the construct gave them; a kind with none as [], since Python reads some kinds
// without a default.
void write_records(std::ostringstream& out, const RecordsByKind& records) {
  for (const auto& [kind, list] : records) {
    const auto& kinds = record_kinds();
    const bool registered = std::any_of(kinds.begin(), kinds.end(), [&](const RecordKind& k) { return kind == k.kind; });
    TORCH_CHECK(registered, "[plan.internal] records of the unregistered kind ", kind);
  }
  for (const RecordKind& kind : record_kinds()) {
    out << ',';
    write_string(out, kind.kind);
    out << ":[";
    const auto found = records.find(kind.kind);
    const std::vector<Record> none;
    const std::vector<Record>& list = found == records.end() ? none : found->second;
    for (size_t i = 0; i < list.size(); ++i) {
      out << (i ? ",{" : "{");
      const std::vector<Field>& fields = list[i].fields();
      for (size_t k = 0; k < fields.size(); ++k) {
        if (k) out << ',';
        write_string(out, fields[k].name);
        out << ':';
        write_value(out, fields[k].value);
      }
      out << '}';
    }
    out << ']';
  }
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
  out << ']';
  write_records(out, plan.records);
  out << '}';
  return out.str();
}

}  // namespace autoshard::plan
