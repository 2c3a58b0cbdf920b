// The arithmetic of one vector of an optimizer step, per Highway target, shared by the fp32-state
// kernel (cpu_adam.cpp) and the compressed-state kernels (cpu_adam_compressed.cpp): both run
// exactly these instructions on the moments, whatever they are stored as, which is what makes a
// step over compressed state the fp32 step on the decoded state. Included once per target from
// inside foreach_target, hence the toggling include guard.

#if defined(TIER_CPU_ADAM_UPDATE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TIER_CPU_ADAM_UPDATE_INL_H_
#undef TIER_CPU_ADAM_UPDATE_INL_H_
#else
#define TIER_CPU_ADAM_UPDATE_INL_H_
#endif

#include <cstdint>

#include "cpu/simd_convert-inl.h"
#include "hwy/highway.h"
#include "tier/cpu_adam.hpp"

HWY_BEFORE_NAMESPACE();
namespace tier::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The update rule of one instantiation (AdamStep::Constants::kind and l2 pick it at dispatch).
enum Op : int { kOpAdam = 0, kOpAdamL2 = 1, kOpAdagrad = 2, kOpLion = 3, kOpLamb = 4 };

// Which moments a rule reads and writes: m for all but Adagrad, v for all but Lion.
constexpr bool UsesM(int op) {
  return op != kOpAdagrad;
}
constexpr bool UsesV(int op) {
  return op != kOpLion;
}

// Lamb's new moments (into m, v) and its update direction u. The norms pass and the apply pass
// both go through exactly these instructions, so u is the same in both.
template <class DF, class VF>
TIER_KERNEL_INLINE VF LambDirection(DF df, const AdamStep::Constants& c, VF g, VF p, VF& m, VF& v) {
  m = hn::MulAdd(m, hn::Set(df, c.beta1), hn::Mul(g, hn::Set(df, c.one_minus_beta1)));
  v = hn::MulAdd(v, hn::Set(df, c.beta2), hn::Mul(hn::Mul(g, g), hn::Set(df, c.one_minus_beta2)));
  const auto denom = hn::MulAdd(hn::Sqrt(v), hn::Set(df, c.inv_sqrt_bc2), hn::Set(df, c.eps));
  return hn::MulAdd(hn::Set(df, c.weight_decay), p, hn::Div(hn::Mul(m, hn::Set(df, c.inv_bc1)), denom));
}

// One full vector of elements: reads the grads at gp and the params at pp, updates m and v (the
// moments as fp32, in registers), stores the params (and their low-precision copy at outp).
// Returns sqrt(v) of the new v for the rules that take it (Adam, Adagrad; zero for the others):
// the int8 codec quantizes exactly that root, so it need not be taken twice. Every element, in
// the body or the tail of a chunk and whatever the state dtype, goes through exactly these
// instructions: that is what makes chunking and the state format invisible to the arithmetic.
template <Kind P, Kind G, Kind O, int kOp, class DF, class VF = hn::Vec<DF>>
TIER_KERNEL_INLINE VF UpdateVector(DF df, const AdamStep::Constants& c, void* pp, const void* gp, void* outp, VF& m,
                                   VF& v) {
  auto g = hn::Mul(LoadAsF32<G>(df, gp), hn::Set(df, c.grad_scale));
  auto p = LoadAsF32<P>(df, pp);
  VF root = hn::Zero(df);
  if constexpr (kOp == kOpAdam || kOp == kOpAdamL2) {
    if constexpr (kOp == kOpAdamL2) g = hn::MulAdd(hn::Set(df, c.l2_weight_decay), p, g);
    m = hn::MulAdd(m, hn::Set(df, c.beta1), hn::Mul(g, hn::Set(df, c.one_minus_beta1)));
    v = hn::MulAdd(v, hn::Set(df, c.beta2), hn::Mul(hn::Mul(g, g), hn::Set(df, c.one_minus_beta2)));
    root = hn::Sqrt(v);
    const auto denom = hn::MulAdd(root, hn::Set(df, c.inv_sqrt_bc2), hn::Set(df, c.eps));
    // Decoupled decay and the step in one fused multiply-add: one rounding of p per step.
    const auto delta = hn::Mul(hn::Set(df, c.step_size), hn::Div(m, denom));
    if constexpr (kOp == kOpAdamL2) {
      p = hn::Sub(p, delta);
    } else {
      p = hn::MulSub(p, hn::Set(df, c.decay_factor), delta);
    }
  } else if constexpr (kOp == kOpAdagrad) {
    g = hn::MulAdd(hn::Set(df, c.l2_weight_decay), p, g);
    v = hn::MulAdd(g, g, v);
    root = hn::Sqrt(v);
    const auto denom = hn::Add(root, hn::Set(df, c.eps));
    p = hn::Sub(p, hn::Mul(hn::Set(df, c.step_size), hn::Div(g, denom)));
  } else if constexpr (kOp == kOpLion) {
    const auto cm = hn::MulAdd(m, hn::Set(df, c.beta1), hn::Mul(g, hn::Set(df, c.one_minus_beta1)));
    const auto zero = hn::Zero(df);
    const auto sign = hn::IfThenElseZero(hn::Ne(cm, zero), hn::CopySign(hn::Set(df, 1.0f), cm));
    p = hn::MulSub(p, hn::Set(df, c.decay_factor), hn::Mul(hn::Set(df, c.step_size), sign));
    m = hn::MulAdd(m, hn::Set(df, c.beta2), hn::Mul(g, hn::Set(df, c.one_minus_beta2)));
  } else {
    const auto u = LambDirection(df, c, g, p, m, v);
    p = hn::Sub(p, hn::Mul(hn::Set(df, c.step_size), u));  // step_size = lr * trust
  }
  StoreFromF32<P>(df, p, pp);
  // The low-precision copy is the stored params converted (bf16 params: rounded once already).
  if constexpr (O != Kind::kNone) StoreFromF32<O>(df, RoundTo<P>(df, p), outp);
  return root;
}

}  // namespace tier::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggle
