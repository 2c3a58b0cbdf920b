// Internal: CRC-32C (Castagnoli), the checksum of tier's checkpoint records. SSE4.2's crc32
// instruction where the CPU has it (chosen at run time), a slice-by-8 table otherwise; both give
// the same values (tested against the standard check value).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tier::optim::detail {

// Extends `crc` (0 for a fresh checksum) over n bytes: crc32c(a || b) == crc32c_extend(crc32c(a), b).
std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t n) noexcept;

// The portable table path alone (for tests of the hardware path).
std::uint32_t crc32c_extend_portable(std::uint32_t crc, const void* data, std::size_t n) noexcept;

inline std::uint32_t crc32c(const void* data, std::size_t n) noexcept {
  return crc32c_extend(0, data, n);
}

}  // namespace tier::optim::detail
