// Adam/AdamW for every Highway target, its dispatch, argument checks and threading; the
// roofline kernel with the same memory pattern.
#include "tier/cpu_adam.hpp"

#include "cpu/cpu_adam_internal.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/cpu_adam.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

// Must come after foreach_target.h/highway.h so that they are re-included for each target.
#include "cpu/adam_update-inl.h"
#include "cpu/simd_convert-inl.h"

#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using detail::AdamPtrs;

// One full vector of elements at index i (fp32 state).
template <Kind P, Kind G, Kind O, int kOp, class DF>
TIER_KERNEL_INLINE void AdamVector(DF df, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t i) {
  auto m = hn::LoadU(df, a.m + i);
  auto v = hn::LoadU(df, a.v + i);
  UpdateVector<P, G, O, kOp>(df, c, static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P),
                             static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G),
                             static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O), m, v);
  if constexpr (UsesM(kOp)) hn::StoreU(m, df, a.m + i);
  if constexpr (UsesV(kOp)) hn::StoreU(v, df, a.v + i);
}

// Lamb pass 1 on one vector: p (as fp32) and u into pf/u at i; the state is only read.
template <Kind P, Kind G, class DF>
TIER_KERNEL_INLINE void LambNormVector(DF df, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t i, float* pf,
                                       float* u) {
  const auto g =
      hn::Mul(LoadAsF32<G>(df, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G)), hn::Set(df, c.grad_scale));
  const auto p = LoadAsF32<P>(df, static_cast<const std::uint8_t*>(a.p) + i * ElemBytes(P));
  auto m = hn::LoadU(df, a.m + i);
  auto v = hn::LoadU(df, a.v + i);
  hn::StoreU(LambDirection(df, c, g, p, m, v), df, u + i);
  hn::StoreU(p, df, pf + i);
}

// The roofline: the same loads and stores, trivial arithmetic.
template <Kind P, Kind G, Kind O, class DF>
TIER_KERNEL_INLINE void RooflineVector(DF df, const AdamPtrs& a, std::size_t i) {
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

template <Kind P, Kind G, Kind O, bool kRoofline, int kOp>
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
      AdamVector<P, G, O, kOp>(df, c, a, i);
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
    AdamVector<P, G, O, kOp>(df, c, t, 0);
  }
  std::memcpy(static_cast<std::uint8_t*>(a.p) + i * ElemBytes(P), p, r * ElemBytes(P));
  std::memcpy(a.m + i, m, r * sizeof(float));
  std::memcpy(a.v + i, v, r * sizeof(float));
  if constexpr (O != Kind::kNone) {
    std::memcpy(static_cast<std::uint8_t*>(a.out) + i * ElemBytes(O), out, r * ElemBytes(O));
  }
}

template <bool kRoofline, int kOp>
void AdamByKind(int pk, int gk, int ok, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t n) {
  // params fp32 or bf16; grads fp32, fp16 or bf16; out none, fp16, bf16 or fp32.
#define TIER_ADAM_OUT(PK, GK)                                                                 \
  switch (static_cast<Kind>(ok)) {                                                            \
    case Kind::kNone: return AdamT<Kind::PK, Kind::GK, Kind::kNone, kRoofline, kOp>(c, a, n); \
    case Kind::kF16: return AdamT<Kind::PK, Kind::GK, Kind::kF16, kRoofline, kOp>(c, a, n);   \
    case Kind::kBF16: return AdamT<Kind::PK, Kind::GK, Kind::kBF16, kRoofline, kOp>(c, a, n); \
    case Kind::kF32: return AdamT<Kind::PK, Kind::GK, Kind::kF32, kRoofline, kOp>(c, a, n);   \
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
  switch (c.kind) {
    case OptimizerKind::kAdam:
      if (c.l2) return AdamByKind<false, kOpAdamL2>(pk, gk, ok, c, a, n);
      return AdamByKind<false, kOpAdam>(pk, gk, ok, c, a, n);
    case OptimizerKind::kAdagrad: return AdamByKind<false, kOpAdagrad>(pk, gk, ok, c, a, n);
    case OptimizerKind::kLion: return AdamByKind<false, kOpLion>(pk, gk, ok, c, a, n);
    case OptimizerKind::kLamb: return AdamByKind<false, kOpLamb>(pk, gk, ok, c, a, n);
  }
}

void Roofline(int pk, int gk, int ok, const AdamPtrs& a, std::size_t n) {
  const AdamStep::Constants c{};
  AdamByKind<true, kOpAdam>(pk, gk, ok, c, a, n);
}

template <Kind P, Kind G>
void LambNormT(const AdamStep::Constants& c_in, const AdamPtrs& a_in, std::size_t n, float* pf, float* u) {
  const AdamStep::Constants c = c_in;
  const AdamPtrs a = a_in;
  const hn::ScalableTag<float> df;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + N <= n; i += N) LambNormVector<P, G>(df, c, a, i, pf, u);
  if (i == n) return;
  const std::size_t r = n - i;
  HWY_ALIGN std::uint8_t p[HWY_MAX_BYTES] = {};
  HWY_ALIGN float m[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN float v[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN std::uint8_t g[HWY_MAX_BYTES] = {};
  HWY_ALIGN float tp[HWY_MAX_BYTES / sizeof(float)] = {};
  HWY_ALIGN float tu[HWY_MAX_BYTES / sizeof(float)] = {};
  std::memcpy(p, static_cast<const std::uint8_t*>(a.p) + i * ElemBytes(P), r * ElemBytes(P));
  std::memcpy(m, a.m + i, r * sizeof(float));
  std::memcpy(v, a.v + i, r * sizeof(float));
  std::memcpy(g, static_cast<const std::uint8_t*>(a.g) + i * ElemBytes(G), r * ElemBytes(G));
  const AdamPtrs t{p, m, v, g, nullptr};
  LambNormVector<P, G>(df, c, t, 0, tp, tu);
  std::memcpy(pf + i, tp, r * sizeof(float));
  std::memcpy(u + i, tu, r * sizeof(float));
}

void LambNorm(int pk, int gk, const AdamStep::Constants& c, const AdamPtrs& a, std::size_t n, float* pf, float* u) {
  const bool bf16 = static_cast<Kind>(pk) == Kind::kBF16;
  switch (static_cast<Kind>(gk)) {
    case Kind::kF32:
      return bf16 ? LambNormT<Kind::kBF16, Kind::kF32>(c, a, n, pf, u)
                  : LambNormT<Kind::kF32, Kind::kF32>(c, a, n, pf, u);
    case Kind::kF16:
      return bf16 ? LambNormT<Kind::kBF16, Kind::kF16>(c, a, n, pf, u)
                  : LambNormT<Kind::kF32, Kind::kF16>(c, a, n, pf, u);
    case Kind::kBF16:
      return bf16 ? LambNormT<Kind::kBF16, Kind::kBF16>(c, a, n, pf, u)
                  : LambNormT<Kind::kF32, Kind::kBF16>(c, a, n, pf, u);
    case Kind::kNone: return;
  }
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/parallel.hpp"

namespace tier::cpu {

HWY_EXPORT(Adam);
HWY_EXPORT(Roofline);
HWY_EXPORT(LambNorm);

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
  if (detail::state_family(t) != StateDType::kF32) {
    if (step == nullptr) {
      return unsupported(str("adam roofline: ", state_dtype_name(detail::state_family(t)),
                             " optimizer state is not supported; it measures fp32 state"));
    }
    return detail::adam_update_compressed(*step, t, nthreads);
  }
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
  if (eps == 0 && kind != OptimizerKind::kLion) {
    // Lion takes signs; the others divide by sqrt(state) + eps, which is 0 wherever a gradient is.
    return invalid_argument(str(optimizer_kind_name(kind),
                                ": eps 0 divides by zero wherever a gradient is 0 (NaN "
                                "parameters); use a small positive eps such as 1e-8"));
  }
  if (weight_decay < 0) return invalid_argument(str("adam: weight_decay ", weight_decay, " is negative"));
  if (decay_mode != WeightDecayMode::kDecoupled && decay_mode != WeightDecayMode::kL2) {
    return invalid_argument("adam: unknown weight decay mode");
  }
  if (kind != OptimizerKind::kAdam && kind != OptimizerKind::kAdagrad && kind != OptimizerKind::kLion &&
      kind != OptimizerKind::kLamb) {
    return invalid_argument(
        str("optimizer: unknown kind ", static_cast<int>(kind), "; use adam (adamw), adagrad, lion or lamb"));
  }
  if (kind == OptimizerKind::kLamb) {
    TIER_RETURN_IF_ERROR(check_finite(max_coeff, "max_coeff"));
    TIER_RETURN_IF_ERROR(check_finite(min_coeff, "min_coeff"));
    if (min_coeff < 0 || min_coeff > max_coeff) {
      return invalid_argument(str("lamb: min_coeff ", min_coeff, " and max_coeff ", max_coeff,
                                  " must satisfy 0 <= min_coeff <= max_coeff"));
    }
  }
  return {};
}

const char* optimizer_kind_name(OptimizerKind k) noexcept {
  switch (k) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdagrad: return "adagrad";
    case OptimizerKind::kLion: return "lion";
    case OptimizerKind::kLamb: return "lamb";
  }
  return "unknown";
}

AdamHyperParams default_hyper_params(OptimizerKind kind) {
  AdamHyperParams hp;
  hp.kind = kind;
  if (kind == OptimizerKind::kAdagrad) {
    hp.lr = 1e-2;
    hp.eps = 1e-10;
    hp.decay_mode = WeightDecayMode::kL2;
  } else if (kind == OptimizerKind::kLion) {
    hp.lr = 1e-4;
    hp.beta2 = 0.99;
  }
  return hp;
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
  c.kind = hp.kind;
  c.inv_bc1 = 1.0f;
  c.weight_decay = 0.0f;
  switch (hp.kind) {
    case OptimizerKind::kAdam: break;
    case OptimizerKind::kAdagrad:  // always L2, no bias correction
      c.l2 = true;
      c.step_size = static_cast<float>(hp.lr);
      c.inv_sqrt_bc2 = 1.0f;
      c.decay_factor = 1.0f;
      c.l2_weight_decay = static_cast<float>(hp.weight_decay);
      break;
    case OptimizerKind::kLion:  // always decoupled, no bias correction
      c.l2 = false;
      c.step_size = static_cast<float>(hp.lr);
      c.inv_sqrt_bc2 = 1.0f;
      c.decay_factor = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
      c.l2_weight_decay = 0.0f;
      break;
    case OptimizerKind::kLamb:  // weight decay is a term of u; the trust ratio scales lr
      c.l2 = false;
      c.step_size = static_cast<float>(hp.lr);
      c.inv_bc1 = static_cast<float>(1.0 / bc1);
      c.decay_factor = 1.0f;
      c.l2_weight_decay = 0.0f;
      c.weight_decay = static_cast<float>(hp.weight_decay);
      break;
  }
  if (!std::isfinite(c.step_size) || !std::isfinite(c.inv_sqrt_bc2) || !std::isfinite(c.grad_scale)) {
    return invalid_argument(str("adam: step ", step, " gives non-finite constants in fp32 (lr ", hp.lr, ", beta1 ",
                                hp.beta1, ", beta2 ", hp.beta2, ", grad_scale ", grad_scale, ")"));
  }
  return s;
}

AdamStep AdamStep::with_trust(double trust) const {
  AdamStep s = *this;
  if (hp_.kind == OptimizerKind::kLamb) s.c_.step_size = static_cast<float>(hp_.lr * trust);
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
  TIER_RETURN_IF_ERROR(detail::check_tensor(t.grads, "adam grads"));
  if (t.params.dtype != DType::kF32 && t.params.dtype != DType::kBF16) {
    return invalid_argument(
        str("adam params: dtype ", dtype_name(t.params.dtype), " is not supported; use fp32 (or bf16)"));
  }
  // exp_avg / exp_avg_sq: fp32, bf16, or int8 / uint8 with scales (state_codec.hpp).
  TIER_RETURN_IF_ERROR(detail::check_state(t));
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

void LambNorms::reset(std::uint64_t numel) {
  numel_ = numel;
  acc_.assign((numel + kBlock - 1) / kBlock * 2 * kLanes, 0.0);
}

double LambNorms::total(int which) const noexcept {
  double sum = 0;
  const std::size_t blocks = acc_.size() / (2 * kLanes);
  for (std::size_t b = 0; b < blocks; ++b) {
    double l[kLanes];
    const double* lanes = acc_.data() + (b * 2 + static_cast<std::size_t>(which)) * kLanes;
    for (int i = 0; i < kLanes; ++i) l[i] = lanes[i];
    for (int w = kLanes / 2; w >= 1; w /= 2) {  // a fixed pairwise tree
      for (int i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
    }
    sum += l[0];
  }
  return sum;
}

Status lamb_accumulate_norms(const AdamStep& step, const AdamTensors& t, std::uint64_t offset, LambNorms& norms,
                             int threads) {
  detail::init_simd_once();
  if (step.hyper_params().kind != OptimizerKind::kLamb) {
    return invalid_argument(
        str("lamb norms: the step is ", optimizer_kind_name(step.hyper_params().kind), ", not lamb"));
  }
  AdamTensors in = t;
  in.out = TensorRef{};
  TIER_RETURN_IF_ERROR(validate(in));
  if (detail::state_family(in) != StateDType::kF32) {
    return unsupported(str("lamb: ", state_dtype_name(detail::state_family(in)),
                           " optimizer state is not supported yet; use fp32 state"));
  }
  const std::uint64_t n = in.params.numel;
  if (offset > norms.numel() || n > norms.numel() - offset) {
    return invalid_argument(
        str("lamb norms: elements [", offset, ", ", offset + n, ") are past the parameter's ", norms.numel()));
  }
  if (n == 0) return {};
  TIER_ASSIGN_OR_RETURN(const int nthreads, detail::resolve_threads(threads));
  const int pk = detail::kind_of(in.params.dtype);
  const int gk = detail::kind_of(in.grads.dtype);
  // Whole 64 Ki blocks (of the parameter) go to one thread each, so a (block, lane) slot is
  // only ever added to in element order.
  const std::uint64_t first_block = offset / LambNorms::kBlock;
  const std::uint64_t blocks = (offset + n - 1) / LambNorms::kBlock - first_block + 1;
  detail::parallel_ranges(blocks, nthreads, 1, [&](std::uint64_t bb, std::uint64_t be) {
    constexpr std::uint64_t kPiece = 4096;
    std::vector<float> pf(kPiece), u(kPiece);
    for (std::uint64_t b = first_block + bb; b < first_block + be; ++b) {
      const std::uint64_t lo = std::max(offset, b * LambNorms::kBlock);
      const std::uint64_t hi = std::min(offset + n, (b + 1) * LambNorms::kBlock);
      double* lanes = norms.acc_.data() + b * 2 * LambNorms::kLanes;
      for (std::uint64_t x = lo; x < hi; x += kPiece) {
        const std::uint64_t k = std::min(kPiece, hi - x);
        HWY_DYNAMIC_DISPATCH(LambNorm)(pk, gk, step.constants(), ptrs_at(in, x - offset), k, pf.data(), u.data());
        // Element x + j goes to lane (x + j) % 16. Products are exact (a float squared fits a
        // double); whole groups of 16 update the 16 lanes independently, which vectorizes
        // without reordering any lane's sum.
        std::uint64_t j = 0;
        auto one = [&](std::uint64_t at) {
          const auto lane = static_cast<std::size_t>((x + at) % LambNorms::kLanes);
          const double pd = pf[at], ud = u[at];
          lanes[lane] += pd * pd;
          lanes[LambNorms::kLanes + lane] += ud * ud;
        };
        for (; j < k && (x + j) % LambNorms::kLanes != 0; ++j) one(j);
        double* lp = lanes;
        double* lu = lanes + LambNorms::kLanes;
        for (; j + LambNorms::kLanes <= k; j += LambNorms::kLanes) {
          for (int l = 0; l < LambNorms::kLanes; ++l) {
            const double pd = pf[j + static_cast<std::uint64_t>(l)], ud = u[j + static_cast<std::uint64_t>(l)];
            lp[l] += pd * pd;
            lu[l] += ud * ud;
          }
        }
        for (; j < k; ++j) one(j);
      }
    }
  });
  return {};
}

double lamb_trust_ratio(const AdamHyperParams& hp, double param_sq, double update_sq) {
  if (!(param_sq > 0) || !(update_sq > 0)) return 1.0;
  if (!std::isfinite(param_sq) || !std::isfinite(update_sq)) return 1.0;
  const double r = std::sqrt(param_sq) / std::sqrt(update_sq);
  return std::clamp(r, hp.min_coeff, hp.max_coeff);
}

Status lamb_update(const AdamStep& step, const AdamTensors& t, int threads) {
  LambNorms norms(t.params.numel);
  TIER_RETURN_IF_ERROR(lamb_accumulate_norms(step, t, 0, norms, threads));
  const double trust = lamb_trust_ratio(step.hyper_params(), norms.param_sq(), norms.update_sq());
  return adam_update(step.with_trust(trust), t, threads);
}

}  // namespace tier::cpu

#endif  // HWY_ONCE
