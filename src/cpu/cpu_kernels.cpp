// Element-wise kernels (conversion, sum of squares, inf/nan detection, scaling) for every
// Highway target, the run-time dispatch to them and the SIMD target controls.
#include "tier/cpu_kernels.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/cpu_kernels.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

// Must come after foreach_target.h/highway.h so that it is re-included for each target.
#include "cpu/simd_convert-inl.h"

#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

std::int64_t TargetBit() {
  return HWY_TARGET;
}

// --------------------------------------------------------------------------------- conversion

template <Kind S, Kind D>
void ConvertT(const void* src, void* dst, std::size_t n) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  const auto* s = static_cast<const std::uint8_t*>(src);
  auto* d = static_cast<std::uint8_t*>(dst);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    StoreFromF32<D>(df, LoadAsF32<S>(df, s + i * ElemBytes(S)), d + i * ElemBytes(D));
  }
  if (i < n) {
    // The tail goes through full vectors in local buffers, so that an element is converted by
    // the same instructions wherever a chunk boundary falls.
    HWY_ALIGN std::uint8_t in[HWY_MAX_BYTES] = {};
    HWY_ALIGN std::uint8_t out[HWY_MAX_BYTES] = {};
    std::memcpy(in, s + i * ElemBytes(S), (n - i) * ElemBytes(S));
    StoreFromF32<D>(df, LoadAsF32<S>(df, in), out);
    std::memcpy(d + i * ElemBytes(D), out, (n - i) * ElemBytes(D));
  }
}

void Convert(int src_kind, const void* src, int dst_kind, void* dst, std::size_t n) {
  const auto s = static_cast<Kind>(src_kind);
  const auto d = static_cast<Kind>(dst_kind);
#define TIER_CONVERT_CASE(SK, DK) \
  if (s == Kind::SK && d == Kind::DK) return ConvertT<Kind::SK, Kind::DK>(src, dst, n);
  TIER_CONVERT_CASE(kF32, kF16)
  TIER_CONVERT_CASE(kF32, kBF16)
  TIER_CONVERT_CASE(kF16, kF32)
  TIER_CONVERT_CASE(kBF16, kF32)
  TIER_CONVERT_CASE(kF16, kBF16)
  TIER_CONVERT_CASE(kBF16, kF16)
#undef TIER_CONVERT_CASE
}

// ----------------------------------------------------------------------------- sum of squares

// fp64 sum of squares of n elements; four accumulators in a fixed order, so the result depends
// only on n, the data and the target.
template <Kind K>
double SumSquaresT(const void* src, std::size_t n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;  // as many fp32 lanes as fp64 lanes
  const std::size_t N = hn::Lanes(dd);
  const auto* s = static_cast<const std::uint8_t*>(src);
  auto sq = [&](const void* p) {
    const auto x = hn::PromoteTo(dd, LoadAsF32<K>(df, p));
    return hn::Mul(x, x);
  };
  auto a0 = hn::Zero(dd), a1 = hn::Zero(dd), a2 = hn::Zero(dd), a3 = hn::Zero(dd);
  std::size_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, sq(s + (i + 0 * N) * ElemBytes(K)));
    a1 = hn::Add(a1, sq(s + (i + 1 * N) * ElemBytes(K)));
    a2 = hn::Add(a2, sq(s + (i + 2 * N) * ElemBytes(K)));
    a3 = hn::Add(a3, sq(s + (i + 3 * N) * ElemBytes(K)));
  }
  for (; i + N <= n; i += N) a0 = hn::Add(a0, sq(s + i * ElemBytes(K)));
  if (i < n) {
    HWY_ALIGN std::uint8_t in[HWY_MAX_BYTES] = {};
    std::memcpy(in, s + i * ElemBytes(K), (n - i) * ElemBytes(K));
    a1 = hn::Add(a1, sq(in));
  }
  return hn::GetLane(hn::SumOfLanes(dd, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

double SumSquares(int kind, const void* src, std::size_t n) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kF32: return SumSquaresT<Kind::kF32>(src, n);
    case Kind::kF16: return SumSquaresT<Kind::kF16>(src, n);
    case Kind::kBF16: return SumSquaresT<Kind::kBF16>(src, n);
    default: return 0;
  }
}

// ------------------------------------------------------------------------------ non-finite

// True when any element has an all-ones exponent (infinity or NaN). Works on the raw bits, so
// it needs no conversion and reads fp16/bf16 at twice the lanes.
template <class DU>
bool AnyExponentAllOnes(DU du, const void* src, std::size_t n, hn::TFromD<DU> exp_mask) {
  using T = hn::TFromD<DU>;
  const std::size_t N = hn::Lanes(du);
  const auto* s = static_cast<const T*>(src);
  const auto mask = hn::Set(du, exp_mask);
  std::size_t i = 0;
  // Check every 16 vectors so that a large clean range runs at full speed.
  while (i + 16 * N <= n) {
    auto acc = hn::Zero(du);
    for (int k = 0; k < 16; ++k, i += N) {
      acc = hn::Or(acc, hn::VecFromMask(du, hn::Eq(hn::And(hn::LoadU(du, s + i), mask), mask)));
    }
    if (!hn::AllFalse(du, hn::Ne(acc, hn::Zero(du)))) return true;
  }
  for (; i + N <= n; i += N) {
    if (!hn::AllFalse(du, hn::Eq(hn::And(hn::LoadU(du, s + i), mask), mask))) return true;
  }
  for (; i < n; ++i) {
    if ((s[i] & exp_mask) == exp_mask) return true;
  }
  return false;
}

bool NonFinite(int kind, const void* src, std::size_t n) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kF32: return AnyExponentAllOnes(hn::ScalableTag<std::uint32_t>(), src, n, 0x7F800000u);
    case Kind::kF16: return AnyExponentAllOnes(hn::ScalableTag<std::uint16_t>(), src, n, std::uint16_t{0x7C00});
    case Kind::kBF16: return AnyExponentAllOnes(hn::ScalableTag<std::uint16_t>(), src, n, std::uint16_t{0x7F80});
    default: return false;
  }
}

// ------------------------------------------------------------------------------------ scale

template <Kind K>
void ScaleT(void* data, std::size_t n, float factor) {
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  const auto f = hn::Set(df, factor);
  auto* p = static_cast<std::uint8_t*>(data);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    void* at = p + i * ElemBytes(K);
    StoreFromF32<K>(df, hn::Mul(LoadAsF32<K>(df, at), f), at);
  }
  if (i < n) {
    HWY_ALIGN std::uint8_t buf[HWY_MAX_BYTES] = {};
    std::memcpy(buf, p + i * ElemBytes(K), (n - i) * ElemBytes(K));
    StoreFromF32<K>(df, hn::Mul(LoadAsF32<K>(df, buf), f), buf);
    std::memcpy(p + i * ElemBytes(K), buf, (n - i) * ElemBytes(K));
  }
}

void Scale(int kind, void* data, std::size_t n, float factor) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kF32: return ScaleT<Kind::kF32>(data, n, factor);
    case Kind::kF16: return ScaleT<Kind::kF16>(data, n, factor);
    case Kind::kBF16: return ScaleT<Kind::kBF16>(data, n, factor);
    default: return;
  }
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "cpu/parallel.hpp"
#include "tier/log.hpp"

namespace tier::cpu {

HWY_EXPORT(TargetBit);
HWY_EXPORT(Convert);
HWY_EXPORT(SumSquares);
HWY_EXPORT(NonFinite);
HWY_EXPORT(Scale);

namespace {

// Elements per piece handed to a thread: large enough to amortise the dispatch, small enough
// to balance. Also the fixed block of a sum of squares, so sums do not depend on thread count.
constexpr std::uint64_t kGranule = 64 * 1024;

std::string lower(std::string_view s) {
  std::string r(s);
  for (auto& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// Targets compiled in and supported by the CPU, ignoring any forced choice.
std::int64_t real_supported_targets() {
  static const std::int64_t mask = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets() & HWY_TARGETS;
  }();
  return mask;
}

std::mutex& simd_mu() {
  static std::mutex mu;
  return mu;
}

Status force_locked(std::string_view name) {
  const std::string want = lower(name);
  const std::int64_t supported = real_supported_targets();
  if (want.empty() || want == "auto") {
    hwy::SetSupportedTargetsForTest(0);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    return {};
  }
  for (std::int64_t bits = supported; bits != 0; bits &= bits - 1) {
    const std::int64_t t = bits & -bits;
    const std::string tn = lower(hwy::TargetName(t));
    if (tn == want || (want == "avx512" && t == HWY_AVX3)) {
      hwy::SetSupportedTargetsForTest(t);
      hwy::GetChosenTarget().Update(hwy::SupportedTargets());
      return {};
    }
  }
  std::string avail;
  for (const auto& n : simd_targets()) avail += (avail.empty() ? "" : ", ") + n;
  return unsupported(
      str("SIMD target '", name, "' is not available in this build on this CPU; available: ", avail, " (or auto)"));
}

}  // namespace

namespace detail {

void init_simd_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("TIER_CPU_SIMD");
    if (env == nullptr || *env == '\0') return;
    std::lock_guard<std::mutex> lock(simd_mu());
    const Status s = force_locked(env);
    if (!s.ok()) {
      log_once("cpu.simd_env", LogLevel::kWarn, str("TIER_CPU_SIMD: ", s.message(), "; using the best target"));
    } else {
      TIER_LOG(kInfo, "cpu kernels: SIMD target forced to ", hwy::TargetName(HWY_DYNAMIC_DISPATCH(TargetBit)()),
               " by TIER_CPU_SIMD");
    }
  });
}

}  // namespace detail

bool is_float_dtype(DType d) noexcept {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
}

std::vector<std::string> simd_targets() {
  std::vector<std::string> names;
  for (std::int64_t bits = real_supported_targets(); bits != 0; bits &= bits - 1) {
    names.emplace_back(hwy::TargetName(bits & -bits));
  }
  return names;
}

std::string simd_target() {
  detail::init_simd_once();
  return hwy::TargetName(HWY_DYNAMIC_DISPATCH(TargetBit)());
}

Status force_simd_target(std::string_view name) {
  detail::init_simd_once();
  std::lock_guard<std::mutex> lock(simd_mu());
  return force_locked(name);
}

Status convert(ConstTensorRef src, TensorRef dst, int threads) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(detail::check_tensor(src, "convert source"));
  TIER_RETURN_IF_ERROR(detail::check_tensor(dst, "convert destination"));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  if (src.numel != dst.numel) {
    return invalid_argument(str("convert: source has ", src.numel, " elements but destination ", dst.numel));
  }
  if (detail::overlaps(src, dst)) return invalid_argument("convert: source and destination overlap");
  if (src.dtype == dst.dtype) {
    const std::size_t es = dtype_size(src.dtype);
    detail::parallel_ranges(src.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
      std::memcpy(static_cast<std::uint8_t*>(dst.data) + b * es, static_cast<const std::uint8_t*>(src.data) + b * es,
                  (e - b) * es);
    });
    return {};
  }
  const int sk = detail::kind_of(src.dtype);
  const int dk = detail::kind_of(dst.dtype);
  const std::size_t ss = dtype_size(src.dtype);
  const std::size_t ds = dtype_size(dst.dtype);
  detail::parallel_ranges(src.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    HWY_DYNAMIC_DISPATCH(Convert)
    (sk, static_cast<const std::uint8_t*>(src.data) + b * ss, dk, static_cast<std::uint8_t*>(dst.data) + b * ds, e - b);
  });
  return {};
}

Result<double> sum_of_squares(ConstTensorRef x, int threads) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(detail::check_tensor(x, "sum_of_squares"));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  const int k = detail::kind_of(x.dtype);
  const std::size_t es = dtype_size(x.dtype);
  const std::uint64_t blocks = (x.numel + kGranule - 1) / kGranule;
  std::vector<double> partial(blocks, 0.0);
  detail::parallel_ranges(x.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t blk = b / kGranule; blk * kGranule < e; ++blk) {
      const std::uint64_t lo = blk * kGranule;
      const std::uint64_t hi = std::min(e, lo + kGranule);
      partial[blk] = HWY_DYNAMIC_DISPATCH(SumSquares)(k, static_cast<const std::uint8_t*>(x.data) + lo * es, hi - lo);
    }
  });
  double total = 0;
  for (const double p : partial) total += p;  // in block order: independent of the thread count
  return total;
}

Result<bool> has_non_finite(ConstTensorRef x, int threads) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(detail::check_tensor(x, "has_non_finite"));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  const int k = detail::kind_of(x.dtype);
  const std::size_t es = dtype_size(x.dtype);
  std::atomic<bool> found{false};
  detail::parallel_ranges(x.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t lo = b; lo < e && !found.load(std::memory_order_relaxed); lo += kGranule) {
      const std::uint64_t hi = std::min(e, lo + kGranule);
      if (HWY_DYNAMIC_DISPATCH(NonFinite)(k, static_cast<const std::uint8_t*>(x.data) + lo * es, hi - lo)) {
        found.store(true, std::memory_order_relaxed);
      }
    }
  });
  return found.load();
}

Status scale(TensorRef x, float factor, int threads) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(detail::check_tensor(x, "scale"));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  if (!std::isfinite(factor)) return invalid_argument(str("scale: factor ", factor, " is not finite"));
  const int k = detail::kind_of(x.dtype);
  const std::size_t es = dtype_size(x.dtype);
  detail::parallel_ranges(x.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    HWY_DYNAMIC_DISPATCH(Scale)(k, static_cast<std::uint8_t*>(x.data) + b * es, e - b, factor);
  });
  return {};
}

Status GradNormAccumulator::add(ConstTensorRef x, int threads) {
  TIER_ASSIGN_OR_RETURN(const double s, tier::cpu::sum_of_squares(x, threads));
  sum_ += s;
  return {};
}

double GradNormAccumulator::norm() const noexcept {
  return std::sqrt(sum_);
}

bool GradNormAccumulator::finite() const noexcept {
  return std::isfinite(sum_);
}

float clip_coefficient(double total_norm, double max_norm) noexcept {
  if (!(max_norm > 0) || !std::isfinite(total_norm)) return 1.0f;
  const double c = max_norm / (total_norm + 1e-6);
  return c < 1.0 ? static_cast<float>(c) : 1.0f;
}

Result<double> clip_by_global_norm(const TensorRef* grads, std::size_t count, double max_norm, int threads) {
  if (count > 0 && grads == nullptr) return invalid_argument("clip_by_global_norm: null tensor list");
  if (!std::isfinite(max_norm))
    return invalid_argument(str("clip_by_global_norm: max_norm ", max_norm, " is not finite"));
  GradNormAccumulator acc;
  for (std::size_t i = 0; i < count; ++i) {
    const Status s = acc.add(grads[i], threads);
    if (!s.ok()) return s.with_context(str("clip_by_global_norm: tensor ", i));
  }
  const double norm = acc.norm();
  if (!acc.finite()) return norm;
  const float c = clip_coefficient(norm, max_norm);
  if (c < 1.0f) {
    for (std::size_t i = 0; i < count; ++i) TIER_RETURN_IF_ERROR(scale(grads[i], c, threads));
  }
  return norm;
}

}  // namespace tier::cpu

#endif  // HWY_ONCE
