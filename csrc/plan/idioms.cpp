// Why a layer is held whole, in the words of the idiom the model wrote rather than the op the
// planner stopped at: q, k and v taken from a fused projection with unbind, a loss the model
// computes in its own forward from the head's logits, adaptive-norm modulation (a layer's output
// chunked into shift, scale and gate that multiply and shift the hidden stream). Each is found
// by following the layer's output through views, permutes, slices and elementwise ops.
#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "plan/idioms.h"
#include "plan/propagation.h"

namespace autoshard::plan {
namespace {

using Readers = std::unordered_map<int, std::vector<int>>;

Readers readers_of(const Graph& graph) {
  Readers readers;
  for (int n = 0; n < static_cast<int>(graph.nodes.size()); ++n) {
    for (int t : graph.nodes[n].inputs) readers[t].push_back(n);
  }
  return readers;
}

// The nodes reading `start`, followed through the op kinds in `through` (never through a
// layer), at most `limit` of them: enough for a block's worth of ops.
std::vector<int> reached(const Graph& graph, const Readers& readers, const std::vector<int>& start,
                         const std::vector<Kind>& through, size_t limit = 64) {
  std::vector<int> found, stack(start.begin(), start.end());
  std::unordered_set<int> seen;
  while (!stack.empty() && found.size() < limit) {
    const int tensor = stack.back();
    stack.pop_back();
    const auto it = readers.find(tensor);
    if (it == readers.end()) continue;
    for (int n : it->second) {
      if (!seen.insert(n).second) continue;
      found.push_back(n);
      const Node& node = graph.nodes[n];
      if (!is_layer(node) && std::find(through.begin(), through.end(), node.kind) != through.end()) {
        stack.insert(stack.end(), node.outputs.begin(), node.outputs.end());
      }
    }
  }
  return found;
}

bool labelled(const Graph& graph, const std::vector<int>& nodes, std::initializer_list<const char*> words) {
  for (int n : nodes) {
    for (const char* word : words) {
      if (graph.nodes[n].label.find(word) != std::string::npos) return true;
    }
  }
  return false;
}

int64_t numel(const Graph& graph, int tensor) {
  int64_t count = 1;
  for (int64_t size : graph.tensors.at(tensor).shape) count *= size;
  return count;
}

// A split of the layer's output into pieces, two or more of which multiply or add into the
// hidden stream (shift, scale, gate): each broadcast over it, so the op's output is larger than
// the piece (per sample, over every token). Pieces that multiply tensors of their own size (the
// halves of rotary embeddings, a norm of one piece) are no modulation.
bool modulates(const Graph& graph, const Readers& readers, const std::vector<int>& nodes) {
  for (int n : nodes) {
    const Node& node = graph.nodes[n];
    if (node.kind != Kind::Split || node.outputs.size() < 2) continue;
    int used = 0;
    for (int piece : node.outputs) {
      for (int after : reached(graph, readers, {piece}, {Kind::View})) {
        const Node& op = graph.nodes[after];
        if (op.kind == Kind::Pointwise && op.inputs.size() > 1 && !op.outputs.empty() &&
            numel(graph, op.outputs[0]) > numel(graph, piece)) {
          ++used;
          break;
        }
      }
    }
    if (used >= 2) return true;
  }
  return false;
}

}  // namespace

void explain_idioms(const Graph& graph, Plan& plan) {
  const Readers readers = readers_of(graph);
  for (LayerDecision& layer : plan.layers) {
    const Node& node = graph.nodes[layer.node];
    if ((layer.style != Style::Replicate && layer.style != Style::ColumnGather) || node.outputs.empty()) continue;
    const std::vector<int> nodes =
        reached(graph, readers, node.outputs, {Kind::View, Kind::Permute, Kind::Pointwise, Kind::Slice});
    const std::string* why = nullptr;
    if (labelled(graph, nodes, {"unbind"})) {
      why = &idiom_text("unbind");
    } else if (labelled(graph, nodes, {"log_softmax", "nll_loss", "cross_entropy"})) {
      why = &idiom_text("own_loss");
    } else if (layer.style == Style::Replicate && modulates(graph, readers, nodes)) {
      why = &idiom_text("modulation");
    }
    if (why == nullptr || layer.note.find(*why) != std::string::npos) continue;
    layer.note = layer.note.empty() ? "replicated: " + *why : layer.note + " (" + *why + ")";
  }
}

}  // namespace autoshard::plan
