// tier/types.hpp — the nouns shared by every module: tiers, links, dtypes, roles and the tensor
// descriptor.
//
// Thread safety: plain values and pure functions; safe from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>

#include "tier/status.hpp"

namespace tier {

// A registered tensor's handle in an Engine.
using TensorId = std::uint32_t;
inline constexpr TensorId kInvalidTensor = std::numeric_limits<TensorId>::max();

// Where a copy of a tensor can live, fastest first.
enum class Tier : std::uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
inline constexpr std::array<Tier, kNumTiers> kAllTiers = {Tier::kDevice, Tier::kHost, Tier::kNvme};

// "device", "host", "nvme".
const char* tier_name(Tier t) noexcept;
// Accepts "device"/"gpu"/"cuda", "host"/"cpu", "nvme"/"disk" (case-insensitive).
Result<Tier> parse_tier(std::string_view text);

// A directed path bytes move along. Every transfer is counted against exactly one link.
enum class Link : std::uint8_t { kNvmeToHost = 0, kHostToNvme = 1, kHostToDevice = 2, kDeviceToHost = 3 };
inline constexpr int kNumLinks = 4;
inline constexpr std::array<Link, kNumLinks> kAllLinks = {Link::kNvmeToHost, Link::kHostToNvme, Link::kHostToDevice,
                                                          Link::kDeviceToHost};
// "nvme_to_host", "host_to_nvme", "host_to_device", "device_to_host".
const char* link_name(Link l) noexcept;

enum class DType : std::uint8_t { kF32 = 0, kF16, kBF16, kF64, kI8, kU8, kI32, kI64 };
inline constexpr int kNumDTypes = 8;

// Bytes per element.
std::size_t dtype_size(DType d) noexcept;
// Canonical names: "fp32", "fp16", "bf16", "fp64", "int8", "uint8", "int32", "int64".
const char* dtype_name(DType d) noexcept;
// Accepts the canonical names and the common aliases (float32, float, f32, half, float16,
// bfloat16, double, ...), case-insensitive.
Result<DType> parse_dtype(std::string_view text);

// What a tensor is to the training step. Roles decide defaults (home tier, dtype) and let stats
// and plans talk about "all optimizer state".
// kActivation: tensors saved for backward (activation checkpoints offloaded by an adapter); the
// engine reports their resident bytes per tier apart ("activations.<tier>.*" metrics).
enum class Role : std::uint8_t { kParam = 0, kGrad, kMaster, kExpAvg, kExpAvgSq, kUser, kActivation };
inline constexpr int kNumRoles = 7;
// "param", "grad", "master", "exp_avg", "exp_avg_sq", "user".
const char* role_name(Role r) noexcept;
Result<Role> parse_role(std::string_view text);

// Describes one piece of model state. `group` is the layer or parameter group it belongs to.
struct TensorDesc {
  std::string name;
  DType dtype = DType::kF32;
  std::uint64_t numel = 0;
  Role role = Role::kUser;
  std::int32_t group = 0;

  std::uint64_t bytes() const noexcept { return numel * dtype_size(dtype); }
  // Non-empty name without control characters, numel > 0, bytes that fit in 63 bits.
  Status validate() const;
};

// Memory lent by one component to another: `bytes` bytes at `data`, held for as long as `keep` (or
// a copy of it) lives. E.g. Engine::reserve_host hands an offloaded optimizer pinned host memory
// that counts against tier.budgets.host.
struct PinnedRegion {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  std::shared_ptr<void> keep;
};

// Room in a budget held for another component (Engine::reserve_nvme: an offloaded optimizer's
// extents in the engine's swap space, inside tier.budgets.nvme): `bytes` count until `keep` (and
// every copy of it) is gone.
struct Reservation {
  std::uint64_t bytes = 0;
  std::shared_ptr<void> keep;
};

}  // namespace tier
