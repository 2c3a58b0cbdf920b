#include "dlpack_convert.hpp"

#include <cstring>
#include <limits>

namespace tier::capi {

Result<DType> from_dl_dtype(DLDataType t) {
  if (t.lanes == 1) {
    switch (t.code) {
      case kDLFloat:
        if (t.bits == 32) return DType::kF32;
        if (t.bits == 16) return DType::kF16;
        if (t.bits == 64) return DType::kF64;
        break;
      case kDLBfloat:
        if (t.bits == 16) return DType::kBF16;
        break;
      case kDLInt:
        if (t.bits == 8) return DType::kI8;
        if (t.bits == 32) return DType::kI32;
        if (t.bits == 64) return DType::kI64;
        break;
      case kDLUInt:
        if (t.bits == 8) return DType::kU8;
        break;
      default: break;
    }
  }
  return invalid_argument(str("dtype {code ", static_cast<int>(t.code), ", bits ", static_cast<int>(t.bits), ", lanes ",
                              t.lanes,
                              "} is not supported; tier holds float16/32/64, bfloat16, int8/32/64 and uint8 "
                              "with lanes 1"));
}

DLDataType to_dl_dtype(DType d) noexcept {
  DLDataType t{};
  t.lanes = 1;
  t.bits = static_cast<std::uint8_t>(dtype_size(d) * 8);
  switch (d) {
    case DType::kF32:
    case DType::kF16:
    case DType::kF64: t.code = kDLFloat; break;
    case DType::kBF16: t.code = kDLBfloat; break;
    case DType::kI8:
    case DType::kI32:
    case DType::kI64: t.code = kDLInt; break;
    case DType::kU8: t.code = kDLUInt; break;
  }
  return t;
}

Shape row_major_strides(const Shape& shape, int ndim) noexcept {
  Shape s{};
  std::int64_t step = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    s[static_cast<std::size_t>(i)] = step;
    step *= shape[static_cast<std::size_t>(i)];
  }
  return s;
}

Result<SourceLayout> inspect_source(const DLTensor& t) {
  SourceLayout l;
  auto dtype = from_dl_dtype(t.dtype);
  if (!dtype.ok()) return dtype.status().with_context("src->dl_tensor.dtype");
  l.dtype = *dtype;
  if (t.ndim < 0 || t.ndim > TIER_MAX_NDIM) {
    return invalid_argument(
        str("src->dl_tensor.ndim is ", t.ndim, "; tier registers tensors of 0 to ", TIER_MAX_NDIM, " dimensions"));
  }
  l.ndim = t.ndim;
  if (t.ndim > 0 && t.shape == nullptr) return invalid_argument("src->dl_tensor.shape is NULL");
  if (t.data == nullptr) return invalid_argument("src->dl_tensor.data is NULL");
  const std::uint64_t esize = dtype_size(l.dtype);
  const std::uint64_t max_numel = (std::numeric_limits<std::uint64_t>::max() >> 1) / esize;
  std::uint64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) {
    const std::int64_t n = t.shape[i];
    if (n < 0) return invalid_argument(str("src->dl_tensor.shape[", i, "] is ", n));
    l.shape[static_cast<std::size_t>(i)] = n;
    if (n != 0 && numel > max_numel / static_cast<std::uint64_t>(n)) {
      return invalid_argument("src->dl_tensor.shape: the tensor has more bytes than fit in 63 bits");
    }
    numel *= static_cast<std::uint64_t>(n);
  }
  if (numel == 0) {
    return invalid_argument(
        "src->dl_tensor.shape: the tensor has no elements; tier registers tensors with at least one");
  }
  l.numel = numel;
  l.bytes = numel * esize;
  if (t.strides != nullptr) {
    const Shape want = row_major_strides(l.shape, l.ndim);
    for (int i = 0; i < t.ndim; ++i) {
      // The stride of a dimension of extent 1 never matters.
      if (l.shape[static_cast<std::size_t>(i)] != 1 && t.strides[i] != want[static_cast<std::size_t>(i)]) {
        l.compact = false;
      }
    }
  }
  l.base = static_cast<const std::uint8_t*>(t.data) + t.byte_offset;
  return l;
}

void gather_row_major(const DLTensor& t, const SourceLayout& l, void* dst) noexcept {
  auto* out = static_cast<std::uint8_t*>(dst);
  if (l.compact || t.strides == nullptr) {
    std::memcpy(out, l.base, l.bytes);
    return;
  }
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(l.dtype));
  const int last = l.ndim - 1;  // ndim >= 1 here: a 0-d tensor is always compact
  const std::int64_t inner = l.shape[static_cast<std::size_t>(last)];
  const std::int64_t inner_stride = t.strides[last];
  std::array<std::int64_t, TIER_MAX_NDIM> index{};
  for (;;) {
    std::int64_t offset = 0;  // in elements, of index[0..last-1] with index[last] = 0
    for (int i = 0; i < last; ++i) offset += index[static_cast<std::size_t>(i)] * t.strides[i];
    const std::uint8_t* row = l.base + offset * esize;
    if (inner_stride == 1) {
      std::memcpy(out, row, static_cast<std::size_t>(inner * esize));
      out += inner * esize;
    } else {
      for (std::int64_t j = 0; j < inner; ++j) {
        std::memcpy(out, row + j * inner_stride * esize, static_cast<std::size_t>(esize));
        out += esize;
      }
    }
    int d = last - 1;
    for (; d >= 0; --d) {
      if (++index[static_cast<std::size_t>(d)] < l.shape[static_cast<std::size_t>(d)]) break;
      index[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace tier::capi
