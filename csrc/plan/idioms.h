#pragma once
// Idioms a model writes that keep a layer whole, named in its note (idioms.cpp).
#include <string>

#include "plan/graph.h"
#include "plan/planner.h"

namespace autoshard::plan {

// Adds to the notes of layers held whole for an idiom the model wrote (an unbind of a fused
// q/k/v, its own loss, adaptive-norm modulation) the idiom's words.
void explain_idioms(const Graph& graph, Plan& plan);

// The words for an idiom (reasons.cpp, beside the reason codes' words): "unbind", "own_loss" or
// "modulation"; an unknown name is a planner bug (TORCH_CHECK).
const std::string& idiom_text(const std::string& idiom);

}  // namespace autoshard::plan
