// The planner's answer: a settled plan (settle.cpp), judged by the rules that need the module
// calls around its sequence regions (sequence_rules.h), and planned again until they hold:
//   - column layers reading tokens through an op indexing the token axis get them gathered
//     where a module returns them; where no module can, sequence parallelism is given up for
//     the whole model, and every row layer's note says why (token_indexing.cpp);
//   - inputs whose token count a module may read stay whole, each behind a reader the sequence
//     regions do not pass (length_reads.cpp).
// Readers once added stay, so the rounds end: each adds one or more, of finitely many entries.
#include <algorithm>

#include "plan/idioms.h"
#include "plan/sequence_rules.h"

namespace autoshard::plan {

Plan plan_model(Graph graph, int64_t world_size) {
  std::string given_up;  // why sequence parallelism was given up, if it was
  std::vector<LengthRead> kept_whole;
  for (;;) {
    Plan plan = make_plan(graph, world_size);
    if (const auto refusal = gather_before_token_indexing(graph, plan)) {
      given_up = *refusal;
      graph.sequence_parallel = false;
      continue;
    }
    std::vector<LengthRead> reads;
    for (const LengthRead& read : split_inputs_gathered_inside(graph, plan)) {
      if (std::find(kept_whole.begin(), kept_whole.end(), read) == kept_whole.end()) reads.push_back(read);
    }
    if (!reads.empty()) {
      add_length_readers(graph, reads);
      kept_whole.insert(kept_whole.end(), reads.begin(), reads.end());
      continue;
    }
    if (!given_up.empty()) {
      for (LayerDecision& d : plan.layers) {
        if (d.style == Style::Row) d.sequence_note = "sequence parallelism refused: " + given_up;
      }
    }
    explain_idioms(graph, plan);
    return plan;
  }
}

}  // namespace autoshard::plan
