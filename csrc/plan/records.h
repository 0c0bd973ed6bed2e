#pragma once
// A construct's records: what the planner tells the Python construct of that kind, written under
// the kind's key of the plan document (emit_json.cpp) and read there by the construct's
// read(answer, reading). A record is an ordered list of named fields, so a construct adds its
// records, and fields to them, without the plan's types or the document's writer knowing them.
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace autoshard::plan {

using FieldValue = std::variant<int64_t, bool, std::string, std::vector<int64_t>, std::vector<std::string>>;

struct Field {
  std::string name;
  FieldValue value;
};

class Record {
 public:
  // Integers of every width are stored as int64: a bare int would otherwise convert to bool as
  // readily as to int64.
  template <typename Integer, std::enable_if_t<std::is_integral_v<Integer> && !std::is_same_v<Integer, bool>, int> = 0>
  Record& add(std::string name, Integer value) {
    return put(std::move(name), static_cast<int64_t>(value));
  }
  Record& add(std::string name, bool value) { return put(std::move(name), value); }
  Record& add(std::string name, std::string value) { return put(std::move(name), std::move(value)); }
  // A string literal would otherwise become a bool.
  Record& add(std::string name, const char* value) { return put(std::move(name), std::string(value)); }
  Record& add(std::string name, std::vector<int64_t> values) { return put(std::move(name), std::move(values)); }
  Record& add(std::string name, std::vector<std::string> values) { return put(std::move(name), std::move(values)); }

  const std::vector<Field>& fields() const { return fields_; }

 private:
  Record& put(std::string name, FieldValue value) {
    fields_.push_back({std::move(name), std::move(value)});
    return *this;
  }
  std::vector<Field> fields_;
};

// Every construct's records under its kind, the document's key ("norms"); the kinds are those the
// construct files register (constructs/registry.h).
using RecordsByKind = std::map<std::string, std::vector<Record>>;

}  // namespace autoshard::plan
