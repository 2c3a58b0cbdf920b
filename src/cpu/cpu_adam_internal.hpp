// Internal: what cpu_adam.cpp (fp32 state) and cpu_adam_compressed.cpp (bf16 and int8 state)
// share besides the per-vector arithmetic of adam_update-inl.h, which both run, so every
// optimizer kind, dtype and `out` of the fp32 kernel carries over with the same arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tier/cpu_adam.hpp"
#include "tier/state_codec.hpp"
#include "tier/status.hpp"

namespace tier::cpu::detail {

// The five streams of one fp32-state update, at the first element of a piece (same type for every
// target).
struct AdamPtrs {
  void* p;
  float* m;
  float* v;
  const void* g;
  void* out;
};

// The streams of a compressed-state update: m and v in their state dtype, with their int8 block
// scales (null for bf16), all at the first element (and first block) of a piece.
struct StatePtrs {
  void* p;
  void* m;
  void* v;
  const void* g;
  void* out;
  float* m_scales;
  float* v_scales;
};

// Checks exp_avg, exp_avg_sq and their scales (dtypes of one family, null data, alignment,
// scale pointers); validate() calls it. Lengths and overlaps are validate()'s.
Status check_state(const AdamTensors& t);
// The family of validated tensors.
StateDType state_family(const AdamTensors& t) noexcept;

// adam_update for bf16 and int8 state (validated tensors), split over `nthreads` at block
// boundaries. kUnsupported for Lamb.
Status adam_update_compressed(const AdamStep& step, const AdamTensors& t, int nthreads);

}  // namespace tier::cpu::detail
