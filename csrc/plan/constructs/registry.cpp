#include "plan/constructs/registry.h"

#include <algorithm>
#include <string>

#include <c10/util/Exception.h>

#include "plan/emit.h"

namespace autoshard::plan {
namespace {

// Filled by the construct files' static initializers, which run before any plan is made; kept
// behind a function so that it exists before the first of them.
std::vector<RecordKind>& kinds() {
  static std::vector<RecordKind> registered;
  return registered;
}

}  // namespace

void ConstructInput::count(Plan& plan, const char* phase, const char* kind, int64_t elements) const {
  if (world_size == 1 || elements == 0) return;
  count_collective(plan, phase, kind, elements);
}

int64_t ConstructInput::elements(int tensor) const {
  int64_t n = 1;
  for (int64_t size : graph.tensor(tensor).shape) n *= size;
  return n;
}

bool register_record_kind(RecordKind kind) {
  std::vector<RecordKind>& all = kinds();
  for (const RecordKind& known : all) {
    TORCH_CHECK(std::string(known.kind) != kind.kind, "[plan.internal] record kind ", kind.kind, " registered twice");
    // Two kinds of one order would run in the order the library's files happen to load.
    TORCH_CHECK(known.order != kind.order, "[plan.internal] record kinds ", known.kind, " and ", kind.kind,
                " share the order ", kind.order);
  }
  const auto at = std::upper_bound(all.begin(), all.end(), kind,
                                   [](const RecordKind& a, const RecordKind& b) { return a.order < b.order; });
  all.insert(at, kind);
  return true;
}

const std::vector<RecordKind>& record_kinds() {
  return kinds();
}

void make_construct_records(const ConstructInput& input, Plan& plan) {
  for (const RecordKind& kind : record_kinds()) {
    plan.records[kind.kind];
    if (kind.make != nullptr) kind.make(input, plan);
  }
}

}  // namespace autoshard::plan
