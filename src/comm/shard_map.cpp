// ShardMap: the ZeRO partition layout shared with tier.torch (see tier/comm.hpp).
#include <algorithm>

#include "tier/comm.hpp"

namespace tier {

Result<ShardMap> ShardMap::create(std::uint64_t numel, int world) {
  if (world < 1) return invalid_argument(str("shard map: world ", world, " must be at least 1"));
  const auto w = static_cast<std::uint64_t>(world);
  return ShardMap(numel, world, numel / w + (numel % w != 0 ? 1 : 0));
}

std::uint64_t ShardMap::offset(int rank) const noexcept {
  if (rank <= 0) return 0;
  return std::min(numel_, shard_ * static_cast<std::uint64_t>(rank));
}

std::uint64_t ShardMap::count(int rank) const noexcept {
  if (rank < 0 || rank >= world_) return 0;
  const std::uint64_t begin = offset(rank);
  return std::min(numel_, begin + shard_) - begin;
}

int ShardMap::owner(std::uint64_t i) const noexcept {
  if (shard_ == 0) return 0;
  return static_cast<int>(std::min<std::uint64_t>(i / shard_, static_cast<std::uint64_t>(world_ - 1)));
}

}  // namespace tier
