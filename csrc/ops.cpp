// The op catalogue: every autoshard schema is declared here, once. Each kernel family
// registers its CPU, CUDA, Meta and Autograd kernels beside its implementation.
#include <Python.h>
#include <torch/library.h>

#include "checkpoint/slices.h"
#include "comm/counters.h"
#include "comm/ring.h"
#include "nn/einsum_equation.h"
#include "plan/plan_op.h"
#include "plan/policy.h"
#include "plan/reasons.h"
#include "split/split_rule.h"

TORCH_LIBRARY(autoshard, m) {
  // --- split/ : numpy's array_split rule (first `length % sections` pieces get one extra)
  m.def("split_sizes(int length, int sections) -> int[]", &autoshard::split_sizes);
  m.def("array_split(Tensor self, int sections, int dim=0) -> Tensor[]");
  m.def("array_split.indices(Tensor self, int[] indices, int dim=0) -> Tensor[]");
  m.def("shard(Tensor self, int rank, int world_size, int dim=0) -> Tensor");
  // Sums `pieces` into a zero tensor of `length` along `dim`, piece i starting at starts[i]:
  // the gradient of the splits above (pieces of an index split may overlap or leave gaps).
  m.def("unsplit(Tensor[] pieces, int[] starts, int length, int dim) -> Tensor");

  // --- comm/ : the mappings of tensor parallelism over the process group registered as
  // `group_name`; each one's gradient is its partner (copy <-> reduce, gather <-> scatter).
  // Pieces along `dim` follow split_sizes(length, group size), padded inside the op.
  m.def("copy_to_parallel(Tensor x, str group_name) -> Tensor");      // identity; grad all-reduced
  m.def("reduce_from_parallel(Tensor x, str group_name) -> Tensor");  // all-reduce (sum); grad identity
  m.def("gather_from_parallel(Tensor x, int dim, int length, str group_name) -> Tensor");
  m.def("scatter_to_parallel(Tensor x, int dim, str group_name) -> Tensor");  // this rank's piece
  // Sequence parallelism's pair, along a token axis `dim` (pieces follow split_sizes):
  // forward sum over the group keeping this rank's piece; grad all-gathered.
  m.def("reduce_scatter_to_sequence(Tensor x, int dim, str group_name) -> Tensor");
  // forward every rank's piece concatenated (`length` in all); grad summed, this rank's piece kept.
  m.def("all_gather_from_sequence(Tensor x, int dim, int length, str group_name) -> Tensor");
  // Every other collective autoshard issues. Pieces of unequal sizes (rank r's holding
  // sizes[r] elements) are padded for the wire and unpadded inside the op.
  // Sums (reduce_op "sum") or takes the maximum ("max") of x over the group, in place.
  m.def("all_reduce_(Tensor(a!) x, str reduce_op, str group_name) -> ()");
  // Every rank's piece concatenated along dim, in rank order.
  m.def("all_gather_uneven(Tensor x, int dim, int[] sizes, str group_name) -> Tensor");
  // x (1-d) holds the ranks' pieces back to back; returns this rank's piece of their sum.
  // With async_op the collective is only started: torch.ops._c10d_functional.wait_tensor
  // waits for the result, as for torch's functional collectives.
  m.def("reduce_scatter_uneven(Tensor x, int[] sizes, str group_name, bool async_op=False) -> Tensor");
  // The tensors flattened into one new 1-d buffer and summed over the group (async_op: as above).
  m.def("all_reduce_bucket(Tensor[] tensors, str group_name, bool async_op=False) -> Tensor");
  // Rank src's x on every rank, in place.
  m.def("broadcast_(Tensor(a!) x, int src, str group_name) -> ()");
  // The group carrying a two-rank ring's data from the higher rank to the lower (comm/ring.h).
  m.def("set_ring_return_group(str group_name, str return_group_name) -> ()", &autoshard::comm::set_ring_return_group);
  // Running totals of the collectives issued by this process: (count, bytes) per kind; and
  // the same per process group, group by group.
  m.def("comm_counter_kinds() -> str[]", &autoshard::comm::comm_counter_kinds);
  m.def("comm_counters() -> int[]", &autoshard::comm::comm_counters);
  m.def("comm_group_counters() -> (str[] group_names, int[] counters)", &autoshard::comm::comm_group_counters);

  // --- nn/ embedding: this rank holds rows [vocab_start, vocab_start + weight.size(0)) of a
  // [vocab_size, dim] table. The lookup gives the held rows and zeros for every other id (so
  // the ranks' outputs sum to the full lookup); ids outside [0, vocab_size) are an error.
  // padding_idx (a global row, or -1) only matters to the backward: that row gets no gradient.
  m.def("vocab_parallel_lookup(Tensor ids, Tensor weight, int vocab_start, int padding_idx, int vocab_size) -> Tensor");
  // The dense gradient of the local table [num_rows, dim]: each held id's grad row added to its row.
  m.def("vocab_parallel_lookup_backward(Tensor grad, Tensor ids, SymInt num_rows, int vocab_start, int padding_idx) "
        "-> Tensor");

  // --- nn/ einsum: Keras-style dense equations "input,weight->output".
  // Per weight letter, in weight order: the letter, its role ("output": weight and output
  // only; "contracted": weight and input only; "batch": all three), and its dim in the input
  // and in the output (None if absent; negative, from the end, after a leading "...").
  m.def("einsum_weight_axes(str equation) -> (str[] letters, str[] roles, int?[] input_dims, int?[] output_dims)",
        &autoshard::einsum_weight_axes);
  // EinsumDense's weight shape, bias shape ([] without bias_axes) and full output shape (batch
  // dim None first), from the input and output shapes without their batch dim.
  m.def("einsum_dense_shapes(str equation, int?[] input_shape, int?[] output_shape, str? bias_axes) -> "
        "(int[] weight_shape, int[] bias_shape, int?[] output_shape)",
        &autoshard::einsum_dense_shapes);

  // --- loss/ : cross-entropy over vocabulary shards. logits [..., V_local] hold this rank's
  // contiguous range of the vocabulary (split_sizes(V, group size)[rank] entries; V is learned
  // from the group); labels [...] hold global class ids, the same on every rank. The loss equals
  // torch's cross_entropy of the whole logits flattened to [N, V] (N = labels.numel()): [N] for
  // "none", a scalar otherwise, in logits' dtype. Forward issues three all-reduces of one value
  // per row (row maximum, sum of exponentials, target logit with the smoothing sum); lse (the
  // rows' log-sum-exp, in float, double for double logits) and vocab_range (int64
  // [vocab_start, vocab_size]) are what the backward needs to run without a collective.
  m.def("vocab_parallel_cross_entropy(Tensor logits, Tensor labels, str group_name, int ignore_index=-100, "
        "float label_smoothing=0.0, str reduction=\"mean\") -> (Tensor loss, Tensor lse, Tensor vocab_range)");
  m.def("vocab_parallel_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor labels, Tensor lse, "
        "Tensor vocab_range, int ignore_index, float label_smoothing, str reduction) -> Tensor");

  // --- optim/ : fused multi-tensor optimizer steps over local shards
  // One torch.optim.AdamW step for every tensor of the lists, in place; `step` counts this
  // step (1 on the first), for the bias corrections.
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "float lr, float beta1, float beta2, float weight_decay, float eps, int step, bool maximize) -> ()");
  // One torch.optim.SGD step, in place. With momentum 0 `momentum_buffers` is empty; on the
  // first step (`first_step`) the buffers are written with the gradient rather than read.
  m.def(
      "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize, bool first_step) -> ()");

  // The same steps with fp32 master weights: `params` are bf16, fp16 or fp32, `grads` share
  // their dtype, and `master_params` and the states are fp32 tensors of the same shapes. The
  // update runs in fp32 on the master, which is written back, and each parameter is written as
  // its master rounded to nearest even; `params` are only written, never read.
  m.def(
      "fused_adamw_master_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, float weight_decay, float eps, int step, "
      "bool maximize) -> ()");
  m.def(
      "fused_sgd_master_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] momentum_buffers, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool maximize, bool first_step) -> ()");

  // --- checkpoint/ : slice arithmetic for loading and saving shards (host-side integers)
  // The flattened (start, length) runs of a dimension that `rank` holds, in local order;
  // with `repeat`, the run of KV heads (units) its share of units * repeat query heads uses.
  m.def("shard_ranges(int full_size, int world_size, int rank, int? units=None, int[]? parts=None, "
        "int? repeat=None) -> int[]",
        &autoshard::checkpoint::shard_ranges);
  // The byte runs [n, 3] = (src offset, dst offset, nbytes) copying the overlap of two
  // selections of one full tensor; a selection is, per dim, [count, start, length, ...].
  m.def("copy_runs(int[] shape, int itemsize, int[] src, int[] dst) -> Tensor", &autoshard::checkpoint::copy_runs);
  // Copies the part of each such run (source offsets in file bytes) that lies in `src`, a
  // window holding file bytes [src_offset, src_offset + src.numel()), into `dst` (uint8).
  m.def("copy_byte_runs_(Tensor(a!) dst, Tensor src, Tensor runs, int src_offset) -> ()");

  // --- plan/ : a model's dataflow graph (text, see plan/graph.h) in, the plan out as a versioned JSON
  // document of named records (see plan/emit.cpp)
  m.def("plan_graph(str graph, int world_size) -> str", &autoshard::plan::plan_graph);
  // Every reason code a plan may give, with its words, as a JSON object (see plan/reasons.cpp).
  m.def("plan_reasons() -> str", &autoshard::plan::plan_reasons);
  // The decisions taken around a plan from its thresholds and costs (the imbalance allowed, when
  // to gather what cannot be paired, sequence_parallel="auto"): a JSON question of measured facts
  // in, a JSON answer of what to do and why out (see plan/policy.cpp).
  m.def("plan_policy(str question) -> str", &autoshard::plan::plan_policy);
}

// `import autoshard._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
