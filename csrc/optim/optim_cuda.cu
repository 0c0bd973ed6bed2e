// CUDA kernels of the optim family. One launch updates many tensors: its arguments carry a
// table of the tensors' addresses and of which 64K-element chunk each block updates, so a
// hundred tensors cost a handful of launches (a new one only when the table is full).
#include <array>

#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "optim/optim_math.h"

namespace autoshard::optim {
namespace {

constexpr int64_t kChunkElements = 64 * 1024;
constexpr int kBlocksPerLaunch = 320;
constexpr int kThreads = 512;

// Tensors per launch for `Depth` arrays each, keeping ChunkTable within the 4 KB of kernel
// parameters every CUDA version accepts.
template <int Depth>
constexpr int kTensorsPerLaunch = Depth == 5 ? 30 : Depth == 4 ? 36 : Depth == 3 ? 48 : 64;

template <int Depth>
struct ChunkTable {
  void* data[Depth][kTensorsPerLaunch<Depth>];
  int64_t numel[kTensorsPerLaunch<Depth>];
  unsigned char tensor_of_block[kBlocksPerLaunch];
  int chunk_of_block[kBlocksPerLaunch];
};
static_assert(sizeof(ChunkTable<5>) + 256 <= 4096, "kernel parameters exceed 4 KB");
static_assert(sizeof(ChunkTable<4>) + 256 <= 4096, "kernel parameters exceed 4 KB");
static_assert(sizeof(ChunkTable<3>) + 256 <= 4096, "kernel parameters exceed 4 KB");
static_assert(sizeof(ChunkTable<2>) + 256 <= 4096, "kernel parameters exceed 4 KB");

// Block b updates chunk chunk_of_block[b] of tensor tensor_of_block[b]; `Update` reads and
// writes one element of every array.
template <int Depth, typename Update>
__global__ void __launch_bounds__(kThreads) multi_tensor_kernel(ChunkTable<Depth> table, Update update) {
  const int t = table.tensor_of_block[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.chunk_of_block[blockIdx.x]) * kChunkElements;
  const int64_t end = table.numel[t] < begin + kChunkElements ? table.numel[t] : begin + kChunkElements;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) update(table, t, i);
}

// Fills chunk tables from the lists and launches `update` on each.
template <int Depth, typename Update>
void launch_over_chunks(const std::array<const std::vector<at::Tensor>*, Depth>& lists, const Update& update) {
  constexpr int capacity = kTensorsPerLaunch<Depth>;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  ChunkTable<Depth> table;
  int tensors = 0;
  int blocks = 0;
  const auto launch = [&] {
    multi_tensor_kernel<Depth><<<blocks, kThreads, 0, stream>>>(table, update);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const size_t count = lists[0]->size();
  for (size_t t = 0; t < count; ++t) {
    const int64_t numel = (*lists[0])[t].numel();
    if (numel == 0) continue;
    for (int d = 0; d < Depth; ++d) table.data[d][tensors] = (*lists[d])[t].data_ptr();
    table.numel[tensors] = numel;
    ++tensors;
    const int64_t chunks = (numel + kChunkElements - 1) / kChunkElements;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      table.tensor_of_block[blocks] = static_cast<unsigned char>(tensors - 1);
      table.chunk_of_block[blocks] = static_cast<int>(chunk);
      ++blocks;
      const bool last_chunk = chunk == chunks - 1;
      if (blocks < kBlocksPerLaunch && !(tensors == capacity && last_chunk)) continue;
      launch();
      blocks = 0;
      if (last_chunk) {
        tensors = 0;
      } else {
        // The rest of this tensor's chunks go into the next table, as its first tensor.
        for (int d = 0; d < Depth; ++d) table.data[d][0] = table.data[d][tensors - 1];
        table.numel[0] = table.numel[tensors - 1];
        tensors = 1;
      }
    }
  }
  if (blocks > 0) launch();
}

template <typename scalar_t>
struct AdamWElement {
  using opmath_t = at::opmath_type<scalar_t>;
  AdamWCoefficients<opmath_t> c;

  __device__ void operator()(const ChunkTable<4>& table, int t, int64_t i) const {
    scalar_t* param = static_cast<scalar_t*>(table.data[0][t]);
    const scalar_t* grad = static_cast<const scalar_t*>(table.data[1][t]);
    scalar_t* exp_avg = static_cast<scalar_t*>(table.data[2][t]);
    scalar_t* exp_avg_sq = static_cast<scalar_t*>(table.data[3][t]);
    opmath_t p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update<opmath_t>(p, static_cast<opmath_t>(grad[i]), m, v, c);
    param[i] = static_cast<scalar_t>(p);
    exp_avg[i] = static_cast<scalar_t>(m);
    exp_avg_sq[i] = static_cast<scalar_t>(v);
  }
};

template <typename scalar_t>
struct SGDMomentumElement {
  using opmath_t = at::opmath_type<scalar_t>;
  SGDCoefficients<opmath_t> c;

  __device__ void operator()(const ChunkTable<3>& table, int t, int64_t i) const {
    scalar_t* param = static_cast<scalar_t*>(table.data[0][t]);
    const scalar_t* grad = static_cast<const scalar_t*>(table.data[1][t]);
    scalar_t* buffer = static_cast<scalar_t*>(table.data[2][t]);
    opmath_t p = param[i];
    // On the first step the buffer is only written.
    opmath_t b = c.first_step ? opmath_t(0) : static_cast<opmath_t>(buffer[i]);
    sgd_update<opmath_t>(p, static_cast<opmath_t>(grad[i]), b, c);
    param[i] = static_cast<scalar_t>(p);
    buffer[i] = static_cast<scalar_t>(b);
  }
};

template <typename scalar_t>
struct SGDElement {
  using opmath_t = at::opmath_type<scalar_t>;
  SGDCoefficients<opmath_t> c;

  __device__ void operator()(const ChunkTable<2>& table, int t, int64_t i) const {
    scalar_t* param = static_cast<scalar_t*>(table.data[0][t]);
    const scalar_t* grad = static_cast<const scalar_t*>(table.data[1][t]);
    opmath_t p = param[i];
    opmath_t unused_buffer = 0;
    sgd_update<opmath_t>(p, static_cast<opmath_t>(grad[i]), unused_buffer, c);
    param[i] = static_cast<scalar_t>(p);
  }
};

// Master-weight forms: the parameter (param_t) is only written, as the fp32 master rounded to
// nearest even (static_cast to at::BFloat16 / at::Half rounds so).
template <typename param_t>
struct AdamWMasterElement {
  AdamWCoefficients<float> c;

  __device__ void operator()(const ChunkTable<5>& table, int t, int64_t i) const {
    param_t* param = static_cast<param_t*>(table.data[0][t]);
    const param_t* grad = static_cast<const param_t*>(table.data[1][t]);
    float* master = static_cast<float*>(table.data[2][t]);
    float* exp_avg = static_cast<float*>(table.data[3][t]);
    float* exp_avg_sq = static_cast<float*>(table.data[4][t]);
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update<float>(p, static_cast<float>(grad[i]), m, v, c);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = static_cast<param_t>(p);
  }
};

template <typename param_t>
struct SGDMasterMomentumElement {
  SGDCoefficients<float> c;

  __device__ void operator()(const ChunkTable<4>& table, int t, int64_t i) const {
    param_t* param = static_cast<param_t*>(table.data[0][t]);
    const param_t* grad = static_cast<const param_t*>(table.data[1][t]);
    float* master = static_cast<float*>(table.data[2][t]);
    float* buffer = static_cast<float*>(table.data[3][t]);
    float p = master[i];
    float b = c.first_step ? 0.0f : buffer[i];
    sgd_update<float>(p, static_cast<float>(grad[i]), b, c);
    master[i] = p;
    buffer[i] = b;
    param[i] = static_cast<param_t>(p);
  }
};

template <typename param_t>
struct SGDMasterElement {
  SGDCoefficients<float> c;

  __device__ void operator()(const ChunkTable<3>& table, int t, int64_t i) const {
    param_t* param = static_cast<param_t*>(table.data[0][t]);
    const param_t* grad = static_cast<const param_t*>(table.data[1][t]);
    float* master = static_cast<float*>(table.data[2][t]);
    float p = master[i];
    float unused_buffer = 0.0f;
    sgd_update<float>(p, static_cast<float>(grad[i]), unused_buffer, c);
    master[i] = p;
    param[i] = static_cast<param_t>(p);
  }
};

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double weight_decay,
                      double eps, int64_t step, bool maximize) {
  const AdamWScalars scalars = checked_adamw_scalars(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2,
                                                     weight_decay, eps, step, maximize);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  FlatLists flat({params, grads, exp_avgs, exp_avg_sqs}, {true, false, true, true});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[0].scalar_type(), "fused_adamw_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const AdamWElement<scalar_t> update{AdamWCoefficients<opmath_t>::template make<opmath_t>(scalars)};
    launch_over_chunks<4>({&flat.list(0), &flat.list(1), &flat.list(2), &flat.list(3)}, update);
  });
  flat.write_back();
}

void fused_sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
                    double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
                    bool first_step) {
  const SGDScalars scalars = checked_sgd_scalars(params, grads, momentum_buffers, lr, momentum, dampening,
                                                 weight_decay, nesterov, maximize, first_step);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[0].scalar_type(), "fused_sgd_", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto coefficients = SGDCoefficients<opmath_t>::template make<opmath_t>(scalars);
    if (scalars.use_momentum) {
      FlatLists flat({params, grads, momentum_buffers}, {true, false, true});
      launch_over_chunks<3>({&flat.list(0), &flat.list(1), &flat.list(2)},
                            SGDMomentumElement<scalar_t>{coefficients});
      flat.write_back();
    } else {
      FlatLists flat({params, grads}, {true, false});
      launch_over_chunks<2>({&flat.list(0), &flat.list(1)}, SGDElement<scalar_t>{coefficients});
      flat.write_back();
    }
  });
}

// The parameters' dtype, among those the master checks let through (float32, float16, bfloat16).
#define AUTOSHARD_DISPATCH_MASTER_PARAM(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void fused_adamw_master_cuda(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                             at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double beta1,
                             double beta2, double weight_decay, double eps, int64_t step, bool maximize) {
  const AdamWScalars scalars = checked_adamw_master_scalars(params, grads, master_params, exp_avgs, exp_avg_sqs, lr,
                                                            beta1, beta2, weight_decay, eps, step, maximize);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  FlatLists flat({params, grads, master_params, exp_avgs, exp_avg_sqs}, {true, false, true, true, true});
  const auto coefficients = AdamWCoefficients<float>::template make<float>(scalars);
  AUTOSHARD_DISPATCH_MASTER_PARAM(params[0].scalar_type(), "fused_adamw_master_", [&] {
    launch_over_chunks<5>({&flat.list(0), &flat.list(1), &flat.list(2), &flat.list(3), &flat.list(4)},
                          AdamWMasterElement<scalar_t>{coefficients});
  });
  flat.write_back();
}

void fused_sgd_master_cuda(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                           at::TensorList momentum_buffers, double lr, double momentum, double dampening,
                           double weight_decay, bool nesterov, bool maximize, bool first_step) {
  const SGDScalars scalars = checked_sgd_master_scalars(params, grads, master_params, momentum_buffers, lr, momentum,
                                                        dampening, weight_decay, nesterov, maximize, first_step);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const auto coefficients = SGDCoefficients<float>::template make<float>(scalars);
  AUTOSHARD_DISPATCH_MASTER_PARAM(params[0].scalar_type(), "fused_sgd_master_", [&] {
    if (scalars.use_momentum) {
      FlatLists flat({params, grads, master_params, momentum_buffers}, {true, false, true, true});
      launch_over_chunks<4>({&flat.list(0), &flat.list(1), &flat.list(2), &flat.list(3)},
                            SGDMasterMomentumElement<scalar_t>{coefficients});
      flat.write_back();
    } else {
      FlatLists flat({params, grads, master_params}, {true, false, true});
      launch_over_chunks<3>({&flat.list(0), &flat.list(1), &flat.list(2)}, SGDMasterElement<scalar_t>{coefficients});
      flat.write_back();
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(autoshard, CUDA, m) {
  m.impl("fused_adamw_", &fused_adamw_cuda);
  m.impl("fused_sgd_", &fused_sgd_cuda);
  m.impl("fused_adamw_master_", &fused_adamw_master_cuda);
  m.impl("fused_sgd_master_", &fused_sgd_master_cuda);
}

}  // namespace autoshard::optim
