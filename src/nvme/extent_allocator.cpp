#include "nvme/extent_allocator.hpp"

namespace tier::nvme::detail {

ExtentAllocator::ExtentAllocator(std::uint64_t capacity) : capacity_(capacity / kGranule * kGranule) {
  if (capacity_ > 0) insert(0, capacity_);
}

void ExtentAllocator::insert(std::uint64_t offset, std::uint64_t bytes) {
  by_off_.emplace(offset, bytes);
  by_len_.emplace(bytes, offset);
  free_ += bytes;
}

void ExtentAllocator::erase(std::map<std::uint64_t, std::uint64_t>::iterator it) {
  by_len_.erase({it->second, it->first});
  free_ -= it->second;
  by_off_.erase(it);
}

std::optional<std::uint64_t> ExtentAllocator::allocate(std::uint64_t bytes) {
  if (bytes == 0 || bytes % kGranule != 0) return std::nullopt;
  // The shortest run that fits and, among runs of that length, the lowest offset (which keeps
  // allocations packed at the front).
  auto best = by_len_.lower_bound({bytes, 0});
  if (best == by_len_.end()) return std::nullopt;
  const std::uint64_t offset = best->second;
  const std::uint64_t length = best->first;
  erase(by_off_.find(offset));
  if (length > bytes) insert(offset + bytes, length - bytes);
  return offset;
}

void ExtentAllocator::release(std::uint64_t offset, std::uint64_t bytes) {
  if (bytes == 0) return;
  std::uint64_t start = offset;
  std::uint64_t end = offset + bytes;
  auto next = by_off_.lower_bound(offset);
  if (next != by_off_.end() && next->first == end) {
    end += next->second;
    erase(next);
  }
  auto after = by_off_.lower_bound(start);
  if (after != by_off_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      start = prev->first;
      erase(prev);
    }
  }
  insert(start, end - start);
}

}  // namespace tier::nvme::detail
