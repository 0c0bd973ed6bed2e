#pragma once
// The small part of JSON the planner reads (its graph document): objects, arrays, integers,
// strings, true, false and null. Errors name the document as `document` says (by default the
// graph document, with the planner's bad-graph code).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace autoshard::plan {

struct JsonValue {
  enum class Type { Null, Bool, Int, String, Array, Object };
  Type type = Type::Null;
  bool boolean = false;
  int64_t integer = 0;
  std::string string;
  std::vector<JsonValue> items;                             // Array
  std::vector<std::pair<std::string, JsonValue>> fields;  // Object, in document order

  // The field `name` of an object, or nullptr.
  const JsonValue* find(const std::string& name) const;
};

JsonValue parse_json(const std::string& text,
                     const std::string& document = "[plan.bad_graph] plan: the graph document");

}  // namespace autoshard::plan
