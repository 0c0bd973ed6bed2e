// Autograd for the split family: every piece's gradient is written back into its place in
// the input (unsplit), with pieces whose gradient is unused counted as zeros.
#include <torch/autograd.h>

#include "split/split.h"

namespace autoshard {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_unsplit(const variable_list& grads, const std::vector<int64_t>& starts, int64_t length,
                        int64_t dim) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("autoshard::unsplit", "").typed<at::Tensor(
      at::TensorList, at::IntArrayRef, int64_t, int64_t)>();
  return op.call(grads, starts, length, dim);
}

// `split` runs the forward op below autograd; `ranges` say where its pieces came from.
class SplitFunction : public torch::autograd::Function<SplitFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& self, int64_t dim,
                               const std::vector<Range>& ranges,
                               const std::function<std::vector<at::Tensor>(const at::Tensor&)>& split) {
    std::vector<int64_t> starts;
    for (const Range& r : ranges) starts.push_back(r.start);
    ctx->saved_data["starts"] = starts;
    ctx->saved_data["length"] = split_length(self, dim);
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return split(self);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor grad_self = call_unsplit(grads, ctx->saved_data["starts"].toIntVector(),
                                              ctx->saved_data["length"].toInt(), ctx->saved_data["dim"].toInt());
    return {grad_self, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<at::Tensor> array_split_sections(const at::Tensor& self, int64_t sections, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::array_split", "")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, int64_t, int64_t)>();
  check_sections(sections, "array_split");
  const int64_t d = checked_split_dim(self, dim, "array_split");
  return SplitFunction::apply(self, d, ranges_from_sections(split_length(self, d), sections),
                              [&](const at::Tensor& x) { return op.call(x, sections, d); });
}

std::vector<at::Tensor> array_split_indices(const at::Tensor& self, at::IntArrayRef indices, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::array_split", "indices")
                       .typed<std::vector<at::Tensor>(const at::Tensor&, at::IntArrayRef, int64_t)>();
  const int64_t d = checked_split_dim(self, dim, "array_split");
  return SplitFunction::apply(self, d, ranges_from_indices(split_length(self, d), indices.vec()),
                              [&](const at::Tensor& x) { return op.call(x, indices, d); });
}

at::Tensor shard(const at::Tensor& self, int64_t rank, int64_t world_size, int64_t dim) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::shard", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, int64_t)>();
  const int64_t d = checked_split_dim(self, dim, "shard");
  return SplitFunction::apply(self, d, std::vector<Range>{shard_range(split_length(self, d), rank, world_size)},
                              [&](const at::Tensor& x) { return std::vector<at::Tensor>{op.call(x, rank, world_size, d)}; })[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Autograd, m) {
  m.impl("array_split", &array_split_sections);
  m.impl("array_split.indices", &array_split_indices);
  m.impl("shard", &shard);
}

}  // namespace autoshard
