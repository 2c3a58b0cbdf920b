#include "dlpack_convert.hpp"

#include <algorithm>
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

namespace {
// No host or device buffer is larger than this: user address spaces are at most 2^56 bytes (57-bit
// virtual addresses with 5-level paging), so a tensor whose elements span more is not real.
constexpr std::int64_t kMaxSpanBytes = std::int64_t{1} << 56;
}  // namespace

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
  const std::int64_t esize = static_cast<std::int64_t>(dtype_size(l.dtype));
  // Element count and byte size, overflow-checked: the bytes must fit in an int64.
  std::int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) {
    const std::int64_t n = t.shape[i];
    if (n < 0) return invalid_argument(str("src->dl_tensor.shape[", i, "] is ", n));
    l.shape[static_cast<std::size_t>(i)] = n;
    std::int64_t bytes = 0;
    if (__builtin_mul_overflow(numel, n, &numel) || __builtin_mul_overflow(numel, esize, &bytes)) {
      return invalid_argument(str("src->dl_tensor.shape[", i, "] is ", n,
                                  ": the tensor's byte size overflows 63 bits; pass the tensor's real shape"));
    }
  }
  if (numel == 0) {
    return invalid_argument(
        "src->dl_tensor.shape: the tensor has no elements; tier registers tensors with at least one");
  }
  l.numel = static_cast<std::uint64_t>(numel);
  l.bytes = static_cast<std::uint64_t>(numel * esize);

  // The bytes the elements span, relative to data + byte_offset: [lo, hi). Every product and sum
  // is checked, and the span must fit in an address space, so that a stride of 2^60 elements (past
  // any buffer) or 2^62 (whose byte offset wraps to 0) is refused instead of read.
  std::int64_t lo = 0;
  std::int64_t hi = esize;
  if (t.strides != nullptr) {
    const Shape want = row_major_strides(l.shape, l.ndim);
    for (int i = 0; i < t.ndim; ++i) {
      const std::int64_t n = l.shape[static_cast<std::size_t>(i)];
      // The stride of a dimension of extent 1 never matters.
      if (n == 1) continue;
      const std::int64_t stride = t.strides[i];
      if (stride != want[static_cast<std::size_t>(i)]) l.compact = false;
      std::int64_t reach = 0;  // bytes from the first to the last element along dimension i
      bool overflow = __builtin_mul_overflow(stride, n - 1, &reach) || __builtin_mul_overflow(reach, esize, &reach);
      std::int64_t span = 0;
      if (!overflow) {
        std::int64_t& grown = reach < 0 ? lo : hi;
        overflow = __builtin_add_overflow(grown, reach, &grown) || __builtin_sub_overflow(hi, lo, &span);
      }
      if (overflow || span > kMaxSpanBytes) {
        return invalid_argument(str("src->dl_tensor.strides[", i, "] is ", stride, " with shape[", i, "] ", n,
                                    ": the elements would span more than 2^56 bytes, past any buffer; pass the "
                                    "tensor's real strides (in elements, not bytes)"));
      }
    }
  } else if (l.bytes > static_cast<std::uint64_t>(kMaxSpanBytes)) {
    return invalid_argument(
        str("src->dl_tensor.shape: the tensor's ", l.bytes, " bytes are more than 2^56, past any buffer"));
  }
  // The addresses [data + byte_offset + lo, data + byte_offset + hi) must not wrap around.
  const auto data = reinterpret_cast<std::uintptr_t>(t.data);
  std::uintptr_t base = 0;
  std::uintptr_t end = 0;
  if (t.byte_offset > static_cast<std::uint64_t>(kMaxSpanBytes) ||
      __builtin_add_overflow(data, static_cast<std::uintptr_t>(t.byte_offset), &base) ||
      (lo < 0 && base < static_cast<std::uintptr_t>(-lo)) ||
      __builtin_add_overflow(base, static_cast<std::uintptr_t>(hi), &end)) {
    return invalid_argument(str("src->dl_tensor.byte_offset is ", t.byte_offset,
                                ": with the strides it addresses memory outside the address space; pass the "
                                "tensor's real byte_offset"));
  }
  l.base = static_cast<const std::uint8_t*>(t.data) + t.byte_offset;
  return l;
}

namespace {

// Copies one R x C plane whose elements sit at src + (i * sr + j * sc) * sizeof(T) into dst in
// row-major order. With a unit column stride rows are contiguous runs; otherwise the plane goes in
// square tiles, so a transposed source is read a few cache lines at a time instead of one element
// per line.
template <class T>
void gather_plane(const std::uint8_t* src, std::int64_t rows, std::int64_t cols, std::int64_t sr, std::int64_t sc,
                  std::uint8_t* dst) noexcept {
  auto* out = reinterpret_cast<T*>(dst);
  if (sc == 1) {
    for (std::int64_t i = 0; i < rows; ++i) {
      std::memcpy(out + i * cols, src + i * sr * static_cast<std::int64_t>(sizeof(T)),
                  static_cast<std::size_t>(cols) * sizeof(T));
    }
    return;
  }
  constexpr std::int64_t kTile = 16;  // measured best of 8..64 for a 4096x4096 fp32 transpose
  for (std::int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const std::int64_t i1 = std::min(rows, i0 + kTile);
    for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const std::int64_t j1 = std::min(cols, j0 + kTile);
      for (std::int64_t i = i0; i < i1; ++i) {
        const std::uint8_t* row = src + i * sr * static_cast<std::int64_t>(sizeof(T));
        for (std::int64_t j = j0; j < j1; ++j) {
          T v;
          std::memcpy(&v, row + j * sc * static_cast<std::int64_t>(sizeof(T)), sizeof(T));
          out[i * cols + j] = v;
        }
      }
    }
  }
}

void gather_plane(std::size_t esize, const std::uint8_t* src, std::int64_t rows, std::int64_t cols, std::int64_t sr,
                  std::int64_t sc, std::uint8_t* dst) noexcept {
  switch (esize) {
    case 1: return gather_plane<std::uint8_t>(src, rows, cols, sr, sc, dst);
    case 2: return gather_plane<std::uint16_t>(src, rows, cols, sr, sc, dst);
    case 4: return gather_plane<std::uint32_t>(src, rows, cols, sr, sc, dst);
    default: return gather_plane<std::uint64_t>(src, rows, cols, sr, sc, dst);
  }
}

}  // namespace

void gather_row_major(const DLTensor& t, const SourceLayout& l, void* dst) noexcept {
  auto* out = static_cast<std::uint8_t*>(dst);
  if (l.compact || t.strides == nullptr) {
    std::memcpy(out, l.base, l.bytes);
    return;
  }
  const std::size_t esize = dtype_size(l.dtype);
  // The last two dimensions form planes (a 1-d tensor is one plane of one row); the dimensions
  // before them are walked like an odometer.
  const int nd = l.ndim;  // >= 1 here: a 0-d tensor is always compact
  const std::int64_t rows = nd >= 2 ? l.shape[static_cast<std::size_t>(nd - 2)] : 1;
  const std::int64_t cols = l.shape[static_cast<std::size_t>(nd - 1)];
  const std::int64_t sr = nd >= 2 ? t.strides[nd - 2] : 0;
  const std::int64_t sc = t.strides[nd - 1];
  const int outer = std::max(nd - 2, 0);
  const std::size_t plane_bytes = static_cast<std::size_t>(rows * cols) * esize;
  std::array<std::int64_t, TIER_MAX_NDIM> index{};
  for (;;) {
    std::int64_t offset = 0;  // in elements
    for (int i = 0; i < outer; ++i) offset += index[static_cast<std::size_t>(i)] * t.strides[i];
    gather_plane(esize, l.base + offset * static_cast<std::int64_t>(esize), rows, cols, sr, sc, out);
    out += plane_bytes;
    int d = outer - 1;
    for (; d >= 0; --d) {
      if (++index[static_cast<std::size_t>(d)] < l.shape[static_cast<std::size_t>(d)]) break;
      index[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace tier::capi
