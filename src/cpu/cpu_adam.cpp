// Adam/AdamW for every Highway target, its dispatch, argument checks and threading; the
// roofline kernel with the same memory pattern.
#include "tier/cpu_adam.hpp"

#ifndef TIER_CPU_ADAM_PTRS_
#define TIER_CPU_ADAM_PTRS_
namespace tier::cpu::detail {
// The five streams of one update, at the first element of a piece (same type for every target).
struct AdamPtrs {
  void* p;
  float* m;
  float* v;
  const void* g;
  void* out;
};
}  // namespace tier::cpu::detail
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/cpu_adam.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

// Must come after foreach_target.h/highway.h so that it is re-included for each target.
#include "cpu/simd_convert-inl.h"

#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using detail::AdamPtrs;

// One full vector of elements at index i. Every element, whether in the body or the tail of a
// chunk, goes through exactly these instructions: that is what makes chunking invisible.
template <Kind P, Kind G, Kind O, bool kL2, class DF>
HWY_INLINE void AdamVector(DF df, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t i) {
  void* pp = static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P);
  auto g =
      hn::Mul(LoadAsF32<G>(df, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G)), hn::Set(df, c.grad_scale));
  auto p = LoadAsF32<P>(df, pp);
  auto m = hn::LoadU(df, a.m + i);
  auto v = hn::LoadU(df, a.v + i);
  if constexpr (kL2) g = hn::MulAdd(hn::Set(df, c.l2_weight_decay), p, g);
  m = hn::MulAdd(m, hn::Set(df, c.beta1), hn::Mul(g, hn::Set(df, c.one_minus_beta1)));
  v = hn::MulAdd(v, hn::Set(df, c.beta2), hn::Mul(hn::Mul(g, g), hn::Set(df, c.one_minus_beta2)));
  const auto denom = hn::MulAdd(hn::Sqrt(v), hn::Set(df, c.inv_sqrt_bc2), hn::Set(df, c.eps));
  // Decoupled decay and the step in one fused multiply-add: one rounding of p per step.
  const auto delta = hn::Mul(hn::Set(df, c.step_size), hn::Div(m, denom));
  if constexpr (kL2) {
    p = hn::Sub(p, delta);
  } else {
    p = hn::MulSub(p, hn::Set(df, c.decay_factor), delta);
  }
  hn::StoreU(m, df, a.m + i);
  hn::StoreU(v, df, a.v + i);
  StoreFromF32<P>(df, p, pp);
  // The low-precision copy is the stored params converted (bf16 params: rounded once already).
  if constexpr (O != Kind::kNone) {
    StoreFromF32<O>(df, RoundTo<P>(df, p), static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O));
  }
}

// The roofline: the same loads and stores, trivial arithmetic.
template <Kind P, Kind G, Kind O, class DF>
HWY_INLINE void RooflineVector(DF df, const AdamPtrs& a, std::size_t i) {
  void* pp = static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P);
  const auto g = LoadAsF32<G>(df, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G));
  const auto p = LoadAsF32<P>(df, pp);
  const auto m = hn::Add(hn::LoadU(df, a.m + i), g);
  const auto v = hn::Add(hn::LoadU(df, a.v + i), g);
  hn::StoreU(m, df, a.m + i);
  hn::StoreU(v, df, a.v + i);
  const auto np = hn::Add(p, m);
  StoreFromF32<P>(df, np, pp);
  StoreFromF32<O>(df, np, static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O));
}

template <Kind P, Kind G, Kind O, bool kRoofline, bool kL2>
void AdamT(const AdamStep::Constants& c_in, const AdamPtrs& a_in, std::size_t n) {
  // Local copies: the stores through float* could alias the caller's structs, and the compiler
  // would then reload every pointer and re-broadcast every constant on each vector.
  const AdamStep::Constants c = c_in;
  const AdamPtrs a = a_in;
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    if constexpr (kRoofline) {
      RooflineVector<P, G, O>(df, a, i);
    } else {
      AdamVector<P, G, O, kL2>(df, c, a, i);
    }
  }
  if (i == n) return;
  // Tail: copy into full-vector buffers, run the same vector code, copy back.
  const std::size_t r = n - i;
  HWY_ALIGN std::uint8_t p[HWY_MAX_BYTES] = {};
  HWY_ALIGN float m[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN float v[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN std::uint8_t g[HWY_MAX_BYTES] = {};
  HWY_ALIGN std::uint8_t out[HWY_MAX_BYTES] = {};
  std::memcpy(p, static_cast<const std::uint8_t*>(a.p) + i * ElemBytes(P), r * ElemBytes(P));
  std::memcpy(m, a.m + i, r * sizeof(float));
  std::memcpy(v, a.v + i, r * sizeof(float));
  std::memcpy(g, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G), r * ElemBytes(G));
  const AdamPtrs t{p, m, v, g, out};
  if constexpr (kRoofline) {
    RooflineVector<P, G, O>(df, t, 0);
  } else {
    AdamVector<P, G, O, kL2>(df, c, t, 0);
  }
  std::memcpy(static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P), p, r * ElemBytes(P));
  std::memcpy(a.m + i, m, r * sizeof(float));
  std::memcpy(a.v + i, v, r * sizeof(float));
  if constexpr (O != Kind::kNone) {
    std::memcpy(static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O), out, r * ElemBytes(O));
  }
}

template <bool kRoofline, bool kL2>
void AdamByKind(int pk, int gk, int ok, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t n) {
  // params fp32 or bf16; grads fp32, fp16 or bf16; out none, fp16, bf16 or fp32.
#define TIER_ADAM_OUT(PK, GK)                                                                 \
  switch (static_cast<Kind>(ok)) {                                                            \
    case Kind::kNone: return AdamT<Kind::PK, Kind::GK, Kind::kNone, kRoofline, kL2>(c, a, n); \
    case Kind::kF16: return AdamT<Kind::PK, Kind::GK, Kind::kF16, kRoofline, kL2>(c, a, n);   \
    case Kind::kBF16: return AdamT<Kind::PK, Kind::GK, Kind::kBF16, kRoofline, kL2>(c, a, n); \
    case Kind::kF32: return AdamT<Kind::PK, Kind::GK, Kind::kF32, kRoofline, kL2>(c, a, n);   \
  }
#define TIER_ADAM_GRAD(PK)                             \
  switch (static_cast<Kind>(gk)) {                     \
    case Kind::kF32: TIER_ADAM_OUT(PK, kF32) return;   \
    case Kind::kF16: TIER_ADAM_OUT(PK, kF16) return;   \
    case Kind::kBF16: TIER_ADAM_OUT(PK, kBF16) return; \
    case Kind::kNone: return;                          \
  }
  if (static_cast<Kind>(pk) == Kind::kBF16) {
    TIER_ADAM_GRAD(kBF16)
  } else {
    TIER_ADAM_GRAD(kF32)
  }
#undef TIER_ADAM_GRAD
#undef TIER_ADAM_OUT
}

void Adam(int pk, int gk, int ok, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t n) {
  if (c.l2) {
    AdamByKind<false, true>(pk, gk, ok, c, a, n);
  } else {
    AdamByKind<false, false>(pk, gk, ok, c, a, n);
  }
}

void Roofline(int pk, int gk, int ok, const AdamPtrs& a, std::size_t n) {
  const AdamStep::Constants c{};
  AdamByKind<true, false>(pk, gk, ok, c, a, n);
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <cmath>

#include "cpu/parallel.hpp"

namespace tier::cpu {

HWY_EXPORT(Adam);
HWY_EXPORT(Roofline);

namespace {

// Elements per piece handed to a thread. Static partitioning gives each thread one contiguous run
// of pieces; the piece only bounds how finely the range can be split.
constexpr std::uint64_t kGranule = 32 * 1024;
constexpr int kOutNone = 3;

Status check_finite(double v, const char* name) {
  if (!std::isfinite(v)) return invalid_argument(str("adam: ", name, " is ", v, "; it must be finite"));
  return {};
}

detail::AdamPtrs ptrs_at(const AdamTensors& t, std::uint64_t i) {
  auto at = [i](const void* p, DType d) {
    return p == nullptr ? nullptr : const_cast<std::uint8_t*>(static_cast<const std::uint8_t*>(p)) + i * dtype_size(d);
  };
  return {at(t.params.data, t.params.dtype), reinterpret_cast<float*>(at(t.exp_avg.data, DType::kF32)),
          reinterpret_cast<float*>(at(t.exp_avg_sq.data, DType::kF32)), at(t.grads.data, t.grads.dtype),
          at(t.out.data, t.out.dtype)};
}

int out_kind(const AdamTensors& t) {
  return t.out.data == nullptr ? kOutNone : detail::kind_of(t.out.dtype);
}

Status run(const AdamStep* step, const AdamTensors& t, int threads) {
  detail::init_simd_once();
  TIER_RETURN_IF_ERROR(validate(t));
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  const int pk = detail::kind_of(t.params.dtype);
  const int gk = detail::kind_of(t.grads.dtype);
  const int ok = out_kind(t);
  detail::parallel_ranges(t.params.numel, nthreads, kGranule, [&](std::uint64_t b, std::uint64_t e) {
    if (step != nullptr) {
      HWY_DYNAMIC_DISPATCH(Adam)(pk, gk, ok, step->constants(), ptrs_at(t, b), e - b);
    } else {
      HWY_DYNAMIC_DISPATCH(Roofline)(pk, gk, ok, ptrs_at(t, b), e - b);
    }
  });
  return {};
}

}  // namespace

Status AdamHyperParams::validate() const {
  TIER_RETURN_IF_ERROR(check_finite(lr, "lr"));
  TIER_RETURN_IF_ERROR(check_finite(beta1, "beta1"));
  TIER_RETURN_IF_ERROR(check_finite(beta2, "beta2"));
  TIER_RETURN_IF_ERROR(check_finite(eps, "eps"));
  TIER_RETURN_IF_ERROR(check_finite(weight_decay, "weight_decay"));
  if (lr < 0) return invalid_argument(str("adam: lr ", lr, " is negative"));
  if (beta1 < 0 || beta1 >= 1) return invalid_argument(str("adam: beta1 ", beta1, " is outside [0, 1)"));
  if (beta2 < 0 || beta2 >= 1) return invalid_argument(str("adam: beta2 ", beta2, " is outside [0, 1)"));
  if (eps < 0) return invalid_argument(str("adam: eps ", eps, " is negative"));
  if (weight_decay < 0) return invalid_argument(str("adam: weight_decay ", weight_decay, " is negative"));
  if (decay_mode != WeightDecayMode::kDecoupled && decay_mode != WeightDecayMode::kL2) {
    return invalid_argument("adam: unknown weight decay mode");
  }
  return {};
}

Result<AdamStep> AdamStep::make(const AdamHyperParams& hp, std::int64_t step, double grad_scale) {
  TIER_RETURN_IF_ERROR(hp.validate());
  if (step < 1) return invalid_argument(str("adam: step ", step, " must be at least 1 (steps count from 1)"));
  if (!std::isfinite(grad_scale) || grad_scale <= 0) {
    return invalid_argument(str("adam: grad_scale ", grad_scale, " must be finite and positive"));
  }
  AdamStep s;
  s.hp_ = hp;
  s.step_ = step;
  s.grad_scale_ = grad_scale;
  const double t = static_cast<double>(step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(hp.beta1, t) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(hp.beta2, t) : 1.0;
  auto& c = s.c_;
  c.beta1 = static_cast<float>(hp.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  c.step_size = static_cast<float>(hp.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(hp.eps);
  c.l2 = hp.decay_mode == WeightDecayMode::kL2;
  c.decay_factor = c.l2 ? 1.0f : static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  c.l2_weight_decay = c.l2 ? static_cast<float>(hp.weight_decay) : 0.0f;
  c.grad_scale = static_cast<float>(grad_scale);
  if (!std::isfinite(c.step_size) || !std::isfinite(c.inv_sqrt_bc2) || !std::isfinite(c.grad_scale)) {
    return invalid_argument(str("adam: step ", step, " gives non-finite constants in fp32 (lr ", hp.lr, ", beta1 ",
                                hp.beta1, ", beta2 ", hp.beta2, ", grad_scale ", grad_scale, ")"));
  }
  return s;
}

Result<AdamGroup> AdamGroup::create(const AdamHyperParams& hp) {
  TIER_RETURN_IF_ERROR(hp.validate());
  return AdamGroup(hp);
}

Status AdamGroup::set_hyper_params(const AdamHyperParams& hp) {
  TIER_RETURN_IF_ERROR(hp.validate());
  hp_ = hp;
  return {};
}

Status AdamGroup::set_lr(double lr) {
  AdamHyperParams hp = hp_;
  hp.lr = lr;
  return set_hyper_params(hp);
}

Status AdamGroup::set_step(std::int64_t step) {
  if (step < 0) return invalid_argument(str("adam group: step ", step, " is negative"));
  step_ = step;
  return {};
}

Result<AdamStep> AdamGroup::begin_step(double grad_scale) {
  TIER_ASSIGN_OR_RETURN(AdamStep s, AdamStep::make(hp_, step_ + 1, grad_scale));
  ++step_;
  return s;
}

Status validate(const AdamTensors& t) {
  TIER_RETURN_IF_ERROR(detail::check_tensor(t.params, "adam params"));
  TIER_RETURN_IF_ERROR(detail::check_tensor(t.exp_avg, "adam exp_avg"));
  TIER_RETURN_IF_ERROR(detail::check_tensor(t.exp_avg_sq, "adam exp_avg_sq"));
  TIER_RETURN_IF_ERROR(detail::check_tensor(t.grads, "adam grads"));
  if (t.params.dtype != DType::kF32 && t.params.dtype != DType::kBF16) {
    return invalid_argument(
        str("adam params: dtype ", dtype_name(t.params.dtype), " is not supported; use fp32 (or bf16)"));
  }
  if (t.exp_avg.dtype != DType::kF32 || t.exp_avg_sq.dtype != DType::kF32) {
    return invalid_argument("adam: exp_avg and exp_avg_sq must be fp32");
  }
  const std::uint64_t n = t.params.numel;
  auto same = [n](const ConstTensorRef& x, const char* what) -> Status {
    if (x.numel != n) return invalid_argument(str("adam ", what, ": ", x.numel, " elements but params have ", n));
    return {};
  };
  TIER_RETURN_IF_ERROR(same(t.exp_avg, "exp_avg"));
  TIER_RETURN_IF_ERROR(same(t.exp_avg_sq, "exp_avg_sq"));
  TIER_RETURN_IF_ERROR(same(t.grads, "grads"));
  const bool has_out = t.out.data != nullptr;
  if (has_out) {
    TIER_RETURN_IF_ERROR(detail::check_tensor(t.out, "adam out"));
    TIER_RETURN_IF_ERROR(same(t.out, "out"));
  }
  const ConstTensorRef all[] = {t.params, t.exp_avg, t.exp_avg_sq, t.grads, t.out};
  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grads", "out"};
  for (int i = 0; i < 5; ++i) {
    for (int j = i + 1; j < 5; ++j) {
      if (detail::overlaps(all[i], all[j])) {
        return invalid_argument(str("adam: ", names[i], " and ", names[j], " overlap; give each its own buffer"));
      }
    }
  }
  return {};
}

Status adam_update_chunk(const AdamStep& step, const AdamTensors& t) {
  return run(&step, t, 1);
}

Status adam_update(const AdamStep& step, const AdamTensors& t, int threads) {
  return run(&step, t, threads);
}

Status adam_roofline_pass(const AdamTensors& t, int threads) {
  return run(nullptr, t, threads);
}

}  // namespace tier::cpu

#endif  // HWY_ONCE
