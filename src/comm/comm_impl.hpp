// Internals shared by the communicators of src/comm.
#pragma once

#include "tier/status.hpp"

namespace tier::detail {

// kInvalidArgument naming `who` unless world >= 1 and 0 <= rank < world.
Status check_rank_world(const char* who, int rank, int world);

}  // namespace tier::detail
