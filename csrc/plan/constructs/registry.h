#pragma once
// The constructs' records: each construct's file here registers the kinds of record it makes, with
// the function making them from the settled pass, so that emit_plan (emit.cpp) and the document's
// writer (emit_json.cpp) handle every construct alike and a new construct touches its own file
// only.
//
//   namespace {
//   void make_norms(const ConstructInput& in, Plan& plan) {
//     ... plan.records["norms"].push_back(record); in.count(plan, "forward", "all_reduce", n);
//   }
//   const bool registered = register_record_kind({"norms", 60, make_norms});
//   }
#include <cstdint>
#include <vector>

#include "plan/gradient_flow.h"
#include "plan/planner.h"
#include "plan/propagation.h"

namespace autoshard::plan {

// What a construct's records are made from: the settled pass over the graph.
struct ConstructInput {
  const Graph& graph;
  Propagation& pass;  // not const: its find() shortens the paths it walks
  const GradientFlow& flow;
  int64_t world_size;
  int64_t bucket_elements;  // partial gradients are summed in buckets of at most this many elements

  // One more collective in the plan's counts; a group of one rank, or a collective over no
  // elements, communicates nothing.
  void count(Plan& plan, const char* phase, const char* kind, int64_t elements) const;
  // A tensor's elements at the graph's example shapes, as collectives are counted.
  int64_t elements(int tensor) const;
};

using MakeRecords = void (*)(const ConstructInput& input, Plan& plan);

struct RecordKind {
  const char* kind;  // the document's key, the one the Python construct reads
  // Makers run by order, and the document lists the kinds so: the plan's counts list each
  // collective where it is first counted, which the order keeps as it was.
  int order;
  // Appends the kind's records to plan.records[kind], counting their collectives; nullptr for a
  // kind made after the plan is settled, by the rules of plan_model (replan.cpp).
  MakeRecords make;
};

// Called once per kind, from the construct file's static initializer; returns true.
bool register_record_kind(RecordKind kind);

// Every registered kind, by order.
const std::vector<RecordKind>& record_kinds();

// Gives `plan` every kind's records, an empty list for a kind with none.
void make_construct_records(const ConstructInput& input, Plan& plan);

}  // namespace autoshard::plan
