#pragma once
// Which tensors a backward pass reaches. The planner counts a backward collective for each
// tensor a column layer copies or gathers, each tensor sequence parallelism cuts on entering a
// module, each embedding output cut to the ranks' heads and each partial-gradient bucket;
// autograd runs none of them for a tensor that needs no gradient, so neither does the count.
//
// A tensor needs one when two things hold. It requires one: a trainable parameter, or a
// tensor that requires one, reaches it (integer and bool tensors never do; a layer's output
// does when any parameter of its module is trainable, as a LoRA layer's factors beside a
// frozen base weight). And it reaches a model output, where the backward pass starts: a layer
// whose output the model computes and drops (a pooler under a language-model head) is never
// reached, nor one whose output reaches the model's outputs only through integer or bool
// tensors (scores whose top-k indices pick what attention reads). Reaching is taken without
// regard to the order of the ops, and a view and its base reach alike (an in-place op on either
// changes what the other holds, which the recorded ops do not show). Ops are taken as
// differentiable, so that a tensor is found to need no gradient only where none can reach it:
// counts drop only where nothing runs.
#include <vector>

#include "plan/graph.h"

namespace autoshard::plan {

struct GradientFlow {
  std::vector<bool> requires_grad;  // per tensor
  std::vector<bool> reaches_output;  // per tensor

  bool needs(int tensor) const { return requires_grad.at(tensor) && reaches_output.at(tensor); }
};

GradientFlow gradient_flow(const Graph& graph);

}  // namespace autoshard::plan
