// The op catalogue: every autoshard schema is declared here, once. Each kernel family
// registers its CPU, CUDA, Meta and Autograd kernels beside its implementation.
#include <Python.h>
#include <torch/library.h>

#include "comm/counters.h"
#include "plan/plan_op.h"
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
  // Running totals of the collectives issued by this process: (count, bytes) per kind.
  m.def("comm_counter_kinds() -> str[]", &autoshard::comm::comm_counter_kinds);
  m.def("comm_counters() -> int[]", &autoshard::comm::comm_counters);

  // --- plan/ : a model's dataflow graph (text) in, a decision per layer (text) out
  m.def("plan_graph(str graph, int world_size) -> str", &autoshard::plan::plan_graph);
}

// `import autoshard._C` loads this library, which runs the registrations above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
