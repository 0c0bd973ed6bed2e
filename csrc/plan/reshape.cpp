#include "plan/reshape.h"

#include <functional>
#include <numeric>

namespace autoshard::plan {
namespace {

int64_t product(const std::vector<int64_t>& v, size_t begin, size_t end) {
  return std::accumulate(v.begin() + begin, v.begin() + end, int64_t{1}, std::multiplies<int64_t>());
}

}  // namespace

ReshapeResult map_reshape(const std::vector<int64_t>& from, const std::vector<int64_t>& to, const AxisFactor& factor,
                          bool unit_axis) {
  ReshapeResult result;
  // Pair runs of dimensions with equal products; the sharded axis lives in exactly one run.
  size_t i = 0, j = 0;
  while (i < from.size() || j < to.size()) {
    const size_t from_begin = i, to_begin = j;
    int64_t from_product = i < from.size() ? from[i++] : 1;
    int64_t to_product = j < to.size() ? to[j++] : 1;
    while (from_product != to_product) {
      if (from_product < to_product && i < from.size()) {
        from_product *= from[i++];
      } else if (to_product < from_product && j < to.size()) {
        to_product *= to[j++];
      } else {
        result.why = "the reshape does not preserve the number of elements";
        return result;
      }
    }
    const size_t axis = static_cast<size_t>(factor.axis);
    if (axis < from_begin || axis >= i) continue;
    // Flattened, the run is [outer_total][sharded, including the run's inner dims].
    const int64_t outer_total = product(from, from_begin, axis) * factor.outer;
    for (size_t k = to_begin; k < j; ++k) {
      const int64_t before = product(to, to_begin, k);
      if (outer_total % before != 0) break;
      const int64_t outer_here = outer_total / before;
      if (to[k] % outer_here == 0 && (to[k] / outer_here > 1 || (unit_axis && to[k] == 1 && outer_here == 1))) {
        result.ok = true;
        result.factor = {static_cast<int>(k), outer_here, to[k] / outer_here};
        return result;
      }
    }
    result.why = "the reshape mixes the sharded axis with its neighbours";
    return result;
  }
  result.why = "the sharded axis is not in the reshaped tensor";
  return result;
}

}  // namespace autoshard::plan
