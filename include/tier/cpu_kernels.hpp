// tier/cpu_kernels.hpp — the CPU's element-wise kernels over gradients and parameters: dtype
// conversion (fp32 <-> fp16/bf16), sum of squares and global L2 norm, inf/nan detection, scaling
// (loss-scale unscaling, clipping) and clipping by global norm; random fills (uniform, normal);
// plus control of the SIMD target.
//
// Every kernel runs on SIMD vectors chosen at run time (Google Highway: AVX-512, AVX2, SSE4, NEON
// or a portable fallback, from one binary) and takes a thread count: 1 runs on the calling thread
// only, 0 uses all cores, N at most N threads of a oneTBB arena. Conversions round to
// nearest-even, overflow to infinity and keep NaNs NaN, on every target.
//
// Determinism: element-wise kernels give bit-identical results for any thread count and any
// chunking of a range. Sums (sum_of_squares) are accumulated in fp64 over fixed blocks that are
// combined in order, so a sum depends on the SIMD target and on how the caller chunked the range,
// never on the thread count. Results may differ between SIMD targets (FMA, vector width).
//
// Thread safety: kernels may run concurrently from any threads on disjoint outputs. The SIMD
// target controls (force_simd_target) are process-wide and must not be called while kernels run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier::cpu {

// A contiguous run of elements the caller owns; kernels only borrow it for the call.
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::uint64_t numel = 0;
};

// A read-only run of elements the caller owns.
struct ConstTensorRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::uint64_t numel = 0;

  ConstTensorRef() = default;
  ConstTensorRef(const void* d, DType t, std::uint64_t n) : data(d), dtype(t), numel(n) {}
  // NOLINTNEXTLINE(google-explicit-constructor): a mutable view is also a read-only one.
  ConstTensorRef(const TensorRef& t) : data(t.data), dtype(t.dtype), numel(t.numel) {}
};

// Element kinds the CPU kernels take: fp32, fp16 and bf16. Data must be aligned to its element
// size (4 or 2 bytes); no stronger alignment is needed.
bool is_float_dtype(DType d) noexcept;

// ---------------------------------------------------------------------------------------------
// Kernels

// Copies `src` into `dst` converting the element type (fp32, fp16, bf16 in any direction; the
// same type is a plain copy). Errors: kInvalidArgument for other dtypes, different lengths,
// misaligned or overlapping buffers.
Status convert(ConstTensorRef src, TensorRef dst, int threads = 1);

// Sum of the squares of the elements, accumulated in fp64 (no overflow for any fp32 input).
// Infinite if an element is infinite, NaN if one is NaN.
Result<double> sum_of_squares(ConstTensorRef x, int threads = 1);

// True when any element is an infinity or a NaN (for fp16 loss scaling: skip the step).
Result<bool> has_non_finite(ConstTensorRef x, int threads = 1);

// x *= factor element-wise, in fp32 arithmetic, rounding back to x's dtype. Errors: a non-finite
// factor.
Status scale(TensorRef x, float factor, int threads = 1);

// Random fills from a counter-based generator (Philox4x32-10), on SIMD vectors and `threads`
// threads: what building a model with random weights spends its time on. Element i of x takes
// its value from (seed, stream, i) alone, so a fill gives the same elements for any thread count,
// and a tensor's first k elements are those of any longer tensor's fill with the same seed and
// stream; different streams are independent sequences. fp16/bf16 elements are the fp32 values
// rounded to nearest-even. The bits may differ between SIMD targets (the normal transform's
// logarithm and sine), never between runs on one. Errors: a non-float dtype, a bad range.
//
// Uniform in [low, high) from 24 random bits per element (as PyTorch's CPU uniform_ draws them;
// rounding to fp16/bf16 may give `high`). kInvalidArgument unless low <= high, both finite.
Status fill_uniform(TensorRef x, float low, float high, std::uint64_t seed, std::uint64_t stream, int threads = 1);
// Normal with `mean` and standard deviation `std` by the Box-Muller transform of two 24-bit
// uniforms (|x - mean| < 5.8 std). kInvalidArgument unless both are finite and std >= 0.
Status fill_normal(TensorRef x, float mean, float std, std::uint64_t seed, std::uint64_t stream, int threads = 1);

// The global L2 norm of many tensors, accumulated chunk by chunk, e.g. while gradients stream in
// from another tier. Not thread-safe: one accumulator per thread, or merge() them in a fixed order.
class GradNormAccumulator {
 public:
  // Adds the squares of x's elements.
  Status add(ConstTensorRef x, int threads = 1);
  // Adds another accumulator's sum (for per-thread accumulators combined in a fixed order).
  void merge(const GradNormAccumulator& other) noexcept { sum_ += other.sum_; }
  double sum_of_squares() const noexcept { return sum_; }
  // sqrt(sum of squares); infinite or NaN when a gradient was.
  double norm() const noexcept;
  bool finite() const noexcept;
  void reset() noexcept { sum_ = 0; }

 private:
  double sum_ = 0;
};

// The factor that brings a gradient of `total_norm` down to `max_norm`, as PyTorch's
// clip_grad_norm_ computes it: min(1, max_norm / (total_norm + 1e-6)). 1 when max_norm <= 0
// (clipping off). Pass it to scale() or fold it into AdamStep's grad_scale.
float clip_coefficient(double total_norm, double max_norm) noexcept;

// Clips gradients in place by their global norm: computes the norm over all `count` tensors and
// scales them by clip_coefficient(norm, max_norm) when that is below 1. Returns the norm before
// clipping. A non-finite norm is returned as is and nothing is scaled (the caller skips the step).
Result<double> clip_by_global_norm(const TensorRef* grads, std::size_t count, double max_norm, int threads = 1);

// ---------------------------------------------------------------------------------------------
// SIMD target

// The Highway targets compiled into this binary that this CPU can run, best first, e.g.
// {"AVX3", "AVX2", "SSE4", "SSSE3", "EMU128"}.
std::vector<std::string> simd_targets();
// The target the kernels use now.
std::string simd_target();
// Makes every kernel use `name` (case-insensitive; "avx512" is accepted for "AVX3"), or the best
// target again for "" or "auto". Errors: kUnsupported for a target this binary or CPU lacks (the
// message lists the available ones). The TIER_CPU_SIMD environment variable, read at the first
// kernel call, does the same. Process-wide; not while kernels run.
Status force_simd_target(std::string_view name);

}  // namespace tier::cpu
