// Per-target vector loads and stores of fp32, fp16 and bf16 as fp32 lanes, shared by the CPU
// kernels (cpu_kernels.cpp, cpu_adam.cpp). Included once per Highway target from inside
// foreach_target, hence the toggling include guard.
//
// Why not Highway's own PromoteTo/DemoteTo everywhere: in Highway 1.0.3, DemoteTo(bf16) truncates
// instead of rounding to nearest-even, and on targets without F16C (SSSE3, SSE4, EMU128) the fp16
// conversions truncate on the way down and turn fp16 infinities into finite numbers on the way up.
// Training needs round-to-nearest-even (what PyTorch and CUDA do) and exact inf/nan handling, so
// only the hardware F16C path is taken from Highway; everything else is integer and float
// arithmetic that is exact on every target.
//
// Rounding assumes the default floating-point environment (round to nearest); flush-to-zero or
// denormals-are-zero modes would flush fp32 denormals, which round to fp16/bf16 zero anyway or
// to the same bf16 denormal truncated.

// TIER_KERNEL_INLINE marks the kernels' vector helpers. Optimized builds force them inline
// (HWY_INLINE), which keeps every lane in registers; sanitizer builds define TIER_LIGHT_KERNELS
// (src/cpu/CMakeLists.txt) and leave the choice to the compiler, because forcing each helper into
// each of the hundreds of (dtype, rule) instantiations, per target and instrumented, is what made
// one kernel file take tens of minutes and gigabytes to compile. The arithmetic is the same.
#ifndef TIER_KERNEL_INLINE
#if defined(TIER_LIGHT_KERNELS) && TIER_LIGHT_KERNELS
#define TIER_KERNEL_INLINE inline
#else
#define TIER_KERNEL_INLINE HWY_INLINE
#endif
#endif

#if defined(TIER_CPU_SIMD_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TIER_CPU_SIMD_CONVERT_INL_H_
#undef TIER_CPU_SIMD_CONVERT_INL_H_
#else
#define TIER_CPU_SIMD_CONVERT_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Element kinds the kernels are instantiated for (matching tier::DType's numbering is not needed).
enum class Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 3 };

#undef TIER_HWY_HARDWARE_F16
#if (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) && !defined(HWY_DISABLE_F16C)
#define TIER_HWY_HARDWARE_F16 1
#else
#define TIER_HWY_HARDWARE_F16 0
#endif

// ---------------------------------------------------------------------------------------------
// Bit-level conversions on u32 lanes (each lane holds one 16-bit pattern or one fp32 pattern).

// bf16 bits (in the low half of each u32 lane) -> fp32. Exact: bf16 is the top half of an fp32.
template <class DF, class VU = hn::Vec<hn::RebindToUnsigned<DF>>>
TIER_KERNEL_INLINE hn::Vec<DF> Bf16BitsToF32(DF df, VU bits) {
  return hn::BitCast(df, hn::ShiftLeft<16>(bits));
}

// fp32 -> bf16 bits (low half of each u32 lane), rounding to nearest-even. NaNs stay NaNs (quiet);
// values that round past the largest bf16 become infinities, as IEEE rounding requires.
template <class DF>
TIER_KERNEL_INLINE hn::Vec<hn::RebindToUnsigned<DF>> F32ToBf16Bits(DF df, hn::Vec<DF> v) {
  (void)df;
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x0040u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
}

// fp16 bits (low half of each u32 lane) -> fp32. Exact for every input, including subnormals,
// infinities and NaNs.
template <class DF, class VU = hn::Vec<hn::RebindToUnsigned<DF>>>
TIER_KERNEL_INLINE hn::Vec<DF> F16BitsToF32(DF df, VU bits) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto sign = hn::ShiftLeft<16>(hn::And(bits, hn::Set(du, 0x8000u)));
  const auto mag = hn::And(bits, hn::Set(du, 0x7FFFu));
  // Normal numbers: move exponent and mantissa into place and rebias the exponent (15 -> 127).
  const auto normal = hn::Add(hn::ShiftLeft<13>(mag), hn::Set(du, (127u - 15u) << 23));
  // Subnormals (and zero): the mantissa counts units of 2^-24; int -> float and the scaling by a
  // power of two are both exact.
  const auto sub =
      hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), hn::Set(df, 5.9604644775390625e-8f)));
  // Infinities and NaNs: all-ones exponent, the mantissa kept (a NaN stays a NaN).
  const auto special = hn::Or(hn::ShiftLeft<13>(mag), hn::Set(du, 0x7F800000u));
  const auto magi = hn::BitCast(di, mag);
  const auto is_sub = hn::Lt(magi, hn::Set(di, 0x0400));
  const auto is_special = hn::Gt(magi, hn::Set(di, 0x7BFF));
  auto r = hn::IfThenElse(hn::RebindMask(du, is_sub), sub, normal);
  r = hn::IfThenElse(hn::RebindMask(du, is_special), special, r);
  return hn::BitCast(df, hn::Or(r, sign));
}

// fp32 -> fp16 bits (low half of each u32 lane), rounding to nearest-even; overflow gives
// infinity, NaN gives a quiet NaN.
template <class DF>
TIER_KERNEL_INLINE hn::Vec<hn::RebindToUnsigned<DF>> F32ToF16Bits(DF df, hn::Vec<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  const auto mag = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  // Normal fp16 range: rebias the exponent (127 -> 15), then drop 13 mantissa bits rounding to
  // nearest-even; a carry out of the mantissa correctly bumps the exponent.
  const auto rebiased = hn::Sub(mag, hn::Set(du, (127u - 15u) << 23));
  const auto odd = hn::And(hn::ShiftRight<13>(rebiased), hn::Set(du, 1u));
  const auto normal = hn::ShiftRight<13>(hn::Add(rebiased, hn::Add(hn::Set(du, 0x0FFFu), odd)));
  // Subnormal fp16 range (|v| < 2^-14): adding 0.5 puts the value's units of 2^-24 in the low
  // mantissa bits of the sum, rounded to nearest-even by the FPU; 1024 is the smallest normal,
  // which is also the right encoding when a value rounds up into it.
  const auto abs_v = hn::BitCast(df, mag);
  const auto sub = hn::Sub(hn::BitCast(du, hn::Add(abs_v, hn::Set(df, 0.5f))), hn::Set(du, 0x3F000000u));
  const auto magi = hn::BitCast(di, mag);
  auto r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(magi, hn::Set(di, 0x38800000))), sub, normal);
  // 65520 and above round to infinity.
  r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(magi, hn::Set(di, 0x477FEFFF))), hn::Set(du, 0x7C00u), r);
  r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(magi, hn::Set(di, 0x7F800000))), hn::Set(du, 0x7E00u), r);
  return hn::Or(r, sign);
}

// ---------------------------------------------------------------------------------------------
// Loads and stores of `Lanes(df)` elements of kind K at p, as fp32 lanes.

template <Kind K, class DF>
TIER_KERNEL_INLINE hn::Vec<DF> LoadAsF32(DF df, const void* p) {
  if constexpr (K == Kind::kF32) {
    return hn::LoadU(df, static_cast<const float*>(p));
  } else {
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<std::uint16_t, DF> du16;
    const auto h = hn::LoadU(du16, static_cast<const std::uint16_t*>(p));
    if constexpr (K == Kind::kBF16) {
      return Bf16BitsToF32(df, hn::PromoteTo(du, h));
    } else {
#if TIER_HWY_HARDWARE_F16
      const hn::Rebind<hwy::float16_t, DF> df16;
      return hn::PromoteTo(df, hn::BitCast(df16, h));
#else
      return F16BitsToF32(df, hn::PromoteTo(du, h));
#endif
    }
  }
}

template <Kind K, class DF>
TIER_KERNEL_INLINE void StoreFromF32(DF df, hn::Vec<DF> v, void* p) {
  if constexpr (K == Kind::kF32) {
    hn::StoreU(v, df, static_cast<float*>(p));
  } else if constexpr (K == Kind::kNone) {
    (void)df;
    (void)v;
    (void)p;
  } else {
    const hn::Rebind<std::uint16_t, DF> du16;
    const hn::RebindToSigned<DF> di;
    if constexpr (K == Kind::kBF16) {
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, F32ToBf16Bits(df, v))), du16, static_cast<std::uint16_t*>(p));
    } else {
#if TIER_HWY_HARDWARE_F16
      const hn::Rebind<hwy::float16_t, DF> df16;
      hn::StoreU(hn::BitCast(du16, hn::DemoteTo(df16, v)), du16, static_cast<std::uint16_t*>(p));
#else
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, F32ToF16Bits(df, v))), du16, static_cast<std::uint16_t*>(p));
#endif
    }
  }
}

// v rounded to kind K and back (exactly what StoreFromF32 + LoadAsF32 would give).
template <Kind K, class DF>
TIER_KERNEL_INLINE hn::Vec<DF> RoundTo(DF df, hn::Vec<DF> v) {
  if constexpr (K == Kind::kBF16) {
    return Bf16BitsToF32(df, F32ToBf16Bits(df, v));
  } else if constexpr (K == Kind::kF16) {
    HWY_ALIGN std::uint16_t tmp[HWY_MAX_BYTES / sizeof(float)];
    StoreFromF32<K>(df, v, tmp);
    return LoadAsF32<K>(df, tmp);
  } else {
    return v;
  }
}

constexpr std::size_t ElemBytes(Kind k) {
  return k == Kind::kF32 ? 4 : (k == Kind::kNone ? 0 : 2);
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
