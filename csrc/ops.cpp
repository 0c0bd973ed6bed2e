// The op catalogue: every autoshard schema is declared here, once. Each kernel family
// registers its CPU, CUDA, Meta and Autograd kernels beside its implementation.
#include <Python.h>
#include <torch/library.h>

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
}

// `import autoshard._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
