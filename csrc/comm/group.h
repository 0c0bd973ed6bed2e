#pragma once
// Ops receive their process group by name (`group.group_name` in Python), as torch's own
// functional collectives do, so that schemas carry only strings and ints.
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace autoshard::comm {

// The process group registered under `group_name`; a name that resolves to nothing is a
// ValueError naming `op` and the argument.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(std::string_view group_name, const char* op);

}  // namespace autoshard::comm
