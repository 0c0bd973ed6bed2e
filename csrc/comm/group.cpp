#include "comm/group.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace autoshard::comm {

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(std::string_view group_name, const char* op) {
  const std::string name(group_name);
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(name);
  } catch (const c10::Error&) {
    // The registry's own message does not say which op or argument was at fault.
    group = nullptr;
  }
  TORCH_CHECK_VALUE(group, op, ": group_name '", name,
                    "' names no registered process group (pass `group.group_name` of a live "
                    "torch.distributed group; is torch.distributed initialised?)");
  return group;
}

}  // namespace autoshard::comm
