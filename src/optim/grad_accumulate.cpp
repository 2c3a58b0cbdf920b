// Gradient accumulation with a fused sum of squares, for every Highway target.
#include "optim/grad_accumulate.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/grad_accumulate.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

// The cpu module's fp16/bf16 loads (re-included per target); the same conversions the Adam
// kernel uses, so an fp16 gradient means the same fp32 value here and there.
#include "cpu/simd_convert-inl.h"

#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace tier::optim::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using tier::cpu::HWY_NAMESPACE::ElemBytes;
using tier::cpu::HWY_NAMESPACE::Kind;
using tier::cpu::HWY_NAMESPACE::LoadAsF32;

// acc = g or acc + g over n elements, full-width vectors; no sum.
template <Kind K, bool kFirst>
void AddT(float* acc, const void* g, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  const auto* gp = static_cast<const std::uint8_t*>(g);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto gv = LoadAsF32<K>(df, gp + i * ElemBytes(K));
    hn::StoreU(kFirst ? gv : hn::Add(hn::LoadU(df, acc + i), gv), df, acc + i);
  }
  if (i < n) {
    HWY_ALIGN std::uint8_t gin[HWY_MAX_BYTES] = {};
    HWY_ALIGN float ain[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(gin, gp + i * ElemBytes(K), (n - i) * ElemBytes(K));
    std::memcpy(ain, acc + i, (n - i) * sizeof(float));
    const auto gv = LoadAsF32<K>(df, gin);
    hn::Store(kFirst ? gv : hn::Add(hn::Load(df, ain), gv), df, ain);
    std::memcpy(acc + i, ain, (n - i) * sizeof(float));
  }
}

// The same, and the fp64 sum of squares of the results with cpu::sum_of_squares' structure for
// one block: vectors of Lanes(f64) elements into four accumulators in turn, the remaining whole
// vectors into the first, the zero-padded tail into the second, then (a0 + a1) + (a2 + a3).
template <Kind K, bool kFirst>
double AddSumT(float* acc, const void* g, std::size_t n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const std::size_t N = hn::Lanes(dd);
  const auto* gp = static_cast<const std::uint8_t*>(g);
  auto at = [&](float* a, const void* gsrc) {
    const auto gv = LoadAsF32<K>(df, gsrc);
    const auto r = kFirst ? gv : hn::Add(hn::LoadU(df, a), gv);
    hn::StoreU(r, df, a);
    const auto x = hn::PromoteTo(dd, r);
    return hn::Mul(x, x);
  };
  auto a0 = hn::Zero(dd), a1 = hn::Zero(dd), a2 = hn::Zero(dd), a3 = hn::Zero(dd);
  std::size_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, at(acc + i, gp + i * ElemBytes(K)));
    a1 = hn::Add(a1, at(acc + i + N, gp + (i + N) * ElemBytes(K)));
    a2 = hn::Add(a2, at(acc + i + 2 * N, gp + (i + 2 * N) * ElemBytes(K)));
    a3 = hn::Add(a3, at(acc + i + 3 * N, gp + (i + 3 * N) * ElemBytes(K)));
  }
  for (; i + N <= n; i += N) a0 = hn::Add(a0, at(acc + i, gp + i * ElemBytes(K)));
  if (i < n) {
    HWY_ALIGN std::uint8_t gin[HWY_MAX_BYTES] = {};
    HWY_ALIGN float ain[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(gin, gp + i * ElemBytes(K), (n - i) * ElemBytes(K));
    std::memcpy(ain, acc + i, (n - i) * sizeof(float));
    a1 = hn::Add(a1, at(ain, gin));
    std::memcpy(acc + i, ain, (n - i) * sizeof(float));
  }
  return hn::GetLane(hn::SumOfLanes(dd, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

template <bool kFirst, bool kSum>
double ByKind(int kind, float* acc, const void* g, std::size_t n) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kF32:
      if constexpr (kSum) return AddSumT<Kind::kF32, kFirst>(acc, g, n);
      AddT<Kind::kF32, kFirst>(acc, g, n);
      return 0;
    case Kind::kF16:
      if constexpr (kSum) return AddSumT<Kind::kF16, kFirst>(acc, g, n);
      AddT<Kind::kF16, kFirst>(acc, g, n);
      return 0;
    case Kind::kBF16:
      if constexpr (kSum) return AddSumT<Kind::kBF16, kFirst>(acc, g, n);
      AddT<Kind::kBF16, kFirst>(acc, g, n);
      return 0;
    default: return 0;
  }
}

// mode bit 0: first (acc = g), bit 1: return the sum of squares.
double Accumulate(int kind, int mode, float* acc, const void* g, std::size_t n) {
  switch (mode) {
    case 0: return ByKind<false, false>(kind, acc, g, n);
    case 1: return ByKind<true, false>(kind, acc, g, n);
    case 2: return ByKind<false, true>(kind, acc, g, n);
    default: return ByKind<true, true>(kind, acc, g, n);
  }
}

}  // namespace tier::optim::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <mutex>
#include <vector>

#include "optim/workers.hpp"

namespace tier::optim::detail {

HWY_EXPORT(Accumulate);

namespace {

// cpu::sum_of_squares' block: sums are fixed per block of this many elements.
constexpr std::uint64_t kBlock = 64 * 1024;

int kind_of(DType d) noexcept {
  return d == DType::kF16 ? 1 : (d == DType::kBF16 ? 2 : 0);
}

}  // namespace

Status accumulate_grad(float* acc, cpu::ConstTensorRef g, bool first, double* sumsq, const Workers* workers) {
  if (!cpu::is_float_dtype(g.dtype)) {
    return invalid_argument(str("gradient: dtype ", dtype_name(g.dtype), " is not supported; use fp32, fp16 or bf16"));
  }
  if (g.numel > 0 && (g.data == nullptr || acc == nullptr)) return invalid_argument("gradient: null data");
  if (reinterpret_cast<std::uintptr_t>(g.data) % dtype_size(g.dtype) != 0) {
    return invalid_argument(str("gradient: data is not aligned to its ", dtype_size(g.dtype), "-byte elements"));
  }
  const int kind = kind_of(g.dtype);
  const std::size_t es = dtype_size(g.dtype);
  const auto* gp = static_cast<const std::uint8_t*>(g.data);
  const int mode = (first ? 1 : 0) | (sumsq ? 2 : 0);
  const std::uint64_t blocks = (g.numel + kBlock - 1) / kBlock;
  std::vector<double> partial(sumsq ? blocks : 0, 0.0);
  auto run = [&](std::uint64_t b, std::uint64_t e) {
    // b and e are block-aligned (except the end): each block is summed on its own.
    for (std::uint64_t lo = b; lo < e; lo += kBlock) {
      const std::uint64_t hi = std::min(e, lo + kBlock);
      const double s = HWY_DYNAMIC_DISPATCH(Accumulate)(kind, mode, acc + lo, gp + lo * es, hi - lo);
      if (sumsq) partial[lo / kBlock] = s;
    }
  };
  if (workers && g.numel > 4 * kBlock) {
    workers->for_ranges(g.numel, kBlock, run);
  } else {
    run(0, g.numel);
  }
  if (sumsq) {
    double total = 0;
    for (const double p : partial) total += p;  // in block order, like cpu::sum_of_squares
    *sumsq = total;
  }
  return {};
}

Result<double> copy_grad(void* dst, cpu::ConstTensorRef g, const Workers* workers) {
  if (!cpu::is_float_dtype(g.dtype)) {
    return invalid_argument(str("gradient: dtype ", dtype_name(g.dtype), " is not supported; use fp32, fp16 or bf16"));
  }
  if (g.numel > 0 && (g.data == nullptr || dst == nullptr)) return invalid_argument("gradient: null data");
  const std::size_t es = dtype_size(g.dtype);
  const auto* gp = static_cast<const std::uint8_t*>(g.data);
  auto* dp = static_cast<std::uint8_t*>(dst);
  if (dp < gp + g.numel * es && gp < dp + g.numel * es) return invalid_argument("copy_grad: dst overlaps the gradient");
  const std::uint64_t blocks = (g.numel + kBlock - 1) / kBlock;
  std::vector<double> partial(blocks, 0.0);
  Status failed;
  std::mutex failed_mu;
  auto run = [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t lo = b; lo < e; lo += kBlock) {
      const std::uint64_t hi = std::min(e, lo + kBlock);
      std::memcpy(dp + lo * es, gp + lo * es, (hi - lo) * es);
      // One block of cpu::sum_of_squares' blocking, read back from cache: its partial as is.
      Result<double> s = cpu::sum_of_squares(cpu::ConstTensorRef(dp + lo * es, g.dtype, hi - lo), 1);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(failed_mu);
        failed = s.status();
        return;
      }
      partial[lo / kBlock] = *s;
    }
  };
  if (workers && g.numel > 4 * kBlock) {
    workers->for_ranges(g.numel, kBlock, run);
  } else {
    run(0, g.numel);
  }
  TIER_RETURN_IF_ERROR(failed);
  double total = 0;
  for (const double p : partial) total += p;  // in block order, like cpu::sum_of_squares
  return total;
}

Result<double> sum_of_squares(cpu::ConstTensorRef x, const Workers* workers) {
  return cpu::sum_of_squares(x, workers ? workers->threads() : 1);
}

}  // namespace tier::optim::detail

#endif  // HWY_ONCE
