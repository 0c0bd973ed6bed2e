// Autograd for the mappings: each one's gradient is its partner mapping, called through the
// dispatcher so that the backward collectives run in C++ (and are counted there) and so
// that higher-order gradients follow from the same pairing.
#include <torch/autograd.h>

#include "comm/mappings.h"

namespace autoshard::comm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_copy_to_parallel(const at::Tensor& x, c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::copy_to_parallel", "")
                       .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
  return op.call(x, group_name);
}

at::Tensor call_reduce_from_parallel(const at::Tensor& x, c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::reduce_from_parallel", "")
                       .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
  return op.call(x, group_name);
}

at::Tensor call_gather_from_parallel(const at::Tensor& x, int64_t dim, int64_t length, c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::gather_from_parallel", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, c10::string_view)>();
  return op.call(x, dim, length, group_name);
}

at::Tensor call_scatter_to_parallel(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::scatter_to_parallel", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, c10::string_view)>();
  return op.call(x, dim, group_name);
}

at::Tensor call_reduce_scatter_to_sequence(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::reduce_scatter_to_sequence", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, c10::string_view)>();
  return op.call(x, dim, group_name);
}

at::Tensor call_all_gather_from_sequence(const at::Tensor& x, int64_t dim, int64_t length,
                                         c10::string_view group_name) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("autoshard::all_gather_from_sequence", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, c10::string_view)>();
  return op.call(x, dim, length, group_name);
}

class CopyToParallel : public torch::autograd::Function<CopyToParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_copy_to_parallel(x, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_reduce_from_parallel(grads[0], ctx->saved_data["group_name"].toStringRef()), at::Tensor()};
  }
};

class ReduceFromParallel : public torch::autograd::Function<ReduceFromParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_reduce_from_parallel(x, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {call_copy_to_parallel(grads[0], ctx->saved_data["group_name"].toStringRef()), at::Tensor()};
  }
};

class GatherFromParallel : public torch::autograd::Function<GatherFromParallel> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t length,
                            c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_gather_from_parallel(x, dim, length, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradient has the full length along dim; this rank's piece of it is a scatter.
    const at::Tensor grad_x = call_scatter_to_parallel(grads[0], ctx->saved_data["dim"].toInt(),
                                                       ctx->saved_data["group_name"].toStringRef());
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A scatter whose gradient is the matching gather: scatter_to_parallel's pieces of the
// features come back with gather_from_parallel; reduce_scatter_to_sequence's tokens (this
// rank's piece of each rank's sum) with all_gather_from_sequence.
template <at::Tensor (*Scatter)(const at::Tensor&, int64_t, c10::string_view),
          at::Tensor (*Gather)(const at::Tensor&, int64_t, int64_t, c10::string_view)>
class ScatterGatheredBack : public torch::autograd::Function<ScatterGatheredBack<Scatter, Gather>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["dim"] = dim;
    at::Tensor piece;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      piece = Scatter(x, dim, group_name);
    }
    // The op has checked dim by now.
    ctx->saved_data["length"] = x.sym_size(dim < 0 ? dim + x.dim() : dim).guard_int(__FILE__, __LINE__);
    return piece;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor grad_x = Gather(grads[0], ctx->saved_data["dim"].toInt(), ctx->saved_data["length"].toInt(),
                                     ctx->saved_data["group_name"].toStringRef());
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

using ScatterToParallel = ScatterGatheredBack<call_scatter_to_parallel, call_gather_from_parallel>;
using ReduceScatterToSequence = ScatterGatheredBack<call_reduce_scatter_to_sequence, call_all_gather_from_sequence>;

// Each rank's gradient of the gathered tokens is partial (its share of the features that
// read them): summed over the group, this rank keeps its tokens' piece.
class AllGatherFromSequence : public torch::autograd::Function<AllGatherFromSequence> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t length,
                            c10::string_view group_name) {
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["dim"] = dim;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_all_gather_from_sequence(x, dim, length, group_name);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor grad_x = call_reduce_scatter_to_sequence(grads[0], ctx->saved_data["dim"].toInt(),
                                                              ctx->saved_data["group_name"].toStringRef());
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor reduce_scatter_to_sequence_autograd(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  return ReduceScatterToSequence::apply(x, dim, group_name);
}

at::Tensor all_gather_from_sequence_autograd(const at::Tensor& x, int64_t dim, int64_t length,
                                             c10::string_view group_name) {
  return AllGatherFromSequence::apply(x, dim, length, group_name);
}

at::Tensor copy_to_parallel_autograd(const at::Tensor& x, c10::string_view group_name) {
  return CopyToParallel::apply(x, group_name);
}

at::Tensor reduce_from_parallel_autograd(const at::Tensor& x, c10::string_view group_name) {
  return ReduceFromParallel::apply(x, group_name);
}

at::Tensor gather_from_parallel_autograd(const at::Tensor& x, int64_t dim, int64_t length,
                                         c10::string_view group_name) {
  return GatherFromParallel::apply(x, dim, length, group_name);
}

at::Tensor scatter_to_parallel_autograd(const at::Tensor& x, int64_t dim, c10::string_view group_name) {
  return ScatterToParallel::apply(x, dim, group_name);
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, Autograd, m) {
  m.impl("copy_to_parallel", &copy_to_parallel_autograd);
  m.impl("reduce_from_parallel", &reduce_from_parallel_autograd);
  m.impl("gather_from_parallel", &gather_from_parallel_autograd);
  m.impl("scatter_to_parallel", &scatter_to_parallel_autograd);
  m.impl("reduce_scatter_to_sequence", &reduce_scatter_to_sequence_autograd);
  m.impl("all_gather_from_sequence", &all_gather_from_sequence_autograd);
}

}  // namespace autoshard::comm
