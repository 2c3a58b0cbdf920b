// Internal: gradient intake kernels. One pass adds a micro-step's gradient (fp32, fp16 or bf16)
// into the partition's fp32 accumulator and, on the final micro-step, also returns the sum of
// squares of the result, so the global norm is known without reading the gradients again.
//
// The sum is computed with exactly cpu::sum_of_squares' blocking (fixed 64 Ki-element blocks,
// the same vector accumulators in the same order, blocks combined in order), so it equals
// cpu::sum_of_squares of the accumulated gradient bit for bit on the same SIMD target.
#pragma once

#include <cstdint>

#include "tier/cpu_kernels.hpp"
#include "tier/status.hpp"

namespace tier::optim::detail {

class Workers;

// acc[i] = g[i] (first) or acc[i] + g[i] in fp32, for every element of g. With `sumsq`, stores
// the fp64 sum of squares of the resulting acc there. `workers` may be null (calling thread).
Status accumulate_grad(float* acc, cpu::ConstTensorRef g, bool first, double* sumsq, const Workers* workers);

// A gradient kept in its own dtype (fp32, bf16 or fp16): dst = g, element for element, and the
// fp64 sum of squares of it, block by block while the block is still in cache (so host memory is
// crossed once, not once for the copy and again for the norm). The sum equals
// cpu::sum_of_squares(g) bit for bit. `dst` must not overlap g.
Result<double> copy_grad(void* dst, cpu::ConstTensorRef g, const Workers* workers);

// cpu::sum_of_squares on the workers' threads (the same value for any thread count).
Result<double> sum_of_squares(cpu::ConstTensorRef x, const Workers* workers);

}  // namespace tier::optim::detail
