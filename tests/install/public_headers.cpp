// Every C++ header of the user API compiles in a project outside tier (installed headers only), and the Engine is
// built only by Engine::create (its state machine is an opaque pimpl). The C ABI (tier/tier.h)
// has its own consumer, tests/bindings/c_consumer.
#include "tier/comm.hpp"
#include "tier/config.hpp"
#include "tier/cpu_adam.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/engine.hpp"
#include "tier/log.hpp"
#include "tier/loss_scaler.hpp"
#include "tier/offloaded_optimizer.hpp"
#include "tier/state_codec.hpp"
#include "tier/stats.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"
#include "tier/units.hpp"

#include <memory>
#include <string>
#include <type_traits>

static_assert(!std::is_constructible_v<tier::Engine, std::unique_ptr<tier::Engine::Impl>>,
              "Engine is built by Engine::create only");

std::string public_api_names() {
  return std::string(tier::access_name(tier::Access::kRead)) + " " + tier::tier_name(tier::Tier::kNvme);
}
