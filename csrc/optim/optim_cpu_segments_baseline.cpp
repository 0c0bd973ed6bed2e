// The optim CPU kernels for any CPU, at the compiler's baseline instruction set.
#include "optim/optim_cpu_segments_impl.h"

namespace autoshard::optim {

const SegmentKernels& baseline_segment_kernels() {
  static const SegmentKernels kernels = make_segment_kernels("baseline");
  return kernels;
}

}  // namespace autoshard::optim
