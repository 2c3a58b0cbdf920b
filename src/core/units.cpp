#include "tier/units.hpp"

#include <cmath>
#include <cstdio>
#include <limits>

#include "core/text.hpp"

namespace tier {

namespace {
Status bad_size(std::string_view text, std::string_view why) {
  return invalid_argument(str("size '", detail::printable(text), "' ", why,
                              "; write a byte count such as 4096, 512K, 4M, 1.5G or 2GiB "
                              "(K/M/G/T and KiB.. are powers of 1024, KB/MB/GB/TB powers of 1000)"));
}
}  // namespace

Result<std::uint64_t> parse_size(std::string_view text) {
  const std::string s = detail::trim(text);
  if (s.empty()) return bad_size(text, "is empty");
  std::size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  const std::string number = s.substr(0, i);
  std::string suffix = detail::lower(detail::trim(s.substr(i)));
  if (number.empty() || number == "." || number.find('.') != number.rfind('.')) {
    return bad_size(text, "is not a number");
  }
  double mult = 0;
  static const struct {
    const char* unit;
    double mult;
  } kUnits[] = {
      {"", 1},         {"b", 1},       {"k", 0x1p10},   {"ki", 0x1p10}, {"kib", 0x1p10}, {"kb", 1e3},
      {"m", 0x1p20},   {"mi", 0x1p20}, {"mib", 0x1p20}, {"mb", 1e6},    {"g", 0x1p30},   {"gi", 0x1p30},
      {"gib", 0x1p30}, {"gb", 1e9},    {"t", 0x1p40},   {"ti", 0x1p40}, {"tib", 0x1p40}, {"tb", 1e12},
  };
  for (const auto& u : kUnits) {
    if (suffix == u.unit) mult = u.mult;
  }
  if (mult == 0) return bad_size(text, "has an unknown unit");
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (end == nullptr || *end != '\0' || !std::isfinite(value)) return bad_size(text, "is not a number");
  const double bytes = value * mult;
  if (bytes >= 18446744073709551615.0) return bad_size(text, "does not fit in 64 bits");
  if (bytes != std::floor(bytes)) return bad_size(text, "is not a whole number of bytes");
  if (number.find('.') != std::string::npos && mult == 1) return bad_size(text, "is not a whole number of bytes");
  return static_cast<std::uint64_t>(bytes);
}

std::string format_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  }
  return buf;
}

std::string format_rate(double bps) {
  static const char* units[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  int u = 0;
  while (bps >= 1000.0 && u < 4) {
    bps /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", bps, units[u]);
  return buf;
}

std::string format_seconds(double s) {
  char buf[32];
  if (s >= 1.0) {
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  }
  return buf;
}

}  // namespace tier
