#pragma once
// The thresholds and costs behind the decisions taken around a plan, and those decisions: when a
// rank holds too much of the model, when the layers that cannot be paired are gathered instead
// of held whole, and when sequence_parallel="auto" splits the tokens. The Python side measures
// the facts (what each rank holds, the predicted peaks) and asks through the plan_policy op; the
// question and answer formats are described in policy.cpp.
#include <cstdint>
#include <string>

namespace autoshard::plan {

// How much more than 1/N of the parameters a rank may hold before the plan is imbalanced: warned
// of, and planned again with the layers that cannot be paired gathered.
constexpr double kImbalance = 0.10;

// A layer that cannot be paired is gathered rather than held whole from this fraction of the
// model's largest weight outside its vocabulary (1/8): a router or a small gate stays whole.
constexpr int64_t kGatheredLayerDivisor = 8;

// Whether the fullest rank, holding `fullest` of the model's `parameters` elements, holds more
// than 1/world_size + kImbalance of them. Never with one rank or no parameters counted.
bool imbalanced(int64_t fullest, int64_t parameters, int64_t world_size);

// The weight elements from which a layer that cannot be paired is gathered (at least 1).
int64_t gathered_layer_elements(int64_t largest_weight);

// The time of sequence parallelism's reduce-scatter + all-gather pair over the time of the
// all-reduce it replaces, on `backend` at `world_size` ranks; `measured` says whether the backend
// was measured at all.
double pair_cost(const std::string& backend, int64_t world_size, bool* measured = nullptr);

// A JSON question in, a JSON answer out (the plan_policy op).
std::string plan_policy(const std::string& question);

}  // namespace autoshard::plan
