// Counter-based random fills (uniform and normal) of fp32, fp16 and bf16 tensors, on SIMD
// vectors and every core: what building a large model with random weights spends its time on.
//
// The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a bijection of a 128-bit counter under a 64-bit key, so any element can be computed
// on its own. Element i of a fill uses block i / 4 of the stream (counter = block, stream; key =
// seed) and one of that block's four 32-bit words; a normal element pairs two words by the
// Box-Muller transform (words 0 and 2 give elements 4b and 4b + 2, words 1 and 3 give 4b + 1 and
// 4b + 3). Which thread or vector computes an element changes nothing.
#include "tier/cpu_kernels.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/random_fill.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "cpu/simd_convert-inl.h"
#include "hwy/contrib/math/math-inl.h"

#include <cmath>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

namespace {

constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr std::uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr std::uint32_t kPhiloxW1 = 0xBB67AE85u;

// The four output words of Philox4x32-10 for the blocks in `block` (one per u64 lane, in its low
// half), as u64 lanes whose low halves hold the words (the high halves are not cleared).
struct Words {
  hn::Vec<hn::ScalableTag<std::uint64_t>> w0, w1, w2, w3;
};

// Two vectors of blocks at once: their rounds are independent chains of multiplies, interleaved
// so that one's latency is covered by the other's work.
template <class D64>
TIER_KERNEL_INLINE void Philox2(D64 d64, hn::Vec<D64> block_a, hn::Vec<D64> block_b, std::uint32_t stream_lo,
                                std::uint32_t stream_hi, std::uint32_t key0, std::uint32_t key1, Words& a, Words& b) {
  const hn::Repartition<std::uint32_t, D64> d32;
  const auto m0 = hn::BitCast(d32, hn::Set(d64, kPhiloxM0));
  const auto m1 = hn::BitCast(d32, hn::Set(d64, kPhiloxM1));
  const auto low = hn::Set(d64, 0xFFFFFFFFull);
  auto a0 = hn::And(block_a, low), a1 = hn::ShiftRight<32>(block_a);
  auto b0 = hn::And(block_b, low), b1 = hn::ShiftRight<32>(block_b);
  auto a2 = hn::Set(d64, stream_lo), b2 = a2;
  auto a3 = hn::Set(d64, stream_hi), b3 = a3;
  std::uint32_t k0 = key0, k1 = key1;
  for (int round = 0; round < 10; ++round) {
    // MulEven multiplies the low halves of the u64 lanes: whatever the high halves hold (the
    // previous round's products) does not reach a result.
    const auto pa0 = hn::MulEven(hn::BitCast(d32, a0), m0);
    const auto pb0 = hn::MulEven(hn::BitCast(d32, b0), m0);
    const auto pa1 = hn::MulEven(hn::BitCast(d32, a2), m1);
    const auto pb1 = hn::MulEven(hn::BitCast(d32, b2), m1);
    const auto kk0 = hn::Set(d64, k0);
    const auto kk1 = hn::Set(d64, k1);
    a0 = hn::Xor3(hn::ShiftRight<32>(pa1), a1, kk0);
    b0 = hn::Xor3(hn::ShiftRight<32>(pb1), b1, kk0);
    a2 = hn::Xor3(hn::ShiftRight<32>(pa0), a3, kk1);
    b2 = hn::Xor3(hn::ShiftRight<32>(pb0), b3, kk1);
    a1 = pa1;  // low half: the product's low word
    b1 = pb1;
    a3 = pa0;
    b3 = pb0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  a = Words{a0, a1, a2, a3};
  b = Words{b0, b1, b2, b3};
}

// The 32-bit words of two u64 vectors' low halves as one u32 vector: lane 2j from a, 2j + 1 from b.
template <class D64>
TIER_KERNEL_INLINE hn::Vec<hn::Repartition<std::uint32_t, D64>> PackLow(D64 d64, hn::Vec<D64> a, hn::Vec<D64> b) {
  const hn::Repartition<std::uint32_t, D64> d32;
  const auto lo = hn::And(a, hn::Set(d64, 0xFFFFFFFFull));
  return hn::BitCast(d32, hn::Or(lo, hn::ShiftLeft<32>(b)));
}

// (0, 1] from the top 24 bits of each word (never 0, so its logarithm is finite).
template <class DF>
TIER_KERNEL_INLINE hn::Vec<DF> OpenClosed(DF df, hn::Vec<hn::RebindToUnsigned<DF>> w) {
  const hn::RebindToSigned<DF> di;
  const auto top = hn::BitCast(di, hn::ShiftRight<8>(w));
  return hn::Mul(hn::ConvertTo(df, hn::Add(top, hn::Set(di, 1))), hn::Set(df, 1.0f / 16777216.0f));
}

// [0, 1) from the top 24 bits of each word.
template <class DF>
TIER_KERNEL_INLINE hn::Vec<DF> ClosedOpen(DF df, hn::Vec<hn::RebindToUnsigned<DF>> w) {
  const hn::RebindToSigned<DF> di;
  return hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::ShiftRight<8>(w))), hn::Set(df, 1.0f / 16777216.0f));
}

// cos(2 pi v) and sin(2 pi v) for v in [0, 1): the nearest quarter turn q = round(4 v) and the
// rest x = (4 v - q) pi / 2 in [-pi/4, pi/4], where Taylor polynomials of degree 9 (sine) and 10
// (cosine) are within 2e-9; then a rotation by q quarter turns (a swap and signs). A third of the
// cost of general Sin and Cos, which reduce any argument.
template <class DF>
TIER_KERNEL_INLINE void SinCosTurns(DF df, hn::Vec<DF> v, hn::Vec<DF>& cos_out, hn::Vec<DF>& sin_out) {
  const hn::RebindToSigned<DF> di;
  const auto v4 = hn::Mul(v, hn::Set(df, 4.0f));
  const auto qf = hn::Round(v4);
  const auto q = hn::ConvertTo(di, qf);
  const auto x = hn::Mul(hn::Sub(v4, qf), hn::Set(df, 1.5707963267948966f));
  const auto x2 = hn::Mul(x, x);
  auto sp = hn::Set(df, 1.0f / 362880.0f);
  sp = hn::MulAdd(sp, x2, hn::Set(df, -1.0f / 5040.0f));
  sp = hn::MulAdd(sp, x2, hn::Set(df, 1.0f / 120.0f));
  sp = hn::MulAdd(sp, x2, hn::Set(df, -1.0f / 6.0f));
  sp = hn::MulAdd(sp, x2, hn::Set(df, 1.0f));
  const auto s = hn::Mul(sp, x);
  auto c = hn::Set(df, -1.0f / 3628800.0f);
  c = hn::MulAdd(c, x2, hn::Set(df, 1.0f / 40320.0f));
  c = hn::MulAdd(c, x2, hn::Set(df, -1.0f / 720.0f));
  c = hn::MulAdd(c, x2, hn::Set(df, 1.0f / 24.0f));
  c = hn::MulAdd(c, x2, hn::Set(df, -0.5f));
  c = hn::MulAdd(c, x2, hn::Set(df, 1.0f));
  const auto odd = hn::RebindMask(df, hn::Eq(hn::And(q, hn::Set(di, 1)), hn::Set(di, 1)));
  const auto cq = hn::IfThenElse(odd, s, c);
  const auto sq = hn::IfThenElse(odd, c, s);
  // cos is negative for q in {1, 2}, sin for q in {2, 3}: bit 1 of q + 1, of q.
  const auto cos_sign = hn::BitCast(df, hn::ShiftLeft<30>(hn::And(hn::Add(q, hn::Set(di, 1)), hn::Set(di, 2))));
  const auto sin_sign = hn::BitCast(df, hn::ShiftLeft<30>(hn::And(q, hn::Set(di, 2))));
  cos_out = hn::Xor(cq, cos_sign);
  sin_out = hn::Xor(sq, sin_sign);
}

// The fp32 elements of one vector of blocks' words, in element order, into out.
template <class D64>
TIER_KERNEL_INLINE void Finish(D64 d64, bool normal, float a, float b, const Words& w, float* HWY_RESTRICT out) {
  const hn::Repartition<float, D64> df;
  hn::Vec<decltype(df)> first, second;  // lanes (2j, 2j + 1): elements 4j + {0, 1} and 4j + {2, 3}
  if (normal) {
    // Box-Muller: radius from words 0 and 1, angle from words 2 and 3.
    const auto u = OpenClosed(df, PackLow(d64, w.w0, w.w1));
    const auto v = ClosedOpen(df, PackLow(d64, w.w2, w.w3));
    const auto r = hn::Mul(hn::Sqrt(hn::Mul(hn::Set(df, -2.0f), hn::Log(df, u))), hn::Set(df, b));
    hn::Vec<decltype(df)> c, s;
    SinCosTurns(df, v, c, s);
    const auto mean = hn::Set(df, a);
    first = hn::MulAdd(r, c, mean);
    second = hn::MulAdd(r, s, mean);
  } else {
    const auto lo = hn::Set(df, a);
    const auto span = hn::Set(df, b - a);
    first = hn::MulAdd(ClosedOpen(df, PackLow(d64, w.w0, w.w1)), span, lo);
    second = hn::MulAdd(ClosedOpen(df, PackLow(d64, w.w2, w.w3)), span, lo);
  }
  // Per block: its two lanes of `first`, then its two of `second` (u64 lanes interleaved).
  hn::StoreInterleaved2(hn::BitCast(d64, first), hn::BitCast(d64, second), d64, reinterpret_cast<std::uint64_t*>(out));
}

// Elements [4 * first_block, 4 * (first_block + 4 * lanes)) as fp32, in element order, into out:
// four vectors of blocks, whose Philox rounds the compiler interleaves (inlined, independent).
template <class D64>
TIER_KERNEL_INLINE void Group(D64 d64, bool normal, float a, float b, std::uint64_t first_block, std::uint32_t s_lo,
                              std::uint32_t s_hi, std::uint32_t k0, std::uint32_t k1, float* HWY_RESTRICT out) {
  const std::size_t n = hn::Lanes(d64);
  const auto block = hn::Add(hn::Set(d64, first_block), hn::Iota(d64, 0));
  Words wa, wb, wc, wd;
  Philox2(d64, block, hn::Add(block, hn::Set(d64, n)), s_lo, s_hi, k0, k1, wa, wb);
  Philox2(d64, hn::Add(block, hn::Set(d64, 2 * n)), hn::Add(block, hn::Set(d64, 3 * n)), s_lo, s_hi, k0, k1, wc, wd);
  Finish(d64, normal, a, b, wa, out);
  Finish(d64, normal, a, b, wb, out + 4 * n);
  Finish(d64, normal, a, b, wc, out + 8 * n);
  Finish(d64, normal, a, b, wd, out + 12 * n);
}

#if HWY_TARGET == HWY_SCALAR
// One lane cannot hold a u64 as two u32 words: the scalar target computes a group's four
// elements with plain arithmetic (the same words; the logarithm and sine from <cmath>).
constexpr std::size_t kScalarBlocks = 1;

void ScalarGroup(bool normal, float a, float b, std::uint64_t block, std::uint32_t s_lo, std::uint32_t s_hi,
                 std::uint32_t k0, std::uint32_t k1, float* out) {
  std::uint32_t c[4] = {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), s_lo, s_hi};
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{kPhiloxM0} * c[0];
    const std::uint64_t p1 = std::uint64_t{kPhiloxM1} * c[2];
    const std::uint32_t n[4] = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
                                static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
    std::memcpy(c, n, sizeof(c));
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  const float scale = 1.0f / 16777216.0f;
  for (int j = 0; j < 2; ++j) {
    if (normal) {
      const float u = static_cast<float>((c[j] >> 8) + 1) * scale;
      const float v = static_cast<float>(c[j + 2] >> 8) * scale;
      const float r = std::sqrt(-2.0f * std::log(u)) * b;
      const float theta = v * 6.2831853071795864769f;
      out[j] = r * std::cos(theta) + a;
      out[j + 2] = r * std::sin(theta) + a;
    } else {
      out[j] = static_cast<float>(c[j] >> 8) * scale * (b - a) + a;
      out[j + 2] = static_cast<float>(c[j + 2] >> 8) * scale * (b - a) + a;
    }
  }
}
#endif

template <Kind K>
void FillT(bool normal, float a, float b, std::uint64_t seed, std::uint64_t stream, void* data, std::uint64_t begin,
           std::uint64_t end) {
  const auto s_lo = static_cast<std::uint32_t>(stream);
  const auto s_hi = static_cast<std::uint32_t>(stream >> 32);
  const auto k0 = static_cast<std::uint32_t>(seed);
  const auto k1 = static_cast<std::uint32_t>(seed >> 32);
#if HWY_TARGET == HWY_SCALAR
  const hn::ScalableTag<float> df;
  const std::size_t per_group = 4 * kScalarBlocks;
  auto group = [&](std::uint64_t block, float* out) { ScalarGroup(normal, a, b, block, s_lo, s_hi, k0, k1, out); };
  auto store = [&](const float* src, std::uint8_t* dst) {
    for (std::size_t j = 0; j < per_group; ++j) StoreFromF32<K>(df, hn::Set(df, src[j]), dst + j * ElemBytes(K));
  };
#else
  const hn::ScalableTag<std::uint64_t> d64;
  const hn::Repartition<float, decltype(d64)> df;
  const std::size_t per_group = 16 * hn::Lanes(d64);  // elements, = 8 float vectors
  const std::size_t nf = hn::Lanes(df);
  auto group = [&](std::uint64_t block, float* out) { Group(d64, normal, a, b, block, s_lo, s_hi, k0, k1, out); };
  auto store = [&](const float* src, std::uint8_t* dst) {
    for (std::size_t j = 0; j < 8; ++j) StoreFromF32<K>(df, hn::Load(df, src + j * nf), dst + j * nf * ElemBytes(K));
  };
#endif
  HWY_ALIGN float buf[16 * HWY_MAX_BYTES / 8 + 4];
  auto* p = static_cast<std::uint8_t*>(data);
  // `begin` need not be a multiple of 4: the group holding it is computed whole.
  std::uint64_t i = begin - begin % 4;
  while (i < end) {
    group(i / 4, buf);
    const std::uint64_t lo = i < begin ? begin : i;
    const std::uint64_t hi = i + per_group < end ? i + per_group : end;
    if (lo == i && hi == i + per_group) {
      store(buf, p + i * ElemBytes(K));
    } else {
      HWY_ALIGN std::uint8_t out[8 * HWY_MAX_BYTES + 16] = {};
      store(buf, out);
      std::memcpy(p + lo * ElemBytes(K), out + (lo - i) * ElemBytes(K), (hi - lo) * ElemBytes(K));
    }
    i += per_group;
  }
}

}  // namespace

void FillRandom(int kind, bool normal, float a, float b, std::uint64_t seed, std::uint64_t stream, void* data,
                std::uint64_t begin, std::uint64_t end) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kF32: return FillT<Kind::kF32>(normal, a, b, seed, stream, data, begin, end);
    case Kind::kF16: return FillT<Kind::kF16>(normal, a, b, seed, stream, data, begin, end);
    case Kind::kBF16: return FillT<Kind::kBF16>(normal, a, b, seed, stream, data, begin, end);
    default: return;
  }
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <cmath>

#include "cpu/parallel.hpp"

namespace tier::cpu {

HWY_EXPORT(FillRandom);

namespace {

constexpr std::uint64_t kFillGranule = 64 * 1024;  // elements per piece, a multiple of every group

Status fill(TensorRef x, bool normal, float a, float b, std::uint64_t seed, std::uint64_t stream, int threads,
            const char* what) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(detail::check_tensor(x, what));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  const int k = detail::kind_of(x.dtype);
  detail::parallel_ranges(x.numel, nthreads, kFillGranule, [&](std::uint64_t begin, std::uint64_t end) {
    HWY_DYNAMIC_DISPATCH(FillRandom)(k, normal, a, b, seed, stream, x.data, begin, end);
  });
  return {};
}

}  // namespace

Status fill_uniform(TensorRef x, float low, float high, std::uint64_t seed, std::uint64_t stream, int threads) {
  if (!std::isfinite(low) || !std::isfinite(high) || !(low <= high)) {
    return invalid_argument(str("fill_uniform: the range [", low, ", ", high, ") is not finite and ordered"));
  }
  return fill(x, false, low, high, seed, stream, threads, "fill_uniform");
}

Status fill_normal(TensorRef x, float mean, float std, std::uint64_t seed, std::uint64_t stream, int threads) {
  if (!std::isfinite(mean) || !std::isfinite(std) || std < 0) {
    return invalid_argument(str("fill_normal: mean ", mean, " and std ", std, " must be finite, std >= 0"));
  }
  return fill(x, true, mean, std, seed, stream, threads, "fill_normal");
}

}  // namespace tier::cpu

#endif  // HWY_ONCE
