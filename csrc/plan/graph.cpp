#include "plan/graph.h"

#include <unordered_map>

#include <c10/util/Exception.h>

#include "plan/json_reader.h"
#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

using Type = JsonValue::Type;

Kind parse_kind(const std::string& name, const std::string& where) {
  static const std::unordered_map<std::string, Kind> kinds = {
      {"linear", Kind::Linear},       {"embedding", Kind::Embedding}, {"einsum", Kind::Einsum},
      {"view", Kind::View},
      {"permute", Kind::Permute},     {"expand", Kind::Expand},       {"pointwise", Kind::Pointwise},
      {"reduce", Kind::Reduce},       {"matmul", Kind::Matmul},       {"attention", Kind::Attention},
      {"split", Kind::Split},         {"cat", Kind::Cat},             {"slice", Kind::Slice},
      {"source", Kind::Source},       {"opaque", Kind::Opaque},       {"attention_weights", Kind::AttentionWeights},
      {"norm", Kind::Norm},
  };
  auto it = kinds.find(name);
  TORCH_CHECK_VALUE(it != kinds.end(), "[plan.bad_graph] plan: ", where, ": unknown node kind '", name, "'");
  return it->second;
}

// Field readers: each names the record and the field it expected.
const JsonValue& field(const JsonValue& record, const char* name, Type type, const std::string& where) {
  const JsonValue* value = record.find(name);
  TORCH_CHECK_VALUE(value != nullptr, "[plan.bad_graph] plan: ", where, " has no field '", name, "'");
  TORCH_CHECK_VALUE(value->type == type, "[plan.bad_graph] plan: ", where, ": field '", name, "' has the wrong type");
  return *value;
}

int64_t integer(const JsonValue& record, const char* name, const std::string& where) {
  return field(record, name, Type::Int, where).integer;
}

int64_t integer_or(const JsonValue& record, const char* name, int64_t fallback, const std::string& where) {
  return record.find(name) ? integer(record, name, where) : fallback;
}

bool boolean_or(const JsonValue& record, const char* name, bool fallback, const std::string& where) {
  return record.find(name) ? field(record, name, Type::Bool, where).boolean : fallback;
}

template <typename T>
std::vector<T> integers(const JsonValue& record, const char* name, const std::string& where) {
  std::vector<T> out;
  for (const auto& item : field(record, name, Type::Array, where).items) {
    TORCH_CHECK_VALUE(item.type == Type::Int, "[plan.bad_graph] plan: ", where, ": field '", name, "' must hold integers");
    out.push_back(static_cast<T>(item.integer));
  }
  return out;
}

EinsumLetter::Role parse_role(const std::string& name, const std::string& where) {
  if (name == "output") return EinsumLetter::Output;
  if (name == "contracted") return EinsumLetter::Contracted;
  TORCH_CHECK_VALUE(name == "batch", "[plan.bad_graph] plan: ", where, ": unknown einsum letter role '", name, "'");
  return EinsumLetter::Batch;
}

Node parse_node(const JsonValue& record, const std::string& where) {
  TORCH_CHECK_VALUE(record.type == Type::Object, "[plan.bad_graph] plan: ", where, " is not an object");
  Node node;
  node.kind = parse_kind(field(record, "kind", Type::String, where).string, where);
  node.label = field(record, "label", Type::String, where).string;
  node.inputs = integers<int>(record, "inputs", where);
  node.outputs = integers<int>(record, "outputs", where);
  node.trainable = boolean_or(record, "trainable", true, where);
  node.no_grad = boolean_or(record, "no_grad", false, where);
  if (const JsonValue* routing = record.find("routing_floating")) {
    TORCH_CHECK_VALUE(routing->type == Type::Array, "[plan.bad_graph] plan: ", where,
                      ": field 'routing_floating' must be a list");
    for (const auto& item : routing->items) {
      TORCH_CHECK_VALUE(item.type == Type::Bool, "[plan.bad_graph] plan: ", where,
                        ": field 'routing_floating' must hold true or false");
      node.routing_floating.push_back(item.boolean);
    }
  }
  node.summed_bias = integer_or(record, "summed_bias", 0, where);
  node.convolution = boolean_or(record, "convolution", false, where);
  node.functional = boolean_or(record, "functional", false, where);
  node.functional_bias = boolean_or(record, "functional_bias", false, where);
  node.centered = boolean_or(record, "centered", false, where);
  node.per_channel = boolean_or(record, "per_channel", false, where);
  node.running_stats = boolean_or(record, "running_stats", false, where);
  node.weight_elements = integer_or(record, "weight_elements", 0, where);
  switch (node.kind) {
    case Kind::Linear:
      node.in_features = integer(record, "in_features", where);
      node.out_features = integer(record, "out_features", where);
      node.weight_param = integer(record, "weight_param", where);
      node.bias_param = integer_or(record, "bias_param", -1, where);
      if (const JsonValue* adapters = record.find("adapters")) {
        TORCH_CHECK_VALUE(adapters->type == Type::Array, "[plan.bad_graph] plan: ", where, ": 'adapters' must be a list");
        for (const auto& item : adapters->items) {
          const std::string at = where + " adapter";
          AdapterFactors f;
          f.a = integer(item, "a", at);
          f.b = integer(item, "b", at);
          f.a_shape = integers<int64_t>(item, "a_shape", at);
          f.b_shape = integers<int64_t>(item, "b_shape", at);
          TORCH_CHECK_VALUE(f.a_shape.size() == 2 && f.b_shape.size() == 2, "[plan.bad_graph] plan: ", at,
                            ": factors must be 2-D");
          f.a_trainable = boolean_or(item, "a_trainable", true, at);
          f.b_trainable = boolean_or(item, "b_trainable", true, at);
          node.adapters.push_back(std::move(f));
        }
      }
      break;
    case Kind::Embedding:
      node.num_embeddings = integer(record, "num_embeddings", where);
      node.embedding_dim = integer(record, "embedding_dim", where);
      node.weight_param = integer(record, "weight_param", where);
      break;
    case Kind::Einsum:
      node.weight_param = integer(record, "weight_param", where);
      node.bias_param = integer_or(record, "bias_param", -1, where);
      for (const auto& item : field(record, "letters", Type::Array, where).items) {
        const std::string at = where + " letter";
        TORCH_CHECK_VALUE(item.type == Type::Object, "[plan.bad_graph] plan: ", at, " is not an object");
        const std::string& letter = field(item, "letter", Type::String, at).string;
        TORCH_CHECK_VALUE(letter.size() == 1, "[plan.bad_graph] plan: ", at, ": 'letter' must be one character");
        node.letters.push_back({static_cast<int64_t>(letter[0]), parse_role(field(item, "role", Type::String, at).string, at),
                                integer(item, "input_dim", at), integer(item, "output_dim", at)});
        node.letters.back().size = integer_or(item, "size", 0, at);
      }
      break;
    case Kind::Permute: node.permutation = integers<int64_t>(record, "permutation", where); break;
    case Kind::AttentionWeights:
      node.dim = integer(record, "dim", where);
      node.average = field(record, "average", Type::Bool, where).boolean;
      break;
    case Kind::Reduce: node.axes = integers<int64_t>(record, "axes", where); break;
    case Kind::Norm:
      node.weight_param = integer(record, "weight_param", where);
      TORCH_CHECK_VALUE(!node.inputs.empty() && node.inputs.size() <= 3 && node.outputs.size() == 1,
                        "[plan.bad_graph] plan: ", where, ": a norm reads {x[, weight][, bias]} and writes one tensor");
      break;
    case Kind::Split:
      node.dim = integer(record, "dim", where);
      node.drop_dim = boolean_or(record, "drop_dim", false, where);
      break;
    case Kind::Cat: node.dim = integer(record, "dim", where); break;
    case Kind::Slice:
      node.dim = integer(record, "dim", where);
      node.start = integer(record, "start", where);
      node.stop = integer(record, "stop", where);
      node.drop_dim = field(record, "drop_dim", Type::Bool, where).boolean;
      if (record.find("partition") != nullptr) {
        node.partition = integers<int64_t>(record, "partition", where);
        node.part = integer(record, "part", where);
        TORCH_CHECK_VALUE(node.part >= 0 && node.part < static_cast<int64_t>(node.partition.size()),
                          "[plan.bad_graph] plan: ", where, ": 'part' must index 'partition'");
      }
      break;
    case Kind::Pointwise: {
      const JsonValue* narrowing = record.find("narrowing");
      node.narrowing = narrowing != nullptr && narrowing->type == Type::Bool && narrowing->boolean;
      break;
    }
    default: break;
  }
  return node;
}

}  // namespace

Graph parse_graph(const std::string& document) {
  const JsonValue root = parse_json(document);
  TORCH_CHECK_VALUE(root.type == Type::Object, "[plan.bad_graph] plan: the graph document is not an object");
  const int64_t version = integer(root, "version", "the graph document");
  TORCH_CHECK_VALUE(version == 1, "[plan.bad_graph] plan: graph document version ", version,
                    ", this planner reads version 1");
  Graph graph;
  for (const auto& record : field(root, "tensors", Type::Array, "the graph document").items) {
    const std::string where = "tensor " + std::to_string(graph.tensors.size());
    TORCH_CHECK_VALUE(record.type == Type::Object, "[plan.bad_graph] plan: ", where, " is not an object");
    TensorInfo t;
    t.shape = integers<int64_t>(record, "shape", where);
    t.param = static_cast<int>(integer_or(record, "param", -1, where));
    const JsonValue* output = record.find("output");
    t.is_output = output != nullptr && output->type == Type::Bool && output->boolean;
    t.known = true;
    t.floating = boolean_or(record, "floating", true, where);
    t.trainable = boolean_or(record, "trainable", true, where);
    graph.tensors.push_back(std::move(t));
  }
  const int64_t tensor_count = static_cast<int64_t>(graph.tensors.size());
  for (const auto& record : field(root, "nodes", Type::Array, "the graph document").items) {
    const std::string where = "node " + std::to_string(graph.nodes.size());
    Node node = parse_node(record, where);
    for (int id : node.inputs) {
      TORCH_CHECK_VALUE(id >= 0 && id < tensor_count, "[plan.bad_graph] plan: ", where, " reads undeclared tensor ", id);
    }
    for (int id : node.outputs) {
      TORCH_CHECK_VALUE(id >= 0 && id < tensor_count, "[plan.bad_graph] plan: ", where, " writes undeclared tensor ", id);
    }
    graph.nodes.push_back(std::move(node));
  }
  if (const JsonValue* forced = root.find("forced")) {
    TORCH_CHECK_VALUE(forced->type == Type::Array, "[plan.bad_graph] plan: 'forced' must be a list");
    for (const auto& record : forced->items) {
      const std::string where = "override " + std::to_string(graph.forced.size());
      const std::string& style = field(record, "style", Type::String, where).string;
      TORCH_CHECK_VALUE(style == "replicate" || style == "column_gather", "[plan.bad_override] plan: an override must be ",
                        "'replicate' or 'column_gather', got '", style, "'");
      graph.forced.emplace_back(static_cast<int>(integer(record, "node", where)), style);
    }
  }
  if (const JsonValue* observations = root.find("observations")) {
    TORCH_CHECK_VALUE(observations->type == Type::Array, "[plan.bad_graph] plan: 'observations' must be a list");
    for (const auto& record : observations->items) {
      const std::string where = "observation " + std::to_string(graph.observations.size());
      const std::string& kind = field(record, "kind", Type::String, where).string;
      TORCH_CHECK_VALUE(kind == "shape_mismatch" || kind == "dry_run_mismatch", "[plan.bad_graph] plan: ", where,
                        " must be of kind 'shape_mismatch' or 'dry_run_mismatch', got '", kind, "'");
      graph.observations.push_back({static_cast<int>(integer(record, "node", where)), kind,
                                    field(record, "detail", Type::String, where).string});
    }
  }
  graph.gather_unpaired = integer_or(root, "gather_unpaired", 0, "the graph");
  if (root.find("gatherable_params")) {
    for (int64_t param : integers<int64_t>(root, "gatherable_params", "the graph")) graph.gatherable.insert(param);
  }
  if (const JsonValue* sequence = root.find("sequence_parallel")) {
    TORCH_CHECK_VALUE(sequence->type == Type::Bool, "[plan.bad_graph] plan: 'sequence_parallel' must be true or false");
    graph.sequence_parallel = sequence->boolean;
  }
  // Module entries and exits share their fields: a tensor, the call's nodes, its place there.
  const auto module_records = [&](const char* name, const char* one, auto& records) {
    const JsonValue* list = root.find(name);
    if (list == nullptr) return;
    TORCH_CHECK_VALUE(list->type == Type::Array, "[plan.bad_graph] plan: '", name, "' must be a list");
    for (const auto& record : list->items) {
      const std::string where = one + std::to_string(records.size());
      auto& r = records.emplace_back();
      r.tensor = static_cast<int>(integer(record, "tensor", where));
      r.first = static_cast<int>(integer(record, "first", where));
      r.end = static_cast<int>(integer(record, "end", where));
      r.leaf = static_cast<int>(integer(record, "leaf", where));
      r.module = field(record, "module", Type::String, where).string;
      TORCH_CHECK_VALUE(r.tensor >= 0 && r.tensor < tensor_count, "[plan.bad_graph] plan: ", where,
                        " names undeclared tensor ", r.tensor);
    }
  };
  module_records("entries", "entry ", graph.entries);
  module_records("exits", "exit ", graph.exits);
  if (const JsonValue* together = root.find("together")) {
    TORCH_CHECK_VALUE(together->type == Type::Array, "[plan.bad_graph] plan: 'together' must be a list");
    for (const auto& pair : together->items) {
      const bool ok = pair.type == Type::Array && pair.items.size() == 2 && pair.items[0].type == Type::Int &&
                      pair.items[1].type == Type::Int;
      TORCH_CHECK_VALUE(ok, "[plan.bad_graph] plan: 'together' must hold pairs of layer nodes");
      const int64_t first = pair.items[0].integer, second = pair.items[1].integer;
      for (int64_t node : {first, second}) {
        TORCH_CHECK_VALUE(node >= 0 && node < static_cast<int64_t>(graph.nodes.size()) && is_layer(graph.nodes[node]),
                          "[plan.bad_graph] plan: 'together' names node ", node, ", which is not a layer");
      }
      graph.together.emplace_back(static_cast<int>(first), static_cast<int>(second));
    }
  }
  return graph;
}

}  // namespace autoshard::plan
