// Scalar references for the CPU kernel tests, written independently of the SIMD code: fp16 through
// the compiler's _Float16, bf16 by comparing the two neighbouring bf16 values in fp64, Adam in fp64.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tier/cpu_kernels.hpp"

namespace tier::cpu::testing {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t ref_f32_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  std::uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float ref_f16_to_f32(std::uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

inline float ref_bf16_to_f32(std::uint16_t u) {
  return float_of(static_cast<std::uint32_t>(u) << 16);
}
// Value of a bf16 pattern as a double; the pattern just past the largest finite value (the
// infinity) is taken as 2^128 so that it competes fairly in rounding.
inline double bf16_value_for_rounding(std::uint32_t pattern16) {
  if ((pattern16 & 0x7FFFu) == 0x7F80u) return (pattern16 & 0x8000u) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  return static_cast<double>(ref_bf16_to_f32(static_cast<std::uint16_t>(pattern16)));
}
inline std::uint16_t ref_f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  if (std::isinf(f)) return f > 0 ? 0x7F80 : 0xFF80;
  const std::uint32_t lo = bits_of(f) >> 16;  // truncated towards zero
  const std::uint32_t hi = lo + 1;            // one bf16 step away from zero
  const double x = f;
  const double dlo = std::fabs(x - bf16_value_for_rounding(lo));
  const double dhi = std::fabs(bf16_value_for_rounding(hi) - x);
  if (dlo < dhi) return static_cast<std::uint16_t>(lo);
  if (dhi < dlo) return static_cast<std::uint16_t>(hi);
  return static_cast<std::uint16_t>((lo & 1u) ? hi : lo);
}

inline float ref_round(float f, DType d) {
  if (d == DType::kF16) return ref_f16_to_f32(ref_f32_to_f16(f));
  if (d == DType::kBF16) return ref_bf16_to_f32(ref_f32_to_bf16(f));
  return f;
}

// A typed buffer for tests: values kept as fp32, stored in `dtype`.
struct Buffer {
  DType dtype = DType::kF32;
  std::vector<std::uint8_t> bytes;
  std::uint64_t n = 0;

  Buffer() = default;
  Buffer(DType d, std::uint64_t count) : dtype(d), bytes(count * dtype_size(d) + 64), n(count) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  TensorRef ref() { return {data(), dtype, n}; }
  ConstTensorRef cref() const { return {data(), dtype, n}; }
  float get(std::uint64_t i) const {
    if (dtype == DType::kF32) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    }
    std::uint16_t u;
    std::memcpy(&u, bytes.data() + 2 * i, 2);
    return dtype == DType::kF16 ? ref_f16_to_f32(u) : ref_bf16_to_f32(u);
  }
  std::uint16_t raw16(std::uint64_t i) const {
    std::uint16_t u;
    std::memcpy(&u, bytes.data() + 2 * i, 2);
    return u;
  }
  // Stores f rounded to the buffer's dtype (reference rounding).
  void set(std::uint64_t i, float f) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
      return;
    }
    const std::uint16_t u = dtype == DType::kF16 ? ref_f32_to_f16(f) : ref_f32_to_bf16(f);
    std::memcpy(bytes.data() + 2 * i, &u, 2);
  }
  bool same_bytes(const Buffer& o) const {
    return n == o.n && dtype == o.dtype && std::memcmp(bytes.data(), o.bytes.data(), n * dtype_size(dtype)) == 0;
  }
};

// Runs `body` once per SIMD target this binary and CPU offer, with that target forced; restores
// automatic choice afterwards. The body gets the target's name for messages.
template <class F>
void for_each_simd_target(F&& body) {
  for (const std::string& t : simd_targets()) {
    const Status s = force_simd_target(t);
    if (!s.ok()) {
      ADD_FAILURE() << s;
      continue;
    }
    body(t);
  }
  force_simd_target("auto").ignore();
}

}  // namespace tier::cpu::testing
