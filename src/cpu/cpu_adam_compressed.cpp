// Compressed optimizer state (tier/state_codec.hpp): the bf16 and block-int8 codecs for every
// Highway target, the fused update over such state, and the argument checks of the state tensors.
//
// The update runs the per-vector arithmetic of the fp32-state kernel (adam_update-inl.h) on the
// moments widened in registers: bf16 vector by vector; int8 block by block (256 elements), the
// block's new m and sqrt(v) kept in L1 scratch until its scales are known. Only the compressed
// bytes are read from and written to memory; every optimizer kind, gradient dtype and `out` of
// the fp32 kernel carries over with the same arithmetic; and a block is always handled whole by
// one call, so any chunking along block boundaries and any thread count give the same bytes.
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

// Must come after foreach_target.h/highway.h so that they are re-included for each target.
#include "cpu/adam_update-inl.h"
#include "cpu/simd_convert-inl.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

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
// correctly bumps the exponent), exponent rebiased 127 -> 15 (896 = 112 << 3, subtracted before
// the shift, which is the same). Below 2^-14: whole units of 2^-17, rounded by the FPU when y is
// added to 64 (whose ulp is 2^-17). kCap: hold the code at 127; only a block whose scale is an
// fp32 denormal needs it, for a normal scale y <= 1.875 * (1 + 2^-23) rounds to 127 at most.
template <bool kCap, class DF>
TIER_KERNEL_INLINE hn::Vec<hn::RebindToSigned<DF>> CodeM(DF df, hn::Vec<DF> y) {
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(di, y);
  const auto lsb = hn::And(hn::ShiftRight<20>(bits), hn::Set(di, 1));
  const auto normal = hn::ShiftRight<20>(hn::Add(hn::Add(bits, hn::Set(di, 0x7FFFF - (896 << 20))), lsb));
  const auto sub = hn::Sub(hn::BitCast(di, hn::Add(y, hn::Set(df, 64.0f))), hn::Set(di, kMagic64Bits));
  // A float compare: y is never negative here, so it orders as its bits do.
  const auto k = hn::IfThenElse(hn::RebindMask(di, hn::Lt(y, hn::Set(df, 0x1p-14f))), sub, normal);
  if constexpr (kCap) return hn::Min(k, hn::Set(di, 127));
  return k;
}

// sqrt(v)'s code (0..255): 4 exponent bits, 4 mantissa bits (1792 = 112 << 4); below 2^-14 whole
// units of 2^-18. A positive y gets at least code 1 (min(bits, 1) is 1 just for those; -0, whose
// bits are negative as an int, keeps code 0). kCap as for m (255).
template <bool kCap, class DF>
TIER_KERNEL_INLINE hn::Vec<hn::RebindToSigned<DF>> CodeV(DF df, hn::Vec<DF> y) {
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(di, y);
  const auto lsb = hn::And(hn::ShiftRight<19>(bits), hn::Set(di, 1));
  const auto normal = hn::ShiftRight<19>(hn::Add(hn::Add(bits, hn::Set(di, 0x3FFFF - (1792 << 19))), lsb));
  const auto sub = hn::Sub(hn::BitCast(di, hn::Add(y, hn::Set(df, 32.0f))), hn::Set(di, kMagic32Bits));
  auto k = hn::IfThenElse(hn::RebindMask(di, hn::Lt(y, hn::Set(df, 0x1p-14f))), sub, normal);
  if constexpr (kCap) k = hn::Min(k, hn::Set(di, 255));
  return hn::Max(k, hn::Min(bits, hn::Set(di, 1)));
}

// A decoded value may round a hair past the block's largest input; near FLT_MAX that would be an
// infinity, so it is held at FLT_MAX. NaNs (a non-finite block's NaN scale) stay NaN.
template <class DF>
TIER_KERNEL_INLINE hn::Vec<DF> ClampToMax(DF df, hn::Vec<DF> x) {
  const auto max = hn::Set(df, std::numeric_limits<float>::max());
  return hn::IfThenElse(hn::Gt(x, max), max, x);
}

// ---------------------------------------------------------------------------------------------
// One vector of codes between the 8-bit formats and fp32, and one block of codes from fp32.

// Decodes N of m's codes at q against the block scale: sign(q) * value(|q|) * scale, |q| held at
// 127 (-128 is never written). value(k) is the fp32 whose bits are k << 20, times 2^112: the
// shift puts the 4 exponent bits and 3 mantissa bits of the code in the place of fp32's, the
// power of two rebiases the exponent (15 -> 127) exactly, and codes below 8 become fp32
// denormals, which the same multiplication turns into the code's own subnormals, f * 2^-17.
// kPlain: `scale` is the block scale times 2^112, which is exact, and so is one product instead
// of two, when the scale is below 2^16; then nothing can round to an infinity either, and the
// clamp is left out. Otherwise `scale` is the block scale itself (NaN included).
template <bool kPlain, class DF>
TIER_KERNEL_INLINE hn::Vec<DF> DecodeM(DF df, const std::int8_t* q, hn::Vec<DF> scale) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::int8_t, DF> d8;
  const auto qi = hn::PromoteTo(di, hn::LoadU(d8, q));
  const auto raw = hn::BitCast(df, hn::ShiftLeft<20>(hn::Min(hn::Abs(qi), hn::Set(di, 127))));
  hn::Vec<DF> mag;
  if constexpr (kPlain) {
    mag = hn::Mul(raw, scale);
  } else {
    mag = ClampToMax(df, hn::Mul(hn::Mul(raw, hn::Set(df, 0x1p112f)), scale));
  }
  // The sign of q, flipped in (exactly what negation does, a NaN included).
  return hn::Xor(mag, hn::And(hn::BitCast(df, qi), hn::SignBit(df)));
}

// Decodes N of v's codes at q: (value(k) * scale)^2, value(k) the fp32 with bits k << 19 times
// 2^112 (as for m, with 4 mantissa bits); kPlain and `scale` as for m.
template <bool kPlain, class DF>
TIER_KERNEL_INLINE hn::Vec<DF> DecodeV(DF df, const std::uint8_t* q, hn::Vec<DF> scale) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint8_t, DF> d8;
  const auto raw = hn::BitCast(df, hn::ShiftLeft<19>(hn::PromoteTo(di, hn::LoadU(d8, q))));
  if constexpr (kPlain) {
    const auto s = hn::Mul(raw, scale);
    return hn::Mul(s, s);
  } else {
    const auto s = hn::Mul(hn::Mul(raw, hn::Set(df, 0x1p112f)), scale);
    return ClampToMax(df, hn::Mul(s, s));
  }
}

// Whether a block's scale allows the plain decode, and the factor the decode then multiplies by.
constexpr float kPlainScaleLimit = 65536.0f;  // 2^16: scale * 2^112 stays finite, 1.9375 * 2^16 squared too
TIER_KERNEL_INLINE bool PlainScale(float scale) {
  return scale < kPlainScaleLimit;  // false for a NaN scale
}

// The largest |x| bit pattern so far, as ints: finite values order as their bits do, and an
// infinity or a NaN shows as a pattern >= kNonFiniteBits on every target (a float max would drop
// NaNs on some).
template <class DF, class VI>
TIER_KERNEL_INLINE VI MaxMagnitude(DF /*df*/, VI acc, hn::Vec<DF> x) {
  const hn::RebindToSigned<DF> di;
  return hn::Max(acc, hn::And(hn::BitCast(di, x), hn::Set(di, 0x7FFFFFFF)));
}

// Stores four vectors of codes (i32 lanes, within the range of the byte type T) as 4 * N bytes
// in order; for int8 (m), each code takes the sign of the matching element of x0..x3 (the
// magnitudes are codes of |x|, and a zero code stays zero). AVX2 packs the 32 codes with three
// saturating packs and one lane permutation, and signs them with psignb on the sign bits packed
// the same way, where DemoteTo would take three instructions per vector and the sign three more.
template <typename T, class DF, class VI = hn::Vec<hn::RebindToSigned<DF>>, class VF = hn::Vec<DF>>
TIER_KERNEL_INLINE void StoreCodes4(DF df, VI k0, VI k1, VI k2, VI k3, VF x0, VF x1, VF x2, VF x3, T* q) {
#if HWY_TARGET == HWY_AVX2
  (void)df;
  // Saturating packs interleave the 128-bit halves: bytes come out as k0[0..3] k1[0..3] k2[0..3]
  // k3[0..3] | k0[4..7] k1[4..7] k2[4..7] k3[4..7]; the dword permutation restores the order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i k01 = _mm256_packs_epi32(k0.raw, k1.raw);
  const __m256i k23 = _mm256_packs_epi32(k2.raw, k3.raw);
  __m256i k;
  if constexpr (std::is_signed_v<T>) {
    k = _mm256_packs_epi16(k01, k23);
    // Saturating packs keep the sign of each fp32 (as an int: negative for -0 too, whose code is 0).
    const __m256i s01 = _mm256_packs_epi32(_mm256_castps_si256(x0.raw), _mm256_castps_si256(x1.raw));
    const __m256i s23 = _mm256_packs_epi32(_mm256_castps_si256(x2.raw), _mm256_castps_si256(x3.raw));
    k = _mm256_sign_epi8(k, _mm256_packs_epi16(s01, s23));
  } else {
    k = _mm256_packus_epi16(k01, k23);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(k, order));
#else
  const hn::Rebind<T, DF> d8;
  const std::size_t N = hn::Lanes(df);
  const VI k[4] = {k0, k1, k2, k3};
  const VF x[4] = {x0, x1, x2, x3};
  for (int j = 0; j < 4; ++j) {
    auto c = k[j];
    if constexpr (std::is_signed_v<T>) {
      c = hn::IfThenElse(hn::RebindMask(hn::RebindToSigned<DF>(), hn::Lt(x[j], hn::Zero(df))), hn::Neg(c), c);
    }
    hn::StoreU(hn::DemoteTo(d8, c), d8, q + static_cast<std::size_t>(j) * N);
  }
#endif
}

// m's codes of a whole block x[0, kBlock) against `scale`, 4 vectors at a time.
template <bool kCap>
TIER_KERNEL_INLINE void EncodeCodesMT(const float* x, float scale, std::int8_t* q) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale);
  for (std::size_t i = 0; i < kBlock; i += 4 * N) {
    const auto x0 = hn::LoadU(df, x + i), x1 = hn::LoadU(df, x + i + N);
    const auto x2 = hn::LoadU(df, x + i + 2 * N), x3 = hn::LoadU(df, x + i + 3 * N);
    StoreCodes4(df, CodeM<kCap>(df, hn::Div(hn::Abs(x0), vscale)), CodeM<kCap>(df, hn::Div(hn::Abs(x1), vscale)),
                CodeM<kCap>(df, hn::Div(hn::Abs(x2), vscale)), CodeM<kCap>(df, hn::Div(hn::Abs(x3), vscale)), x0, x1,
                x2, x3, q + i);
  }
}

// v's codes of a whole block from s[0, kBlock) = sqrt(v) (never negative: -0 at most, whose
// quotient -0 gets code 0 as +0 does, so no Abs).
template <bool kCap>
TIER_KERNEL_INLINE void EncodeCodesVT(const float* s, float scale, std::uint8_t* q) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  const auto vscale = hn::Set(df, scale);
  for (std::size_t i = 0; i < kBlock; i += 4 * N) {
    const auto x0 = hn::LoadU(df, s + i), x1 = hn::LoadU(df, s + i + N);
    const auto x2 = hn::LoadU(df, s + i + 2 * N), x3 = hn::LoadU(df, s + i + 3 * N);
    StoreCodes4(df, CodeV<kCap>(df, hn::Div(x0, vscale)), CodeV<kCap>(df, hn::Div(x1, vscale)),
                CodeV<kCap>(df, hn::Div(x2, vscale)), CodeV<kCap>(df, hn::Div(x3, vscale)), x0, x1, x2, x3, q + i);
  }
}

// m's codes of a whole block x[0, kBlock) whose largest magnitude has the bits max_bits (padding
// zeros do not change it); returns the block's scale.
TIER_KERNEL_INLINE float EncodeCodesM(const float* x, std::int32_t max_bits, std::int8_t* q) {
  if (max_bits == 0 || max_bits >= kNonFiniteBits) {
    std::memset(q, 0, kBlock);
    return max_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  float absmax;
  std::memcpy(&absmax, &max_bits, sizeof(absmax));
  const float scale = absmax / kMaxM;
  if (scale >= std::numeric_limits<float>::min()) {
    EncodeCodesMT<false>(x, scale, q);
  } else {
    EncodeCodesMT<true>(x, scale, q);
  }
  return scale;
}

// v's codes of a whole block from s[0, kBlock) = sqrt(v), whose largest magnitude has the bits
// max_bits (a negative v has a NaN root and so makes the block non-finite); returns the block's
// scale.
TIER_KERNEL_INLINE float EncodeCodesV(const float* s, std::int32_t max_bits, std::uint8_t* q) {
  if (max_bits == 0 || max_bits >= kNonFiniteBits) {
    std::memset(q, 0, kBlock);
    return max_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  float smax;
  std::memcpy(&smax, &max_bits, sizeof(smax));
  const float scale = smax / kMaxV;
  if (scale >= std::numeric_limits<float>::min()) {
    EncodeCodesVT<false>(s, scale, q);
  } else {
    EncodeCodesVT<true>(s, scale, q);
  }
  return scale;
}

template <class DF>
TIER_KERNEL_INLINE std::int32_t ReduceMax(DF /*df*/, hn::Vec<hn::RebindToSigned<DF>> acc) {
  return hn::GetLane(hn::MaxOfLanes(hn::RebindToSigned<DF>(), acc));
}

// ---------------------------------------------------------------------------------------------
// The codec on whole blocks (kBlock elements; callers pad a partial one).

void DecodeBlockM8(const std::int8_t* q, float scale, float* x) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  if (PlainScale(scale)) {
    const auto vscale = hn::Set(df, scale * 0x1p112f);
    for (std::size_t i = 0; i < kBlock; i += N) hn::StoreU(DecodeM<true>(df, q + i, vscale), df, x + i);
  } else {
    const auto vscale = hn::Set(df, scale);
    for (std::size_t i = 0; i < kBlock; i += N) hn::StoreU(DecodeM<false>(df, q + i, vscale), df, x + i);
  }
}

float EncodeBlockM8(const float* x, std::int8_t* q) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  auto acc = hn::Zero(hn::RebindToSigned<decltype(df)>());
  for (std::size_t i = 0; i < kBlock; i += N) acc = MaxMagnitude(df, acc, hn::LoadU(df, x + i));
  return EncodeCodesM(x, ReduceMax(df, acc), q);
}

void DecodeBlockV8(const std::uint8_t* q, float scale, float* x) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  if (PlainScale(scale)) {
    const auto vscale = hn::Set(df, scale * 0x1p112f);
    for (std::size_t i = 0; i < kBlock; i += N) hn::StoreU(DecodeV<true>(df, q + i, vscale), df, x + i);
  } else {
    const auto vscale = hn::Set(df, scale);
    for (std::size_t i = 0; i < kBlock; i += N) hn::StoreU(DecodeV<false>(df, q + i, vscale), df, x + i);
  }
}

float EncodeBlockV8(const float* x, std::uint8_t* q) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  HWY_ALIGN float s[kBlock];
  auto acc = hn::Zero(hn::RebindToSigned<decltype(df)>());
  for (std::size_t i = 0; i < kBlock; i += N) {
    const auto root = hn::Sqrt(hn::LoadU(df, x + i));
    hn::Store(root, df, s + i);
    acc = MaxMagnitude(df, acc, root);
  }
  return EncodeCodesV(s, ReduceMax(df, acc), q);
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

// One moment of one block in its state dtype: where its elements and scale are.
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
  const auto* q = static_cast<const std::uint8_t*>(mo.data);
  HWY_ALIGN std::uint8_t pad[kBlock];
  if (len != kBlock) {
    std::memcpy(pad, mo.data, len);
    std::memset(pad + len, 0, kBlock - len);
    q = pad;
  }
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
// The update over compressed state: decode, the fp32 arithmetic of adam_update-inl.h and encode,
// fused per vector (bf16) or per block (int8), so that the moments go through registers and L1
// only, and sqrt(v) is taken once for both the step and v's code.

// bf16 state: one vector, widened, updated and rounded back in registers.
template <Kind P, Kind G, Kind O, int kOp, class DF>
TIER_KERNEL_INLINE void BF16Vector(DF df, const AdamStep::Constants& c, const StatePtrs& a, std::size_t i) {
  auto* m = static_cast<std::uint16_t*>(a.m) + i;
  auto* v = static_cast<std::uint16_t*>(a.v) + i;
  auto mf = UsesM(kOp) ? LoadAsF32<Kind::kBF16>(df, m) : hn::Zero(df);
  auto vf = UsesV(kOp) ? LoadAsF32<Kind::kBF16>(df, v) : hn::Zero(df);
  UpdateVector<P, G, O, kOp>(df, c, static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P),
                             static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G),
                             static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O), mf, vf);
  if constexpr (UsesM(kOp)) StoreFromF32<Kind::kBF16>(df, mf, m);
  if constexpr (UsesV(kOp)) StoreFromF32<Kind::kBF16>(df, vf, v);
}

template <Kind P, Kind G, Kind O, int kOp>
void BF16T(const AdamStep::Constants& c_in, const StatePtrs& a_in, std::size_t n) {
  // Local copies: stores through the data pointers could alias the caller's structs.
  const AdamStep::Constants c = c_in;
  const StatePtrs a = a_in;
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + N <= n; i += N) BF16Vector<P, G, O, kOp>(df, c, a, i);
  if (i == n) return;
  // Tail: copy into full-vector buffers, run the same vector code, copy back.
  const std::size_t r = n - i;
  HWY_ALIGN std::uint8_t p[HWY_MAX_BYTES] = {};
  HWY_ALIGN std::uint16_t m[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN std::uint16_t v[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN std::uint8_t g[HWY_MAX_BYTES] = {};
  HWY_ALIGN std::uint8_t out[HWY_MAX_BYTES] = {};
  auto* am = static_cast<std::uint16_t*>(a.m) + i;
  auto* av = static_cast<std::uint16_t*>(a.v) + i;
  std::memcpy(p, static_cast<const std::uint8_t*>(a.p) + i * ElemBytes(P), r * ElemBytes(P));
  if (UsesM(kOp)) std::memcpy(m, am, r * sizeof(std::uint16_t));
  if (UsesV(kOp)) std::memcpy(v, av, r * sizeof(std::uint16_t));
  std::memcpy(g, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G), r * ElemBytes(G));
  BF16Vector<P, G, O, kOp>(df, c, StatePtrs{p, m, v, g, out, nullptr, nullptr}, 0);
  std::memcpy(static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P), p, r * ElemBytes(P));
  if (UsesM(kOp)) std::memcpy(am, m, r * sizeof(std::uint16_t));
  if (UsesV(kOp)) std::memcpy(av, v, r * sizeof(std::uint16_t));
  if constexpr (O != Kind::kNone) {
    std::memcpy(static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O), out, r * ElemBytes(O));
  }
}

// int8 state: one whole block. Pass 1 decodes each vector of codes, updates it and keeps the new
// m and sqrt(v) in L1 scratch while tracking their largest magnitudes; pass 2 encodes the block
// against the scales those give. kPlain: both scales allow the plain decode (PlainScale).
template <Kind P, Kind G, Kind O, int kOp, bool kPlain>
HWY_NOINLINE void Int8Block(const AdamStep::Constants& c_in, std::uint8_t* p, const std::uint8_t* g, std::uint8_t* out,
                            std::int8_t* mq, float* mscale, std::uint8_t* vq, float* vscale) {
  // A local copy: the stores through p could alias the caller's constants, and the compiler would
  // then reload and re-broadcast every constant on each vector.
  const AdamStep::Constants c = c_in;
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const std::size_t N = hn::Lanes(df);
  HWY_ALIGN float xm[kBlock];
  HWY_ALIGN float xs[kBlock];
  auto accm = hn::Zero(di);
  auto accs = hn::Zero(di);
  const float factor = kPlain ? 0x1p112f : 1.0f;
  const auto sm = hn::Set(df, UsesM(kOp) ? *mscale * factor : 0.0f);
  const auto sv = hn::Set(df, UsesV(kOp) ? *vscale * factor : 0.0f);
  for (std::size_t i = 0; i < kBlock; i += N) {
    auto m = UsesM(kOp) ? DecodeM<kPlain>(df, mq + i, sm) : hn::Zero(df);
    auto v = UsesV(kOp) ? DecodeV<kPlain>(df, vq + i, sv) : hn::Zero(df);
    const auto root =
        UpdateVector<P, G, O, kOp>(df, c, p + i * ElemBytes(P), g + i * ElemBytes(G), out + i * ElemBytes(O), m, v);
    if constexpr (UsesM(kOp)) {
      hn::Store(m, df, xm + i);
      accm = MaxMagnitude(df, accm, m);
    }
    if constexpr (UsesV(kOp)) {
      hn::Store(root, df, xs + i);
      accs = MaxMagnitude(df, accs, root);
    }
  }
  if constexpr (UsesM(kOp)) *mscale = EncodeCodesM(xm, ReduceMax(df, accm), mq);
  if constexpr (UsesV(kOp)) *vscale = EncodeCodesV(xs, ReduceMax(df, accs), vq);
}

template <Kind P, Kind G, Kind O, int kOp>
TIER_KERNEL_INLINE void Int8BlockAny(const AdamStep::Constants& c, std::uint8_t* p, const std::uint8_t* g,
                                     std::uint8_t* out, std::int8_t* mq, float* mscale, std::uint8_t* vq,
                                     float* vscale) {
  if ((!UsesM(kOp) || PlainScale(*mscale)) && (!UsesV(kOp) || PlainScale(*vscale))) {
    Int8Block<P, G, O, kOp, true>(c, p, g, out, mq, mscale, vq, vscale);
  } else {
    Int8Block<P, G, O, kOp, false>(c, p, g, out, mq, mscale, vq, vscale);
  }
}

template <Kind P, Kind G, Kind O, int kOp>
void Int8T(const AdamStep::Constants& c_in, const StatePtrs& a_in, std::size_t n) {
  const AdamStep::Constants c = c_in;
  const StatePtrs a = a_in;
  auto* p = static_cast<std::uint8_t*>(a.p);
  const auto* g = static_cast<const std::uint8_t*>(a.g);
  auto* out = static_cast<std::uint8_t*>(a.out);
  auto* mq = static_cast<std::int8_t*>(a.m);
  auto* vq = static_cast<std::uint8_t*>(a.v);
  std::size_t b = 0;
  for (; b + kBlock <= n; b += kBlock) {
    Int8BlockAny<P, G, O, kOp>(c, p + b * ElemBytes(P), g + b * ElemBytes(G), out + b * ElemBytes(O), mq + b,
                               a.m_scales + b / kBlock, vq + b, a.v_scales + b / kBlock);
  }
  if (b == n) return;
  // A partial last block: zero-padded copies (zeros update to zeros and leave the scales alone).
  const std::size_t r = n - b;
  HWY_ALIGN std::uint8_t tp[kBlock * sizeof(float)] = {};
  HWY_ALIGN std::uint8_t tg[kBlock * sizeof(float)] = {};
  HWY_ALIGN std::uint8_t tout[kBlock * sizeof(float)];
  HWY_ALIGN std::int8_t tm[kBlock] = {};
  HWY_ALIGN std::uint8_t tv[kBlock] = {};
  std::memcpy(tp, p + b * ElemBytes(P), r * ElemBytes(P));
  std::memcpy(tg, g + b * ElemBytes(G), r * ElemBytes(G));
  if (UsesM(kOp)) std::memcpy(tm, mq + b, r);
  if (UsesV(kOp)) std::memcpy(tv, vq + b, r);
  Int8BlockAny<P, G, O, kOp>(c, tp, tg, tout, tm, a.m_scales + b / kBlock, tv, a.v_scales + b / kBlock);
  std::memcpy(p + b * ElemBytes(P), tp, r * ElemBytes(P));
  if (UsesM(kOp)) std::memcpy(mq + b, tm, r);
  if (UsesV(kOp)) std::memcpy(vq + b, tv, r);
  if constexpr (O != Kind::kNone) std::memcpy(out + b * ElemBytes(O), tout, r * ElemBytes(O));
}

template <bool kInt8, int kOp>
void CompressedByKind(int pk, int gk, int ok, const AdamStep::Constants& c, const StatePtrs& a, std::size_t n) {
  // params fp32 or bf16; grads fp32, fp16 or bf16; out none, fp16, bf16 or fp32.
#define TIER_STATE_T(PK, GK, OK)                              \
  if constexpr (kInt8) {                                      \
    return Int8T<Kind::PK, Kind::GK, Kind::OK, kOp>(c, a, n); \
  } else {                                                    \
    return BF16T<Kind::PK, Kind::GK, Kind::OK, kOp>(c, a, n); \
  }
#define TIER_STATE_OUT(PK, GK)                            \
  switch (static_cast<Kind>(ok)) {                        \
    case Kind::kNone: TIER_STATE_T(PK, GK, kNone) return; \
    case Kind::kF16: TIER_STATE_T(PK, GK, kF16) return;   \
    case Kind::kBF16: TIER_STATE_T(PK, GK, kBF16) return; \
    case Kind::kF32: TIER_STATE_T(PK, GK, kF32) return;   \
  }
#define TIER_STATE_GRAD(PK)                             \
  switch (static_cast<Kind>(gk)) {                      \
    case Kind::kF32: TIER_STATE_OUT(PK, kF32) return;   \
    case Kind::kF16: TIER_STATE_OUT(PK, kF16) return;   \
    case Kind::kBF16: TIER_STATE_OUT(PK, kBF16) return; \
    case Kind::kNone: return;                           \
  }
  if (static_cast<Kind>(pk) == Kind::kBF16) {
    TIER_STATE_GRAD(kBF16)
  } else {
    TIER_STATE_GRAD(kF32)
  }
#undef TIER_STATE_GRAD
#undef TIER_STATE_OUT
#undef TIER_STATE_T
}

template <bool kInt8>
void CompressedByOp(int pk, int gk, int ok, const AdamStep::Constants& c, const StatePtrs& a, std::size_t n) {
  switch (c.kind) {
    case OptimizerKind::kAdam:
      if (c.l2) return CompressedByKind<kInt8, kOpAdamL2>(pk, gk, ok, c, a, n);
      return CompressedByKind<kInt8, kOpAdam>(pk, gk, ok, c, a, n);
    case OptimizerKind::kAdagrad: return CompressedByKind<kInt8, kOpAdagrad>(pk, gk, ok, c, a, n);
    case OptimizerKind::kLion: return CompressedByKind<kInt8, kOpLion>(pk, gk, ok, c, a, n);
    case OptimizerKind::kLamb: return;  // refused by adam_update_compressed
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points (one per target, dispatched from the HWY_ONCE part below).

// The update over `n` elements from a block boundary; the last block may be partial.
void CompressedAdam(int family, int pk, int gk, int ok, const AdamStep::Constants& c, const StatePtrs& a,
                    std::size_t n) {
  if (family == kFamilyBF16) return CompressedByOp<false>(pk, gk, ok, c, a, n);
  CompressedByOp<true>(pk, gk, ok, c, a, n);
}

// The codec over `n` elements from a block boundary: fp32 `x` to/from the moment's format.
void EncodeRange(int family, bool is_sq, const float* x, void* out, float* scales, std::size_t n) {
  const std::size_t es = StateElemBytes(family);
  HWY_ALIGN float buf[kBlock];
  for (std::size_t at = 0, b = 0; at < n; at += kBlock, ++b) {
    const std::size_t len = std::min(kBlock, n - at);
    const float* in = x + at;
    if (len != kBlock) {
      std::memcpy(buf, x + at, len * sizeof(float));
      std::fill(buf + len, buf + kBlock, 0.0f);
      in = buf;
    }
    EncodeBlock(family, in, len,
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
    if (len == kBlock) {
      DecodeBlock(family, mo, len, x + at);
      continue;
    }
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
