// Internal: conversions between DLPack tensors and tier's tensor descriptors — dtypes, the layout
// of a source tensor, and the row-major gather of a strided host tensor.
//
// Thread safety: pure functions over their arguments.
#pragma once

#include <dlpack/dlpack.h>

#include <array>
#include <cstdint>

#include "tier/status.hpp"
#include "tier/tier.h"
#include "tier/types.hpp"

namespace tier::capi {

using Shape = std::array<std::int64_t, TIER_MAX_NDIM>;

// tier's dtype for a DLPack dtype; kInvalidArgument naming the dtype and the accepted ones.
Result<DType> from_dl_dtype(DLDataType t);
DLDataType to_dl_dtype(DType d) noexcept;

// A checked source tensor: what tier registers and how its elements are laid out.
struct SourceLayout {
  DType dtype = DType::kF32;
  int ndim = 0;
  Shape shape{};
  std::uint64_t numel = 0;
  std::uint64_t bytes = 0;
  bool compact = true;                 // row-major contiguous: strides NULL or equal to the row-major ones
  const std::uint8_t* base = nullptr;  // data + byte_offset
};

// Checks dtype, ndim, shape and data of `t` (not its device). Errors are kInvalidArgument naming
// the field ("src->dl_tensor.shape[1] is -2").
Result<SourceLayout> inspect_source(const DLTensor& t);

// Copies every element of a host-addressable tensor into `dst` (layout.bytes bytes) in row-major
// order, following t.strides (any sign, zero included).
void gather_row_major(const DLTensor& t, const SourceLayout& layout, void* dst) noexcept;

// Row-major strides (in elements) of the first `ndim` entries of `shape`.
Shape row_major_strides(const Shape& shape, int ndim) noexcept;

}  // namespace tier::capi
