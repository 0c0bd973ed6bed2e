// The reason codes of a plan, each with its words. Codes are stable (plans and tests name them);
// the words are what print(plan) and warnings say.
#include "plan/reasons.h"
#include "plan/idioms.h"
#include "plan/policy.h"

#include <sstream>

#include <c10/util/Exception.h>

namespace autoshard::plan {

// The words of split_table and gathered_unpaired state the policy's numbers.
static_assert(kImbalance == 0.10, "the reasons below say 1/N + 10%");
static_assert(kGatheredLayerDivisor == 8, "split_table below says an eighth of the largest layer");

const std::vector<std::pair<std::string, std::string>>& reason_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      // Decisions of the planner (settle.cpp) about a layer it could split.
      {"conflict", "its output reaches an op that needs the whole axis"},
      {"too_few_units", "fewer whole heads than ranks"},
      {"model_output", "its output is a model output"},
      {"override_replicate", "replicated by override"},
      {"override_gather", "gathered by override"},
      {"weight_read_elsewhere", "its weight is also read outside the layer"},
      {"weight_shared", "its weight is shared with a layer split differently"},
      {"feeds_called_layer",
       "it feeds a layer that its other calls split as a column layer (a layer called more than once)"},
      {"small_parts_whole", "split by heads; its smaller parts (KV heads) are held whole on every rank"},
      // Decisions taken around the planner: the module computes other shapes than planned.
      {"attention_unpaired", "an nn.MultiheadAttention whose projections cannot be split by heads together"},
      {"shape_mismatch",
       "its module computes other local shapes than the plan's (a size it reads from no attribute that autoshard "
       "could make local: a constant in its code, or an attribute of an object it does not hold)"},
      {"dry_run_mismatch",
       "its module, sharded on a meta copy, computed other shapes or collectives than the plan predicted: planned "
       "again with it whole"},
      // Parameters outside the layers the planner splits.
      {"position_table", "a position or type table (only the token table is split)"},
      {"split_table",
       "(split) a position or type table as large as an eighth of the largest layer, in a plan that would otherwise "
       "leave a rank more than 1/N + 10% of the parameters: split by its rows, one more all-reduce in forward"},
      {"unsplit", "the planner found no axis to split"},
      {"row_bias", "the bias of a row-parallel layer, added once after the all-reduce"},
      {"not_a_layer", "not a Linear, Embedding, einsum or convolution layer (norms, free parameters)"},
      {"convolution",
       "a convolution autoshard does not split: a grouped transposed convolution, or one with a forward of its "
       "own"},
      {"groups_input_whole",
       "a grouped or depthwise convolution whose input channels arrive whole: it is split only with its input, by "
       "whole groups"},
      {"functional_layer",
       "a layer whose weight the model applies itself (F.linear(x, layer.weight, bias), weight @ x, "
       "F.conv1d(x, conv.weight)): a Linear is split only as a column layer whose input's gradient is summed "
       "upstream (a row layer's output, as Mamba's x_proj) and whose bias, where added apart, meets only its "
       "channels, a depthwise convolution's weight only with the channels it meets; here they are not, or the "
       "product adds another bias"},
      {"gathered_alone",
       "(split) a convolution alone over an input no gradient flows to, whose output must be whole: its output "
       "channels are gathered, one all-gather in forward and none in backward"},
      {"gathered_unpaired",
       "(split) a large layer that cannot be paired, its output needed whole, in a plan that would otherwise leave a "
       "rank more than 1/N + 10% of the parameters: split on its output features and gathered, one all-gather in "
       "forward and one all-reduce of its input's gradient in backward"},
      {"not_called",
       "a layer the traced forward never calls (cross-attention traced without encoder_hidden_states, a head the "
       "example inputs do not reach): example inputs that reach it let it be split"},
      {"adapter_factor", "a LoRA factor read whole beside its split base layer (A of a column layer, B of a row layer)"},
  };
  return table;
}

const std::string& reason_text(const std::string& code) {
  for (const auto& [known, words] : reason_table()) {
    if (known == code) return words;
  }
  TORCH_CHECK(false, "autoshard planner: no reason code ", code);
}

std::string plan_reasons() {
  std::ostringstream out;
  out << '{';
  bool first = true;
  for (const auto& [code, words] : reason_table()) {
    out << (first ? "" : ",") << '"' << code << "\":\"";
    for (char c : words) {
      if (c == '"' || c == '\\') out << '\\';
      out << c;
    }
    out << '"';
    first = false;
  }
  out << '}';
  return out.str();
}

// An op indexing the token axis keeps every token on the planned inputs, but another call may
// select other tokens (generate's logits_to_keep=1): it must read them whole.
std::string indexed_tokens_without_exit(const std::string& indexing) {
  return indexing + " indexes the token axis (another call may select other tokens) and no module returns the "
                    "tokens it reads, where they could be gathered first";
}

std::string indexed_tokens_reach_output(const std::string& indexing) {
  return "tokens that " + indexing + " indexes reach a model output";
}

std::string indexed_tokens_read_elsewhere(const std::string& module, const std::string& reader,
                                          const std::string& indexing) {
  return module + " returns tokens that " + reader + " reads besides the column layers reading them through " +
         indexing + ", which indexes the token axis";
}

std::string length_may_be_read(const std::string& module) {
  return "module '" + module + "' receives tokens split over the ranks and gathers them only in its own layers: it "
         "may read their count first (as an attention called as attn(x, memory) does with x.shape), so its inputs "
         "stay whole";
}

const std::string& idiom_text(const std::string& idiom) {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"unbind",
       "a fused q/k/v split with unbind (qkv.reshape(...).permute(...).unbind(0)); split it with chunk, split or "
       "slices to have it split by heads"},
      {"modulation",
       "it is adaptive-norm modulation: its output is chunked into shift, scale and gate pieces that multiply and "
       "shift the whole hidden stream, so every rank needs all of it"},
      {"own_loss",
       "the model computes a loss from these logits in its own forward (a cross-entropy over the whole "
       "vocabulary): the head is kept whole and every rank holds the whole logits; loss parallelism, which keeps "
       "them split, applies only to Hugging Face's loss functions, with a plan made without labels"},
  };
  for (const auto& [known, words] : table) {
    if (known == idiom) return words;
  }
  TORCH_CHECK(false, "autoshard planner: no idiom ", idiom);
}

}  // namespace autoshard::plan
