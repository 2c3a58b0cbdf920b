// tier/units.hpp — byte sizes and rates as people write them ("4G", "512KiB", "1.5GB").
//
// Thread safety: pure functions; safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tier/status.hpp"

namespace tier {

// Parses a byte count. A bare number is bytes. Suffixes (case-insensitive, optional "B"):
// K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, MB, GB, TB are powers of 1000.
// Fractions are allowed with a suffix ("1.5G") when the result is a whole number of bytes.
// Errors name the text and what is allowed.
Result<std::uint64_t> parse_size(std::string_view text);

// "1.50 GiB", "512 KiB", "17 B".
std::string format_bytes(std::uint64_t bytes);
// "3.21 GB/s" (decimal, as disks and links are rated).
std::string format_rate(double bytes_per_second);
// "12.3 ms", "4.56 s", "850 us".
std::string format_seconds(double seconds);

}  // namespace tier
