// Free-space map of one swap file: best-fit allocation of 4 KiB-aligned runs, coalesced on free.
//
// Thread safety: none; the swap space calls it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace tier::nvme::detail {

class ExtentAllocator {
 public:
  static constexpr std::uint64_t kGranule = 4096;

  explicit ExtentAllocator(std::uint64_t capacity);

  // Offset of a free run of `bytes` (a multiple of kGranule), the smallest that fits, taken from
  // its low end; nullopt when none fits.
  std::optional<std::uint64_t> allocate(std::uint64_t bytes);
  // Returns [offset, offset + bytes) to the free map, merging it with free neighbours.
  void release(std::uint64_t offset, std::uint64_t bytes);

  std::uint64_t capacity() const noexcept { return capacity_; }
  std::uint64_t free_bytes() const noexcept { return free_; }
  std::uint64_t used_bytes() const noexcept { return capacity_ - free_; }
  std::uint64_t largest_free() const noexcept { return by_len_.empty() ? 0 : by_len_.rbegin()->first; }
  std::uint64_t free_runs() const noexcept { return by_off_.size(); }
  // 1 - largest free run / free bytes: 0 when the free space is one run (or there is none).
  double fragmentation() const noexcept {
    return free_ ? 1.0 - static_cast<double>(largest_free()) / static_cast<double>(free_) : 0.0;
  }

 private:
  void insert(std::uint64_t offset, std::uint64_t bytes);
  void erase(std::map<std::uint64_t, std::uint64_t>::iterator it);

  std::uint64_t capacity_;
  std::uint64_t free_ = 0;
  std::map<std::uint64_t, std::uint64_t> by_off_;  // offset -> length
  // (length, offset), so the best fit with the lowest offset is one lower_bound and any run is
  // found in O(log n), however many runs share a length.
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_len_;
};

}  // namespace tier::nvme::detail
