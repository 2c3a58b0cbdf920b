// tier/state_codec.hpp — compressed optimizer state: the formats Adam's exp_avg (m) and
// exp_avg_sq (v) can be kept in, their sizes, and the codec that converts fp32 moments to and from
// them (for checkpoints and for changing a run's state dtype). The CPU optimizer (cpu_adam.hpp)
// reads and writes these formats directly, so only the compressed bytes move between tiers.
//
// Three families; m and v always use the same one:
//   fp32  m fp32, v fp32                          8 bytes per element
//   bf16  m bf16, v bf16                          4 bytes per element
//   int8  m int8, v uint8, one fp32 scale each    2 + 8/256 bytes per element
//         per block of kStateBlock = 256 elements
//
// bf16: the fp32 value rounded to nearest-even (exactly what PyTorch's .to(torch.bfloat16) does),
// widened exactly on the way back. Relative error at most 2^-8 for normal values; values whose
// magnitude rounds past the largest bf16 (about 3.3961e38) become infinities, as IEEE rounding
// requires; bf16 denormals are kept (absolute error at most 2^-134 below 2^-126).
//
// int8 (a block floating-point code of our own; block b covers elements [256b, 256b + 256) of the
// range given, the last block may be partial):
//   m: scale = absmax / 1.875 (absmax: the largest |m| of the block). Each element is one int8
//      q in [-127, 127]: sign(q) times a 7-bit magnitude code k = |q| that is a small float with
//      4 exponent bits e = k >> 3 and 3 mantissa bits f = k & 7:
//          value(k) = (1 + f/8) * 2^(e - 15)  for e >= 1,   f * 2^-17  for e = 0 (k < 8),
//      so value(127) = 1.875 and m = sign(q) * value(k) * scale. Encoding rounds |m| / scale to
//      the nearest value(k), ties to the even code. Error bound, per element:
//          |m' - m| <= 2^-4 * |m| * (1 + 2^-20) + 2^-18 * absmax + 2^-149
//      (2^-4: half a step of a 3-bit mantissa; 2^-18 * absmax: half the smallest step, for values
//      below 2^-14 of the scale; 2^-149: fp32's own denormal rounding). -128 is never written; it
//      decodes as -127.
//   v: quantized as s = sqrt(v), which halves its dynamic range in bits: scale = max(s) / 1.9375,
//      each element one uint8 k with 4 exponent bits e = k >> 4 and 4 mantissa bits f = k & 15:
//          value(k) = (1 + f/16) * 2^(e - 15)  for e >= 1,   f * 2^-18  for e = 0 (k < 16),
//      and v = (value(k) * scale)^2. sqrt(v) is what Adam divides by, and its error is bounded:
//          |s' - s| <= 2^-5 * s * (1 + 2^-20) + 2^-18 * max(s) + 2^-75
//      (so v itself within about 6.4% relative over the 2^15 range of sqrt(v) below its block's
//      largest, 2^30 in v; 2^-75 covers fp32's denormal rounding of the decoded v = s'^2). A positive v never encodes
//      to code 0: below the smallest code it is rounded up to code 1, so a small v stays a (slightly too large)
//      positive denominator and never turns m / sqrt(v) into m / eps.
//   Decoded values are held at FLT_MAX (s'^2 or value * scale could round a hair past the block's
//   largest input, and near FLT_MAX into an infinity).
//   A block of zeros has scale 0 and decodes to exact zeros (nothing is divided by the scale).
//   The scale is finite for finite input. In the update, a block holding an infinity or a NaN (an
//   fp16 overflow whose step the caller did not skip) gets a NaN scale: the whole block decodes to
//   NaN, so it is noticed (encode_state refuses such input instead).
//
// Thread safety: pure functions over caller-owned buffers; safe from any thread on disjoint data.
#pragma once

#include <cstdint>
#include <string_view>

#include "tier/cpu_kernels.hpp"
#include "tier/status.hpp"
#include "tier/types.hpp"

namespace tier::cpu {

// Elements per int8 quantization block; one fp32 scale per block of m and one of v.
inline constexpr std::uint64_t kStateBlock = 256;

// The family of a tensor's optimizer state.
enum class StateDType : std::uint8_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

// "fp32", "bf16", "int8".
const char* state_dtype_name(StateDType d) noexcept;
// Accepts "fp32" ("float32", "f32", "float"), "bf16" ("bfloat16"), "int8" ("i8", "q8"),
// case-insensitive. kInvalidArgument otherwise, listing the accepted names.
Result<StateDType> parse_state_dtype(std::string_view text);
// The element dtypes of exp_avg (fp32, bf16, int8) and exp_avg_sq (fp32, bf16, uint8).
DType exp_avg_dtype(StateDType d) noexcept;
DType exp_avg_sq_dtype(StateDType d) noexcept;
// The family of a pair of state dtypes; kInvalidArgument for a mix (e.g. exp_avg bf16 with
// exp_avg_sq fp32, or int8 with int8), naming both.
Result<StateDType> state_dtype_of(DType exp_avg, DType exp_avg_sq);

// Scales per moment for `numel` elements: ceil(numel / 256) for int8, 0 otherwise.
std::uint64_t state_scale_count(StateDType d, std::uint64_t numel) noexcept;
// Exact bytes of m and v together for `numel` elements, scales included.
std::uint64_t state_bytes(StateDType d, std::uint64_t numel) noexcept;
// Bytes of m and v per element, scales amortized: 8, 4 and 2.03125 (not an integer for int8,
// hence a double; use state_bytes() to size buffers).
double state_bytes_per_element(StateDType d) noexcept;

// Which moment a codec call converts: they differ in int8 (m signed, v through sqrt(v)).
enum class StateMoment : std::uint8_t { kExpAvg = 0, kExpAvgSq = 1 };
const char* state_moment_name(StateMoment m) noexcept;  // "exp_avg", "exp_avg_sq"

// Encodes fp32 moments `in` into `out`, whose dtype picks the format: fp32 (a copy), bf16, or
// int8 (exp_avg: DType::kI8, exp_avg_sq: DType::kU8) with ceil(numel / 256) scales written to
// `scales` (which must be null for the other formats). Blocks start at in[0]. Errors
// (kInvalidArgument, naming the argument): a dtype that is not a format of `moment`, different
// lengths, null, misaligned or overlapping buffers, a non-finite element, a negative exp_avg_sq.
Status encode_state(StateMoment moment, ConstTensorRef in, TensorRef out, float* scales, int threads = 1);

// Decodes `in` (fp32, bf16, or int8/uint8 with its scales) into fp32 `out`. Errors as above (no
// check of the values: what was encoded decodes).
Status decode_state(StateMoment moment, ConstTensorRef in, const float* scales, TensorRef out, int threads = 1);

// The int8 codes on their own, one element against a given block scale (scalar, for tests and
// for tools that inspect a checkpoint): the value of code q, in units of the scale, and the
// code of a value x (already divided by the scale; >= 0 for exp_avg_sq, which is sqrt(v) / scale).
float exp_avg_code_value(std::int8_t q) noexcept;
std::int8_t exp_avg_code_of(float x_over_scale) noexcept;
float exp_avg_sq_code_value(std::uint8_t k) noexcept;  // value of sqrt(v) / scale
std::uint8_t exp_avg_sq_code_of(float sqrt_v_over_scale) noexcept;

}  // namespace tier::cpu
