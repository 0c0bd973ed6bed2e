// The policy's numbers and rules, and the plan_policy op that answers questions about them.
//
// A question is a JSON object naming what it asks in "ask", with the facts as integers, strings
// and booleans (parameter counts are in elements, memory in bytes per rank):
//   {"ask": "imbalance", "world_size", "parameters", "fullest"}
//       -> {"imbalanced": bool, "limit": float (the largest fraction a rank may hold)}
//   {"ask": "gather_unpaired", "world_size", "parameters", "fullest", "largest_weight",
//    "gathered_fullest" (optional)}
//       -> {"need": "gathered_fullest", "gather_unpaired": int, "why"}: plan again with the layers
//          of at least gather_unpaired weight elements that cannot be paired gathered, and ask
//          again with what its fullest rank holds;
//       -> {"keep": "fewest_collectives" | "gathered", "why"}
//   {"ask": "pair_cost", "backend", "world_size"} -> {"pair_cost": float, "measured": bool}
//   {"ask": "sequence_parallel", "backend", "world_size", "token_wise_region": bool,
//    "memory_budget": int | null, "peak_without" (optional), "peak_with" (optional)}
//       -> {"need": "peak_without" | "peak_with"}: ask again with that predicted peak added;
//       -> {"sequence_parallel": bool, "why"}
// "fullest" is what the rank holding the most holds, of the model's "parameters"; "largest_weight"
// the model's largest weight outside its vocabulary (token tables, and a head over them, are split
// anyway); the peaks are a training step's predicted peaks on the fullest rank without and with
// sequence parallelism. A field missing, of the wrong type, out of range or not read for that
// question is refused with the field's name; an answer naming a "need" is asked again with it.
#include "plan/policy.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <optional>
#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

#include "plan/json_reader.h"

namespace autoshard::plan {
namespace {

// The reduce-scatter + all-gather pair's time over the all-reduce's, at two ranks and at more.
// NCCL's pair moves the bytes the all-reduce moves and costs about what it costs. On gloo
// (autoshard's rings, benchmarks/bench_sequence_collectives.py) the pair costs 0.8-1.0x the
// all-reduce at 2 ranks and 1.0-1.15x at 4.
struct PairCosts {
  const char* backend;
  double at_two_ranks;
  double at_more;
};
constexpr PairCosts kPairCosts[] = {{"nccl", 1.0, 1.0}, {"gloo", 0.9, 1.05}};

double fraction(int64_t held, int64_t parameters) {
  return static_cast<double>(held) / static_cast<double>(parameters);
}

double imbalance_limit(int64_t world_size) { return 1.0 / static_cast<double>(world_size) + kImbalance; }

std::string formatted(const char* format, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

// Bytes as the plan's printout writes them: two decimals of the largest binary unit reached.
std::string size_words(int64_t bytes) {
  constexpr std::pair<const char*, int64_t> kUnits[] = {{"GiB", int64_t{1} << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}};
  for (const auto& [unit, scale] : kUnits) {
    if (bytes >= scale) return formatted("%.2f ", static_cast<double>(bytes) / static_cast<double>(scale)) + unit;
  }
  return std::to_string(bytes) + " B";
}

std::string percent(double value) { return formatted("%.1f%%", 100.0 * value); }

// The question's fields, each read once by name; what is missing, mistyped or never read is an
// error naming the field.
class Question {
 public:
  Question(const JsonValue& root, std::vector<std::string> fields) : root_(root), fields_(std::move(fields)) {
    for (const auto& [name, value] : root_.fields) {
      TORCH_CHECK_VALUE(name == "ask" || std::find(fields_.begin(), fields_.end(), name) != fields_.end(),
                        "plan_policy: a question \"", ask(), "\" has no field \"", name, "\"");
    }
  }

  std::string ask() const { return root_.find("ask")->string; }

  std::optional<int64_t> optional_integer(const std::string& name, int64_t minimum) const {
    const JsonValue* value = root_.find(name);
    if (value == nullptr || value->type == JsonValue::Type::Null) return std::nullopt;
    TORCH_CHECK_VALUE(value->type == JsonValue::Type::Int && value->integer >= minimum, "plan_policy: field \"", name,
                      "\" of a question \"", ask(), "\" must be an integer of at least ", minimum);
    return value->integer;
  }

  int64_t integer(const std::string& name, int64_t minimum) const {
    std::optional<int64_t> value = optional_integer(name, minimum);
    TORCH_CHECK_VALUE(value.has_value(), "plan_policy: a question \"", ask(), "\" needs the field \"", name, "\"");
    return *value;
  }

  const std::string& string(const std::string& name) const {
    const JsonValue* value = present(name);
    TORCH_CHECK_VALUE(value->type == JsonValue::Type::String, "plan_policy: field \"", name, "\" of a question \"",
                      ask(), "\" must be a string");
    return value->string;
  }

  bool boolean(const std::string& name) const {
    const JsonValue* value = present(name);
    TORCH_CHECK_VALUE(value->type == JsonValue::Type::Bool, "plan_policy: field \"", name, "\" of a question \"",
                      ask(), "\" must be true or false");
    return value->boolean;
  }

 private:
  const JsonValue& root_;
  std::vector<std::string> fields_;

  const JsonValue* present(const std::string& name) const {
    const JsonValue* value = root_.find(name);
    TORCH_CHECK_VALUE(value != nullptr, "plan_policy: a question \"", ask(), "\" needs the field \"", name, "\"");
    return value;
  }
};

class Answer {
 public:
  Answer& add(const std::string& name, bool value) { return raw(name, value ? "true" : "false"); }
  Answer& add(const std::string& name, int64_t value) { return raw(name, std::to_string(value)); }
  Answer& add(const std::string& name, double value) {
    // The shortest text that reads back as the same double.
    char text[32];
    const auto end = std::to_chars(text, text + sizeof(text), value).ptr;
    return raw(name, std::string(text, end));
  }
  Answer& add(const std::string& name, const std::string& value) { return raw(name, quoted(value)); }
  Answer& add(const std::string& name, const char* value) { return add(name, std::string(value)); }

  std::string json() const { return "{" + body_.str() + "}"; }

 private:
  std::ostringstream body_;
  bool first_ = true;

  Answer& raw(const std::string& name, const std::string& text) {
    body_ << (first_ ? "" : ",") << quoted(name) << ':' << text;
    first_ = false;
    return *this;
  }

  static std::string quoted(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        out += "\\u00";
        out += "0123456789abcdef"[(c >> 4) & 0xf];
        out += "0123456789abcdef"[c & 0xf];
      } else {
        out += c;
      }
    }
    return out + '"';
  }
};

std::string imbalance(const Question& q) {
  const int64_t world_size = q.integer("world_size", 1);
  const int64_t parameters = q.integer("parameters", 0);
  const int64_t fullest = q.integer("fullest", 0);
  return Answer()
      .add("imbalanced", imbalanced(fullest, parameters, world_size))
      .add("limit", imbalance_limit(world_size))
      .json();
}

// The fewest collectives first (Megatron's pairs, what cannot be paired held whole); where that
// leaves a rank more than its share plus kImbalance, the large layers that cannot be paired are
// split and their outputs gathered instead, kept only if that leaves the fullest rank less.
std::string gather_unpaired(const Question& q) {
  const int64_t world_size = q.integer("world_size", 1);
  const int64_t parameters = q.integer("parameters", 0);
  const int64_t fullest = q.integer("fullest", 0);
  const int64_t largest_weight = q.integer("largest_weight", 0);
  const std::optional<int64_t> gathered_fullest = q.optional_integer("gathered_fullest", 0);
  const std::string limit = "1/" + std::to_string(world_size) + " + " + percent(kImbalance);
  if (!imbalanced(fullest, parameters, world_size)) {
    return Answer()
        .add("keep", "fewest_collectives")
        .add("why", "with the fewest collectives the fullest rank holds " +
                        (parameters > 0 ? percent(fraction(fullest, parameters)) : std::string("none")) +
                        " of the parameters, not more than " + limit)
        .json();
  }
  const std::string over = "with the fewest collectives the fullest rank holds " +
                           percent(fraction(fullest, parameters)) + " of the parameters, more than " + limit;
  if (!gathered_fullest.has_value()) {
    const int64_t elements = gathered_layer_elements(largest_weight);
    return Answer()
        .add("need", "gathered_fullest")
        .add("gather_unpaired", elements)
        .add("why", over + ": planned again with the layers of at least " + std::to_string(elements) +
                        " weight elements that cannot be paired gathered")
        .json();
  }
  const bool better = fraction(*gathered_fullest, parameters) < fraction(fullest, parameters);
  return Answer()
      .add("keep", better ? "gathered" : "fewest_collectives")
      .add("why", over + "; with the layers that cannot be paired gathered it holds " +
                      percent(fraction(*gathered_fullest, parameters)) + (better ? ", kept" : ", not fewer: not kept"))
      .json();
}

std::string pair_cost_answer(const Question& q) {
  bool measured = false;
  const double cost = pair_cost(q.string("backend"), q.integer("world_size", 1), &measured);
  return Answer().add("pair_cost", cost).add("measured", measured).json();
}

// Sequence parallelism replaces a row layer's all-reduce by a reduce-scatter and the next column
// layers' input copy by an all-gather, and holds 1/N of the activations between layers: on
// where the pair costs no more than the all-reduce; on a costlier backend only where memory needs
// it, which only a memory budget says.
std::string sequence_parallel(const Question& q) {
  const std::string& backend = q.string("backend");
  const int64_t world_size = q.integer("world_size", 1);
  const bool token_wise_region = q.boolean("token_wise_region");
  const std::optional<int64_t> budget = q.optional_integer("memory_budget", 1);
  const std::optional<int64_t> peak_without = q.optional_integer("peak_without", 0);
  const std::optional<int64_t> peak_with = q.optional_integer("peak_with", 0);
  auto decided = [](bool on, const std::string& why) {
    return Answer().add("sequence_parallel", on).add("why", why).json();
  };
  if (!token_wise_region) {
    return decided(false,
                   "sequence parallelism: none possible (no token-wise region between a row and a column layer)");
  }
  const double cost = pair_cost(backend, world_size);
  const std::string pair = "on " + backend + " at " + std::to_string(world_size) +
                           " ranks its reduce-scatter + all-gather cost " + formatted("%g", cost) +
                           "x the all-reduce they replace";
  if (cost <= 1.0) {
    return decided(true, "sequence parallelism on: " + pair + ", and the activations between layers are 1/" +
                             std::to_string(world_size) + " per rank");
  }
  if (!budget.has_value()) {
    return decided(false, "sequence parallelism off: " + pair +
                              " (benchmarks/bench_sequence_collectives.py); give memory_budget= to have it where "
                              "memory needs it");
  }
  if (!peak_without.has_value()) return Answer().add("need", "peak_without").json();
  const std::string within = "the memory budget of " + size_words(*budget) + " per rank";
  const std::string without = "without it the step's predicted peak, " + size_words(*peak_without) + " per rank, ";
  if (*peak_without <= *budget) {
    return decided(false, "sequence parallelism off: " + without + "is within " + within + ", and " + pair);
  }
  if (!peak_with.has_value()) return Answer().add("need", "peak_with").json();
  const std::string fits =
      *peak_with <= *budget ? "within it" : "still over it: more ranks or a smaller batch are needed";
  return decided(true, "sequence parallelism on: " + without + "exceeds " + within + "; with it " +
                           size_words(*peak_with) + ", " + fits);
}

}  // namespace

bool imbalanced(int64_t fullest, int64_t parameters, int64_t world_size) {
  if (world_size <= 1 || parameters <= 0) return false;
  return fraction(fullest, parameters) > imbalance_limit(world_size);
}

int64_t gathered_layer_elements(int64_t largest_weight) {
  return std::max<int64_t>(1, largest_weight / kGatheredLayerDivisor);
}

double pair_cost(const std::string& backend, int64_t world_size, bool* measured) {
  double costliest = 0.0;
  for (const PairCosts& costs : kPairCosts) {
    if (backend == costs.backend) {
      if (measured != nullptr) *measured = true;
      return world_size <= 2 ? costs.at_two_ranks : costs.at_more;
    }
    costliest = std::max({costliest, costs.at_two_ranks, costs.at_more});
  }
  // An unmeasured backend's pair is never assumed cheaper than the costliest measured.
  if (measured != nullptr) *measured = false;
  return costliest;
}

std::string plan_policy(const std::string& question) {
  const JsonValue root = parse_json(question, "plan_policy: the question");
  TORCH_CHECK_VALUE(root.type == JsonValue::Type::Object, "plan_policy: the question must be a JSON object");
  const JsonValue* ask = root.find("ask");
  TORCH_CHECK_VALUE(ask != nullptr && ask->type == JsonValue::Type::String,
                    "plan_policy: the question needs the field \"ask\", a string");
  if (ask->string == "imbalance") return imbalance(Question(root, {"world_size", "parameters", "fullest"}));
  if (ask->string == "gather_unpaired") {
    return gather_unpaired(
        Question(root, {"world_size", "parameters", "fullest", "largest_weight", "gathered_fullest"}));
  }
  if (ask->string == "pair_cost") return pair_cost_answer(Question(root, {"backend", "world_size"}));
  TORCH_CHECK_VALUE(ask->string == "sequence_parallel",
                    "plan_policy: field \"ask\" must be \"imbalance\", \"gather_unpaired\", \"pair_cost\" or "
                    "\"sequence_parallel\", got \"", ask->string, "\"");
  return sequence_parallel(
      Question(root, {"backend", "world_size", "token_wise_region", "memory_budget", "peak_without", "peak_with"}));
}

}  // namespace autoshard::plan
