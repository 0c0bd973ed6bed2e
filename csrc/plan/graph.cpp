#include "plan/graph.h"

#include <sstream>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace autoshard::plan {
namespace {

Kind parse_kind(const std::string& name) {
  static const std::unordered_map<std::string, Kind> kinds = {
      {"linear", Kind::Linear},       {"embedding", Kind::Embedding}, {"einsum", Kind::Einsum},
      {"view", Kind::View},
      {"permute", Kind::Permute},     {"expand", Kind::Expand},       {"pointwise", Kind::Pointwise},
      {"reduce", Kind::Reduce},       {"matmul", Kind::Matmul},       {"attention", Kind::Attention},
      {"split", Kind::Split},         {"cat", Kind::Cat},             {"slice", Kind::Slice},
      {"source", Kind::Source},       {"opaque", Kind::Opaque},
  };
  auto it = kinds.find(name);
  TORCH_CHECK_VALUE(it != kinds.end(), "[plan.bad_graph] plan: unknown node kind '", name, "' in the graph");
  return it->second;
}

template <typename T>
std::vector<T> read_list(std::istringstream& in, const char* expected, int line) {
  std::string word;
  in >> word;
  TORCH_CHECK_VALUE(word == expected, "[plan.bad_graph] plan: graph line ", line, ": expected '", expected, "', got '", word, "'");
  size_t count = 0;
  in >> count;
  std::vector<T> values(count);
  for (auto& v : values) in >> v;
  TORCH_CHECK_VALUE(!in.fail(), "[plan.bad_graph] plan: graph line ", line, ": malformed '", expected, "' list");
  return values;
}

}  // namespace

Graph parse_graph(const std::string& text) {
  Graph graph;
  std::istringstream lines(text);
  std::string line;
  int number = 0;
  auto tensor_slot = [&](int id) -> TensorInfo& {
    TORCH_CHECK_VALUE(id >= 0, "[plan.bad_graph] plan: negative tensor id ", id);
    if (static_cast<size_t>(id) >= graph.tensors.size()) graph.tensors.resize(id + 1);
    return graph.tensors[id];
  };
  while (std::getline(lines, line)) {
    ++number;
    if (line.empty()) continue;
    std::istringstream in(line);
    std::string record;
    in >> record;
    if (record == "tensor") {
      int id = 0;
      size_t ndim = 0;
      in >> id >> ndim;
      TensorInfo& t = tensor_slot(id);
      t.shape.resize(ndim);
      for (auto& s : t.shape) in >> s;
      t.known = true;
    } else if (record == "param") {
      int id = 0, index = 0;
      in >> id >> index;
      tensor_slot(id).param = index;
    } else if (record == "output") {
      int id = 0;
      in >> id;
      tensor_slot(id).is_output = true;
    } else if (record == "node") {
      std::string kind;
      Node node;
      in >> kind >> node.label;
      node.kind = parse_kind(kind);
      node.inputs = read_list<int>(in, "in", number);
      node.outputs = read_list<int>(in, "out", number);
      node.args = read_list<int64_t>(in, "args", number);
      for (int id : node.inputs) TORCH_CHECK_VALUE(tensor_slot(id).known, "[plan.bad_graph] plan: graph line ", number, " reads undeclared tensor ", id);
      for (int id : node.outputs) TORCH_CHECK_VALUE(tensor_slot(id).known, "[plan.bad_graph] plan: graph line ", number, " writes undeclared tensor ", id);
      graph.nodes.push_back(std::move(node));
    } else if (record == "force") {
      int node = 0;
      std::string style;
      in >> node >> style;
      TORCH_CHECK_VALUE(style == "replicate" || style == "column_gather", "[plan.bad_override] plan: an override must be 'replicate' or ",
                        "'column_gather', got '", style, "'");
      graph.forced.emplace_back(node, style);
    } else if (record == "entry") {
      ModuleEntry e;
      in >> e.tensor >> e.first >> e.end >> e.leaf >> e.module;
      TORCH_CHECK_VALUE(!in.fail() && tensor_slot(e.tensor).known, "[plan.bad_graph] plan: graph line ", number,
                        " names an undeclared tensor");
      graph.entries.push_back(e);
    } else if (record == "sequence") {
      std::string value;
      in >> value;
      TORCH_CHECK_VALUE(value == "on" || value == "off", "[plan.bad_graph] plan: graph line ", number,
                        ": 'sequence' must be 'on' or 'off', got '", value, "'");
      graph.sequence_parallel = value == "on";
    } else {
      TORCH_CHECK_VALUE(false, "[plan.bad_graph] plan: graph line ", number, ": unknown record '", record, "'");
    }
    TORCH_CHECK_VALUE(!in.fail(), "[plan.bad_graph] plan: graph line ", number, " is malformed: ", line);
  }
  return graph;
}

}  // namespace autoshard::plan
