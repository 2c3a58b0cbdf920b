// A C entry point into tier's CPU Adam for bench/compare_adam.py, which loads it with ctypes so
// that tier, DeepSpeed and PyTorch steps run interleaved in one process on tensors allocated the
// same way. Built by the script itself (not part of the library or its tests).
#include <cstdint>
#include <memory>

#include "tier/cpu_adam.hpp"

namespace {

tier::DType dtype_of(int code) {
  return code == 1 ? tier::DType::kF16 : (code == 2 ? tier::DType::kBF16 : tier::DType::kF32);
}

struct Shim {
  tier::cpu::AdamGroup group;
  tier::cpu::AdamTensors tensors;
  int threads;
};

}  // namespace

extern "C" {

// dtype codes: 0 fp32, 1 fp16, 2 bf16; out may be null. Returns a handle or null.
void* tier_shim_create(std::uint64_t n, void* params, int param_dtype, float* exp_avg, float* exp_avg_sq,
                       const void* grads, int grad_dtype, void* out, int out_dtype, int threads, double lr,
                       double weight_decay) {
  tier::cpu::AdamHyperParams hp;
  hp.lr = lr;
  hp.weight_decay = weight_decay;
  auto group = tier::cpu::AdamGroup::create(hp);
  if (!group.ok()) return nullptr;
  tier::cpu::AdamTensors t{{params, dtype_of(param_dtype), n},
                           {exp_avg, tier::DType::kF32, n},
                           {exp_avg_sq, tier::DType::kF32, n},
                           {grads, dtype_of(grad_dtype), n},
                           out ? tier::cpu::TensorRef{out, dtype_of(out_dtype), n} : tier::cpu::TensorRef{}};
  if (!tier::cpu::validate(t).ok()) return nullptr;
  return new Shim{std::move(group).value(), t, threads};
}

// One optimizer step; 0 on success.
int tier_shim_step(void* handle) {
  auto* s = static_cast<Shim*>(handle);
  auto step = s->group.begin_step();
  if (!step.ok()) return 1;
  return tier::cpu::adam_update(*step, s->tensors, s->threads).ok() ? 0 : 1;
}

// One pass of the roofline kernel (Adam's memory pattern, trivial arithmetic) over the tensors.
int tier_shim_roofline(void* handle) {
  auto* s = static_cast<Shim*>(handle);
  return tier::cpu::adam_roofline_pass(s->tensors, s->threads).ok() ? 0 : 1;
}

void tier_shim_destroy(void* handle) {
  delete static_cast<Shim*>(handle);
}

// The SIMD target to use ("" or "auto" for the best); 0 on success.
int tier_shim_force_simd(const char* name) {
  return tier::cpu::force_simd_target(name).ok() ? 0 : 1;
}

}  // extern "C"
