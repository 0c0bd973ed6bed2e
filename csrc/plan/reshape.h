#pragma once
// Following a sharded axis through a reshape.
#include <cstdint>
#include <string>
#include <vector>

namespace autoshard::plan {

// A tensor axis of length outer * size whose inner factor `size` is sharded (outer > 1 when
// the axis merged batch-like dimensions in front of it, as a [batch * heads] bmm axis does).
struct AxisFactor {
  int axis = -1;
  int64_t outer = 1;
  int64_t size = 0;
};

struct ReshapeResult {
  bool ok = false;
  AxisFactor factor;
  std::string why;  // when not ok
};

// Where `factor` of a tensor shaped `from` lands in the same data viewed as `to`. The shard
// stays expressible when the sharded factor begins on a dimension boundary of `to`; its
// units must then divide the length of the dimension it begins in (factor.size).
//
// With `unit_axis`, a dimension of length 1 where the factor begins may hold it (a factor of one
// unit): a view to [..., 1, head_dim] of a projection with a single KV head (multi-query
// attention) puts its one head there. Without it such dimensions are passed over.
ReshapeResult map_reshape(const std::vector<int64_t>& from, const std::vector<int64_t>& to, const AxisFactor& factor,
                          bool unit_axis = false);

}  // namespace autoshard::plan
