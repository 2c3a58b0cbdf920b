// Compressed optimizer state (tier/state_codec.hpp): the bf16 and block-int8 codecs for every
// Highway target, the fused update over such state, and the argument checks of the state tensors.
//
// The update goes block by block (256 elements): the block's m and v are widened into fp32
// scratch that stays in L1, the fp32-state kernel of cpu_adam.cpp updates them together with the
// params in place, and they are narrowed back. Only the compressed bytes are read from and written
// to memory; every optimizer kind, gradient dtype and `out` of the fp32 kernel carries over with
// the same arithmetic; and a block is always handled whole by one call, so any chunking along
// block boundaries and any thread count give the same bytes.
#include "tier/state_codec.hpp"

#include "cpu/cpu_adam_internal.hpp"

#ifndef TIER_CPU_STATE_CODES_
#define TIER_CPU_STATE_CODES_
namespace tier::cpu::detail {
// fp32 bit patterns the codes are built on (the same for every target).
constexpr std::int32_t kMinNormalBits = 0x38800000;  // 2^-14, the smallest normal value of both codes
constexpr std::int32_t kMagic64Bits = 0x42800000;    // 64.0f: its ulp is 2^-17, m's subnormal step
constexpr std::int32_t kMagic32Bits = 0x42000000;    // 32.0f: its ulp is 2^-18, v's subnormal step
constexpr std::int32_t kNonFiniteBits = 0x7F800000;  // |x| bits at or above: infinity or NaN
constexpr float kMaxM = 1.875f;                      // value of m's code 127
constexpr float kMaxV = 1.9375f;                     // value of v's code 255
}  // namespace tier::cpu::detail
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/cpu_adam_compressed.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

// Must come after foreach_target.h/highway.h so that it is re-included for each target.
#include "cpu/simd_convert-inl.h"

#include <algorithm>
#include <cstring>
#include <limits>

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using detail::AdamPtrs;
using detail::StatePtrs;

constexpr std::size_t kBlock = kStateBlock;
// Families as ints for the dispatch tables (StateDType's values): bf16, else int8.
constexpr int kFamilyBF16 = 1;

using detail::kMagic32Bits;
using detail::kMagic64Bits;
using detail::kMaxM;
using detail::kMaxV;
using detail::kMinNormalBits;
using detail::kNonFiniteBits;

// ---------------------------------------------------------------------------------------------
// The 8-bit codes on vectors. y is the magnitude divided by the block scale (>= 0, finite).

// m's magnitude code (0..127): 4 exponent bits, 3 mantissa bits, round to nearest, ties to the
// even code. Normal range: the fp32 bits rounded to 3 mantissa bits by an integer add (a carry
// correctly bumps the exponent), exponent rebiased 127 -> 15 (896 = 112 << 3). Below 2^-14: whole
// units of 2^-17, rounded by the FPU when y is added to 64 (whose ulp is 2^-17).
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> CodeM(DF df, hn::Vec<DF> y) {
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(di, y);
  const auto lsb = hn::And(hn::ShiftRight<20>(bits), hn::Set(di, 1));
  const auto normal = hn::Sub(hn::ShiftRight<20>(hn::Add(bits, hn::Add(hn::Set(di, 0x7FFFF), lsb))), hn::Set(di, 896));
  const auto sub = hn::Sub(hn::BitCast(di, hn::Add(y, hn::Set(df, 64.0f))), hn::Set(di, kMagic64Bits));
  const auto k = hn::IfThenElse(hn::Lt(bits, hn::Set(di, kMinNormalBits)), sub, normal);
  return hn::Min(k, hn::Set(di, 127));
}

// The value of m's magnitude code k (0..127).
template <class DF, class VI>
HWY_INLINE hn::Vec<DF> ValueM(DF df, VI k) {
  const hn::RebindToSigned<DF> di;
  const auto normal = hn::BitCast(df, hn::ShiftLeft<20>(hn::Add(k, hn::Set(di, 896))));
  const auto sub = hn::Mul(hn::ConvertTo(df, k), hn::Set(df, 0x1p-17f));
  return hn::IfThenElse(hn::RebindMask(df, hn::Lt(k, hn::Set(di, 8))), sub, normal);
}

// sqrt(v)'s code (0..255): 4 exponent bits, 4 mantissa bits (1792 = 112 << 4); below 2^-14 whole
// units of 2^-18. A positive y gets at least code 1.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> CodeV(DF df, hn::Vec<DF> y) {
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(di, y);
  const auto lsb = hn::And(hn::ShiftRight<19>(bits), hn::Set(di, 1));
  const auto normal = hn::Sub(hn::ShiftRight<19>(hn::Add(bits, hn::Add(hn::Set(di, 0x3FFFF), lsb))), hn::Set(di, 1792));
  const auto sub = hn::Sub(hn::BitCast(di, hn::Add(y, hn::Set(df, 32.0f))), hn::Set(di, kMagic32Bits));
  auto k = hn::IfThenElse(hn::Lt(bits, hn::Set(di, kMinNormalBits)), sub, normal);
  k = hn::Min(k, hn::Set(di, 255));
  const auto positive = hn::Gt(bits, hn::Zero(di));
  return hn::IfThenElse(positive, hn::Max(k, hn::Set(di, 1)), k);
}

template <class DF, class VI>
HWY_INLINE hn::Vec<DF> ValueV(DF df, VI k) {
  const hn::RebindToSigned<DF> di;
  const auto normal = hn::BitCast(df, hn::ShiftLeft<19>(hn::Add(k, hn::Set(di, 1792))));
  const auto sub = hn::Mul(hn::ConvertTo(df, k), hn::Set(df, 0x1p-18f));
  return hn::IfThenElse(hn::RebindMask(df, hn::Lt(k, hn::Set(di, 16))), sub, normal);
}

// The largest |x| bit pattern of one block of kBlock floats (padding zeros do not change it).
// Integer max on the magnitude bits: finite values order as their bits do, and an infinity or a
// NaN shows as a pattern >= kNonFiniteBits on every target (a float max would drop NaNs on some).
template <class DF>
HWY_INLINE std::int32_t MaxMagnitudeBits(DF df, const float* x) {
  const hn::RebindToSigned<DF> di;
  const std::size_t N = hn::Lanes(df);
  auto acc = hn::Zero(di);
  for (std::size_t i = 0; i < kBlock; i += N) {
    acc = hn::Max(acc, hn::And(hn::BitCast(di, hn::LoadU(df, x + i)), hn::Set(di, 0x7FFFFFFF)));
  }
  return hn::GetLane(hn::MaxOfLanes(di, acc));
}

// A decoded value may round a hair past the block's largest input; near FLT_MAX that would be an
// infinity, so it is held at FLT_MAX. NaNs (a non-finite block's NaN scale) stay NaN.
template <class DF>
HWY_INLINE hn::Vec<DF> ClampToMax(DF df, hn::Vec<DF> x) {
  const auto max = hn::Set(df, std::numeric_limits<float>::max());
  return hn::IfThenElse(hn::Gt(x, max), max, x);
}

// ---------------------------------------------------------------------------------------------
// One block (kBlock elements, buffers padded to kBlock) between codes and fp32.

void DecodeBlockM8(const std::int8_t* q, float scale, float* x) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<std::int8_t, decltype(df)> d8;
  const std::size_t N = hn::Lanes(df);
  for (std::size_t i = 0; i < kBlock; i += N) {
    const auto qi = hn::PromoteTo(di, hn::LoadU(d8, q + i));
    auto mag = hn::Mul(ValueM(df, hn::Min(hn::Abs(qi), hn::Set(di, 127))), hn::Set(df, scale));
    mag = ClampToMax(df, mag);
    hn::StoreU(hn::IfThenElse(hn::RebindMask(df, hn::Lt(qi, hn::Zero(di))), hn::Neg(mag), mag), df, x + i);
  }
}

float EncodeBlockM8(const float* x, std::int8_t* q) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<std::int8_t, decltype(df)> d8;
  const std::size_t N = hn::Lanes(df);
  const std::int32_t max_bits = MaxMagnitudeBits(df, x);
  if (max_bits == 0 || max_bits >= kNonFiniteBits) {
    std::memset(q, 0, kBlock);
    return max_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  float absmax;
  std::memcpy(&absmax, &max_bits, sizeof(absmax));
  const float scale = absmax / kMaxM;
  const auto vscale = hn::Set(df, scale);
  for (std::size_t i = 0; i < kBlock; i += N) {
    const auto v = hn::LoadU(df, x + i);
    const auto k = CodeM(df, hn::Div(hn::Abs(v), vscale));
    const auto s = hn::IfThenElse(hn::RebindMask(di, hn::Lt(v, hn::Zero(df))), hn::Neg(k), k);
    hn::StoreU(hn::DemoteTo(d8, s), d8, q + i);
  }
  return scale;
}

void DecodeBlockV8(const std::uint8_t* q, float scale, float* x) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<std::uint8_t, decltype(df)> d8;
  const std::size_t N = hn::Lanes(df);
  for (std::size_t i = 0; i < kBlock; i += N) {
    const auto s = hn::Mul(ValueV(df, hn::PromoteTo(di, hn::LoadU(d8, q + i))), hn::Set(df, scale));
    hn::StoreU(ClampToMax(df, hn::Mul(s, s)), df, x + i);
  }
}

float EncodeBlockV8(const float* x, std::uint8_t* q) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<std::uint8_t, decltype(df)> d8;
  const std::size_t N = hn::Lanes(df);
  HWY_ALIGN float s[kBlock];
  for (std::size_t i = 0; i < kBlock; i += N) hn::Store(hn::Sqrt(hn::LoadU(df, x + i)), df, s + i);
  // A negative v has a NaN root and so makes the block non-finite; -0 has root -0, magnitude 0.
  const std::int32_t max_bits = MaxMagnitudeBits(df, s);
  if (max_bits == 0 || max_bits >= kNonFiniteBits) {
    std::memset(q, 0, kBlock);
    return max_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  float smax;
  std::memcpy(&smax, &max_bits, sizeof(smax));
  const float scale = smax / kMaxV;
  const auto vscale = hn::Set(df, scale);
  for (std::size_t i = 0; i < kBlock; i += N) {
    const auto k = CodeV(df, hn::Div(hn::Abs(hn::Load(df, s + i)), vscale));
    hn::StoreU(hn::DemoteTo(d8, k), d8, q + i);
  }
  return scale;
}

void DecodeBlockBF16(const std::uint16_t* h, float* x) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  for (std::size_t i = 0; i < kBlock; i += N) hn::StoreU(LoadAsF32<Kind::kBF16>(df, h + i), df, x + i);
}

void EncodeBlockBF16(const float* x, std::uint16_t* h) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  for (std::size_t i = 0; i < kBlock; i += N) StoreFromF32<Kind::kBF16>(df, hn::LoadU(df, x + i), h + i);
}

// One moment of one block in its state dtype: where its elements and scale are, and scratch.
struct Moment {
  void* data;    // `len` elements of the moment's state dtype
  float* scale;  // int8 only
  bool is_sq;    // exp_avg_sq (v) rather than exp_avg (m)
};

// Widens `len` elements of a moment into x[0, kBlock), zeros after len. A whole block is read in
// place; a partial one (a tensor's last) through a zero-padded copy.
void DecodeBlock(int family, const Moment& mo, std::size_t len, float* x) {
  if (family == kFamilyBF16) {
    if (len == kBlock) return DecodeBlockBF16(static_cast<const std::uint16_t*>(mo.data), x);
    HWY_ALIGN std::uint16_t h[kBlock] = {};
    std::memcpy(h, mo.data, len * sizeof(std::uint16_t));
    return DecodeBlockBF16(h, x);
  }
  HWY_ALIGN std::uint8_t pad[kBlock] = {};
  const std::uint8_t* q = static_cast<const std::uint8_t*>(mo.data);
  if (len != kBlock) q = static_cast<const std::uint8_t*>(std::memcpy(pad, mo.data, len));
  if (mo.is_sq) {
    DecodeBlockV8(q, *mo.scale, x);
  } else {
    DecodeBlockM8(reinterpret_cast<const std::int8_t*>(q), *mo.scale, x);
  }
}

// Narrows x[0, len) (zeros after len) into the moment's `len` elements and its scale.
void EncodeBlock(int family, const float* x, std::size_t len, const Moment& mo) {
  if (family == kFamilyBF16) {
    if (len == kBlock) return EncodeBlockBF16(x, static_cast<std::uint16_t*>(mo.data));
    HWY_ALIGN std::uint16_t h[kBlock];
    EncodeBlockBF16(x, h);
    std::memcpy(mo.data, h, len * sizeof(std::uint16_t));
    return;
  }
  HWY_ALIGN std::uint8_t pad[kBlock];
  std::uint8_t* q = len == kBlock ? static_cast<std::uint8_t*>(mo.data) : pad;
  *mo.scale = mo.is_sq ? EncodeBlockV8(x, q) : EncodeBlockM8(x, reinterpret_cast<std::int8_t*>(q));
  if (len != kBlock) std::memcpy(mo.data, pad, len);
}

std::size_t StateElemBytes(int family) {
  return family == kFamilyBF16 ? 2 : 1;
}

// ---------------------------------------------------------------------------------------------
// Entry points (one per target, dispatched from the HWY_ONCE part below).

// Blocks widened at a time: the fp32 kernel runs on kStage * kBlock elements per call (16 KiB of
// scratch for m and v, well inside L1), which amortizes its dispatch.
constexpr std::size_t kStage = 8;

// The update over `n` elements from a block boundary; the last block may be partial.
void CompressedAdam(int family, int pk, int gk, int ok, const AdamStep::Constants& c, const StatePtrs& a,
                    std::size_t n) {
  const bool use_m = c.kind != OptimizerKind::kAdagrad;
  const bool use_v = c.kind != OptimizerKind::kLion;
  const std::size_t es = StateElemBytes(family);
  const std::size_t pes = ElemBytes(pk == 2 ? Kind::kBF16 : Kind::kF32);
  const std::size_t ges = ElemBytes(static_cast<Kind>(gk));
  const std::size_t oes = ok == 3 ? 0 : ElemBytes(static_cast<Kind>(ok));
  HWY_ALIGN float m[kStage * kBlock];
  HWY_ALIGN float v[kStage * kBlock];
  if (!use_m) std::memset(m, 0, sizeof(m));  // read by the kernel, never stored
  if (!use_v) std::memset(v, 0, sizeof(v));
  auto moment = [&](void* base, float* scales, std::size_t at, bool is_sq) {
    return Moment{static_cast<std::uint8_t*>(base) + at * es, scales ? scales + at / kBlock : nullptr, is_sq};
  };
  for (std::size_t at = 0; at < n; at += kStage * kBlock) {
    const std::size_t len = std::min(kStage * kBlock, n - at);
    for (std::size_t j = 0; j * kBlock < len; ++j) {
      const std::size_t b = at + j * kBlock, blen = std::min(kBlock, len - j * kBlock);
      if (use_m) DecodeBlock(family, moment(a.m, a.m_scales, b, false), blen, m + j * kBlock);
      if (use_v) DecodeBlock(family, moment(a.v, a.v_scales, b, true), blen, v + j * kBlock);
    }
    const AdamPtrs p{static_cast<std::uint8_t*>(a.p) + at * pes, m, v, static_cast<const std::uint8_t*>(a.g) + at * ges,
                     a.out ? static_cast<std::uint8_t*>(a.out) + at * oes : nullptr};
    detail::adam_fp32_kernel(pk, gk, ok, c, p, len);
    for (std::size_t j = 0; j * kBlock < len; ++j) {
      const std::size_t b = at + j * kBlock, blen = std::min(kBlock, len - j * kBlock);
      if (use_m) EncodeBlock(family, m + j * kBlock, blen, moment(a.m, a.m_scales, b, false));
      if (use_v) EncodeBlock(family, v + j * kBlock, blen, moment(a.v, a.v_scales, b, true));
    }
  }
}

// The codec over `n` elements from a block boundary: fp32 `x` to/from the moment's format.
void EncodeRange(int family, bool is_sq, const float* x, void* out, float* scales, std::size_t n) {
  const std::size_t es = StateElemBytes(family);
  HWY_ALIGN float buf[kBlock];
  for (std::size_t at = 0, b = 0; at < n; at += kBlock, ++b) {
    const std::size_t len = std::min(kBlock, n - at);
    std::memcpy(buf, x + at, len * sizeof(float));
    std::fill(buf + len, buf + kBlock, 0.0f);
    EncodeBlock(family, buf, len,
                Moment{static_cast<std::uint8_t*>(out) + at * es, scales ? scales + b : nullptr, is_sq});
  }
}

void DecodeRange(int family, bool is_sq, const void* in, const float* scales, float* x, std::size_t n) {
  const std::size_t es = StateElemBytes(family);
  HWY_ALIGN float buf[kBlock];
  for (std::size_t at = 0, b = 0; at < n; at += kBlock, ++b) {
    const std::size_t len = std::min(kBlock, n - at);
    const Moment mo{const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(in)) + at * es,
                    scales ? const_cast<float*>(scales) + b : nullptr, is_sq};
    DecodeBlock(family, mo, len, buf);
    std::memcpy(x + at, buf, len * sizeof(float));
  }
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <cctype>
#include <cmath>
#include <string>

#include "cpu/parallel.hpp"

namespace tier::cpu {

HWY_EXPORT(CompressedAdam);
HWY_EXPORT(EncodeRange);
HWY_EXPORT(DecodeRange);

namespace {

// Elements per piece handed to a thread: a multiple of kStateBlock, so pieces split only at block
// boundaries.
constexpr std::uint64_t kGranule = 32 * 1024;
static_assert(kGranule % kStateBlock == 0);
constexpr int kOutNone = 3;

std::uint64_t blocks_of(std::uint64_t numel) {
  return (numel + kStateBlock - 1) / kStateBlock;
}

// The state dtypes a moment accepts, for messages.
const char* formats_of(StateMoment m) {
  return m == StateMoment::kExpAvg ? "fp32, bf16 or int8" : "fp32, bf16 or uint8";
}

Result<StateDType> family_of_moment(StateMoment m, DType d) {
  if (d == DType::kF32) return StateDType::kF32;
  if (d == DType::kBF16) return StateDType::kBF16;
  if (m == StateMoment::kExpAvg && d == DType::kI8) return StateDType::kInt8;
  if (m == StateMoment::kExpAvgSq && d == DType::kU8) return StateDType::kInt8;
  return invalid_argument(str(state_moment_name(m), ": dtype ", dtype_name(d), " is not a state format; use ",
                              formats_of(m), " (int8 state is exp_avg int8 with exp_avg_sq uint8)"));
}

// The scales of an int8 moment (`int8`), or their absence otherwise.
Status check_scales(const float* scales, bool int8, std::uint64_t numel, const char* what) {
  if (!int8) {
    if (scales != nullptr) {
      return invalid_argument(str(what, ": given, but only int8 state has scales; pass null"));
    }
    return {};
  }
  if (scales == nullptr && numel > 0) {
    return invalid_argument(str(what, ": null, but int8 state needs one fp32 scale per ", kStateBlock, " elements (",
                                blocks_of(numel), " here)"));
  }
  if (reinterpret_cast<std::uintptr_t>(scales) % alignof(float) != 0) {
    return invalid_argument(str(what, ": address 0x", std::hex, reinterpret_cast<std::uintptr_t>(scales), std::dec,
                                " is not aligned to 4-byte fp32 scales"));
  }
  return {};
}

ConstTensorRef scales_ref(const float* scales, std::uint64_t numel) {
  return {scales, DType::kF32, scales == nullptr ? 0 : blocks_of(numel)};
}

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

}  // namespace

const char* state_dtype_name(StateDType d) noexcept {
  switch (d) {
    case StateDType::kF32: return "fp32";
    case StateDType::kBF16: return "bf16";
    case StateDType::kInt8: return "int8";
  }
  return "unknown";
}

Result<StateDType> parse_state_dtype(std::string_view text) {
  const std::string s = lower(text);
  if (s == "fp32" || s == "float32" || s == "f32" || s == "float") return StateDType::kF32;
  if (s == "bf16" || s == "bfloat16") return StateDType::kBF16;
  if (s == "int8" || s == "i8" || s == "q8") return StateDType::kInt8;
  return invalid_argument(str("optimizer state dtype '", text, "' is not known; use fp32, bf16 or int8"));
}

DType exp_avg_dtype(StateDType d) noexcept {
  return d == StateDType::kBF16 ? DType::kBF16 : (d == StateDType::kInt8 ? DType::kI8 : DType::kF32);
}

DType exp_avg_sq_dtype(StateDType d) noexcept {
  return d == StateDType::kBF16 ? DType::kBF16 : (d == StateDType::kInt8 ? DType::kU8 : DType::kF32);
}

Result<StateDType> state_dtype_of(DType exp_avg, DType exp_avg_sq) {
  TIER_ASSIGN_OR_RETURN(const StateDType a, family_of_moment(StateMoment::kExpAvg, exp_avg));
  TIER_ASSIGN_OR_RETURN(const StateDType b, family_of_moment(StateMoment::kExpAvgSq, exp_avg_sq));
  if (a != b) {
    return invalid_argument(str("optimizer state: exp_avg is ", dtype_name(exp_avg), " but exp_avg_sq is ",
                                dtype_name(exp_avg_sq),
                                "; both must be fp32, both bf16, or exp_avg int8 with "
                                "exp_avg_sq uint8"));
  }
  return a;
}

std::uint64_t state_scale_count(StateDType d, std::uint64_t numel) noexcept {
  return d == StateDType::kInt8 ? blocks_of(numel) : 0;
}

std::uint64_t state_bytes(StateDType d, std::uint64_t numel) noexcept {
  return numel * (dtype_size(exp_avg_dtype(d)) + dtype_size(exp_avg_sq_dtype(d))) +
         2 * state_scale_count(d, numel) * sizeof(float);
}

double state_bytes_per_element(StateDType d) noexcept {
  const double scales = d == StateDType::kInt8 ? 2.0 * sizeof(float) / static_cast<double>(kStateBlock) : 0.0;
  return static_cast<double>(dtype_size(exp_avg_dtype(d)) + dtype_size(exp_avg_sq_dtype(d))) + scales;
}

const char* state_moment_name(StateMoment m) noexcept {
  return m == StateMoment::kExpAvg ? "exp_avg" : "exp_avg_sq";
}

// The scalar codes, written the same way as the vector ones (the tests check them against an
// independent nearest-value search and against the vector codec).
float exp_avg_code_value(std::int8_t q) noexcept {
  const int k = std::min(std::abs(static_cast<int>(q)), 127);
  const float mag =
      k < 8 ? static_cast<float>(k) * 0x1p-17f : std::ldexp(1.0f + static_cast<float>(k & 7) / 8.0f, (k >> 3) - 15);
  return q < 0 ? -mag : mag;
}

std::int8_t exp_avg_code_of(float x) noexcept {
  const float y = std::fabs(x);
  std::int32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  std::int32_t k;
  if (std::isnan(y)) {
    k = 0;
  } else if (bits >= detail::kNonFiniteBits) {
    k = 127;
  } else if (bits < detail::kMinNormalBits) {
    const float t = y + 64.0f;
    std::int32_t tb;
    std::memcpy(&tb, &t, sizeof(tb));
    k = tb - detail::kMagic64Bits;
  } else {
    k = std::min(((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 896, 127);
  }
  return static_cast<std::int8_t>(x < 0 ? -k : k);
}

float exp_avg_sq_code_value(std::uint8_t k) noexcept {
  return k < 16 ? static_cast<float>(k) * 0x1p-18f
                : std::ldexp(1.0f + static_cast<float>(k & 15) / 16.0f, (k >> 4) - 15);
}

std::uint8_t exp_avg_sq_code_of(float y) noexcept {
  if (!(y > 0)) return 0;
  std::int32_t bits;
  std::memcpy(&bits, &y, sizeof(bits));
  std::int32_t k;
  if (bits >= detail::kNonFiniteBits) {
    k = 255;
  } else if (bits < detail::kMinNormalBits) {
    const float t = y + 32.0f;
    std::int32_t tb;
    std::memcpy(&tb, &t, sizeof(tb));
    k = tb - detail::kMagic32Bits;
  } else {
    k = std::min(((bits + 0x3FFFF + ((bits >> 19) & 1)) >> 19) - 1792, 255);
  }
  return static_cast<std::uint8_t>(std::max(k, 1));
}

Status encode_state(StateMoment moment, ConstTensorRef in, TensorRef out, float* scales, int threads) {
  detail::init_simd_once();
  const char* name = state_moment_name(moment);
  if (in.dtype != DType::kF32) {
    return invalid_argument(str("encode ", name, ": input dtype ", dtype_name(in.dtype), " is not fp32"));
  }
  TIER_RETURN_IF_ERROR(detail::check_layout(in, str("encode ", name, " input").c_str()));
  TIER_ASSIGN_OR_RETURN(const StateDType fam, family_of_moment(moment, out.dtype));
  TIER_RETURN_IF_ERROR(detail::check_layout(out, str("encode ", name, " output").c_str()));
  TIER_RETURN_IF_ERROR(
      check_scales(scales, fam == StateDType::kInt8, out.numel, str("encode ", name, " scales").c_str()));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  if (in.numel != out.numel) {
    return invalid_argument(str("encode ", name, ": input has ", in.numel, " elements but output ", out.numel));
  }
  const ConstTensorRef sref = scales_ref(scales, out.numel);
  if (detail::overlaps(in, out) || detail::overlaps(in, sref) || detail::overlaps(out, sref)) {
    return invalid_argument(str("encode ", name, ": input, output and scales overlap; give each its own buffer"));
  }
  const auto* x = static_cast<const float*>(in.data);
  for (std::uint64_t i = 0; i < in.numel; ++i) {
    if (!std::isfinite(x[i])) {
      return invalid_argument(str("encode ", name, ": element ", i, " is ", x[i], "; state must be finite"));
    }
    if (moment == StateMoment::kExpAvgSq && x[i] < 0) {
      return invalid_argument(str("encode ", name, ": element ", i, " is ", x[i], "; exp_avg_sq is never negative"));
    }
  }
  if (fam == StateDType::kF32) {
    if (in.numel > 0) std::memcpy(out.data, in.data, in.numel * sizeof(float));
    return {};
  }
  const int f = static_cast<int>(fam);
  const bool is_sq = moment == StateMoment::kExpAvgSq;
  const std::size_t es = dtype_size(out.dtype);
  detail::parallel_ranges(in.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    HWY_DYNAMIC_DISPATCH(EncodeRange)
    (f, is_sq, x + b, static_cast<std::uint8_t*>(out.data) + b * es, scales ? scales + b / kStateBlock : nullptr,
     e - b);
  });
  return {};
}

Status decode_state(StateMoment moment, ConstTensorRef in, const float* scales, TensorRef out, int threads) {
  detail::init_simd_once();
  const char* name = state_moment_name(moment);
  TIER_ASSIGN_OR_RETURN(const StateDType fam, family_of_moment(moment, in.dtype));
  TIER_RETURN_IF_ERROR(detail::check_layout(in, str("decode ", name, " input").c_str()));
  if (out.dtype != DType::kF32) {
    return invalid_argument(str("decode ", name, ": output dtype ", dtype_name(out.dtype), " is not fp32"));
  }
  TIER_RETURN_IF_ERROR(detail::check_layout(out, str("decode ", name, " output").c_str()));
  TIER_RETURN_IF_ERROR(
      check_scales(scales, fam == StateDType::kInt8, in.numel, str("decode ", name, " scales").c_str()));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  if (in.numel != out.numel) {
    return invalid_argument(str("decode ", name, ": input has ", in.numel, " elements but output ", out.numel));
  }
  const ConstTensorRef sref = scales_ref(scales, in.numel);
  if (detail::overlaps(in, out) || detail::overlaps(out, sref)) {
    return invalid_argument(str("decode ", name, ": output overlaps the input or the scales; give it its own buffer"));
  }
  if (fam == StateDType::kF32) {
    if (in.numel > 0) std::memcpy(out.data, in.data, in.numel * sizeof(float));
    return {};
  }
  const int f = static_cast<int>(fam);
  const bool is_sq = moment == StateMoment::kExpAvgSq;
  const std::size_t es = dtype_size(in.dtype);
  auto* x = static_cast<float*>(out.data);
  detail::parallel_ranges(in.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    HWY_DYNAMIC_DISPATCH(DecodeRange)
    (f, is_sq, static_cast<const std::uint8_t*>(in.data) + b * es, scales ? scales + b / kStateBlock : nullptr, x + b,
     e - b);
  });
  return {};
}

namespace detail {

Status check_state(const AdamTensors& t) {
  TIER_ASSIGN_OR_RETURN(const StateDType fm, family_of_moment(StateMoment::kExpAvg, t.exp_avg.dtype));
  TIER_ASSIGN_OR_RETURN(const StateDType fv, family_of_moment(StateMoment::kExpAvgSq, t.exp_avg_sq.dtype));
  if (fm != fv) {
    return invalid_argument(str("adam: exp_avg is ", dtype_name(t.exp_avg.dtype), " but exp_avg_sq is ",
                                dtype_name(t.exp_avg_sq.dtype),
                                "; both must be fp32, both bf16, or exp_avg int8 with exp_avg_sq uint8"));
  }
  TIER_RETURN_IF_ERROR(detail::check_layout(t.exp_avg, "adam exp_avg"));
  TIER_RETURN_IF_ERROR(detail::check_layout(t.exp_avg_sq, "adam exp_avg_sq"));
  const bool int8 = fm == StateDType::kInt8;
  TIER_RETURN_IF_ERROR(check_scales(t.exp_avg_scales, int8, t.exp_avg.numel, "adam exp_avg_scales"));
  TIER_RETURN_IF_ERROR(check_scales(t.exp_avg_sq_scales, int8, t.exp_avg_sq.numel, "adam exp_avg_sq_scales"));
  if (int8) {
    const ConstTensorRef a = scales_ref(t.exp_avg_scales, t.exp_avg.numel);
    const ConstTensorRef b = scales_ref(t.exp_avg_sq_scales, t.exp_avg_sq.numel);
    const ConstTensorRef others[] = {t.params, t.exp_avg, t.exp_avg_sq, t.grads, t.out};
    const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grads", "out"};
    if (overlaps(a, b)) return invalid_argument("adam: exp_avg_scales and exp_avg_sq_scales overlap");
    for (int i = 0; i < 5; ++i) {
      if (overlaps(a, others[i])) return invalid_argument(str("adam: exp_avg_scales and ", names[i], " overlap"));
      if (overlaps(b, others[i])) return invalid_argument(str("adam: exp_avg_sq_scales and ", names[i], " overlap"));
    }
  }
  return {};
}

StateDType state_family(const AdamTensors& t) noexcept {
  return t.exp_avg.dtype == DType::kBF16 ? StateDType::kBF16
                                         : (t.exp_avg.dtype == DType::kI8 ? StateDType::kInt8 : StateDType::kF32);
}

Status adam_update_compressed(const AdamStep& step, const AdamTensors& t, int nthreads) {
  const StateDType fam = state_family(t);
  if (step.hyper_params().kind == OptimizerKind::kLamb) {
    return unsupported(str("lamb: ", state_dtype_name(fam),
                           " optimizer state is not supported yet (its norms pass reads fp32 state); use fp32 state"));
  }
  const int f = static_cast<int>(fam);
  const int pk = kind_of(t.params.dtype);
  const int gk = kind_of(t.grads.dtype);
  const int ok = t.out.data == nullptr ? kOutNone : kind_of(t.out.dtype);
  const std::size_t ps = dtype_size(t.params.dtype);
  const std::size_t gs = dtype_size(t.grads.dtype);
  const std::size_t os = t.out.data == nullptr ? 0 : dtype_size(t.out.dtype);
  const std::size_t ss = dtype_size(t.exp_avg.dtype);
  const bool int8 = fam == StateDType::kInt8;
  parallel_ranges(t.params.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    const StatePtrs a{static_cast<std::uint8_t*>(t.params.data) + b * ps,
                      static_cast<std::uint8_t*>(t.exp_avg.data) + b * ss,
                      static_cast<std::uint8_t*>(t.exp_avg_sq.data) + b * ss,
                      static_cast<const std::uint8_t*>(t.grads.data) + b * gs,
                      t.out.data == nullptr ? nullptr : static_cast<std::uint8_t*>(t.out.data) + b * os,
                      int8 ? t.exp_avg_scales + b / kStateBlock : nullptr,
                      int8 ? t.exp_avg_sq_scales + b / kStateBlock : nullptr};
    HWY_DYNAMIC_DISPATCH(CompressedAdam)(f, pk, gk, ok, step.constants(), a, e - b);
  });
  return {};
}

}  // namespace detail
}  // namespace tier::cpu

#endif  // HWY_ONCE
