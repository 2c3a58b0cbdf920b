// libFuzzer target: tensor import through the C ABI (tier_tensor_register with a DLPack tensor).
// The input gives dtype, ndim, shape, strides (or none) and byte_offset over a fixed host buffer.
// The harness works out on its own, in 128-bit arithmetic, which bytes the layout addresses:
//  - inside the buffer: the register must succeed (or find the budget too small), and reading the
//    tensor back must give the elements gathered here;
//  - beyond 2^56 bytes or outside the address space: it must fail with TIER_ERROR_INVALID_ARGUMENT
//    without touching memory;
//  - anywhere else (a real layout over memory this harness does not own): not registered.
// Every tensor's deleter must run exactly once.
#include <dlpack/dlpack.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tier/tier.h"

namespace {

constexpr std::size_t kBufferBytes = 1 << 16;
constexpr __int128 kMaxSpan = static_cast<__int128>(1) << 56;

tier_engine_t* g_engine = nullptr;
std::uint8_t* g_buffer = nullptr;
int g_deleted = 0;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_c_api_tensor: %s (last error: %s)\n", what, tier_last_error());
  std::abort();
}

// Reads the input front to back; past its end every value is 0.
struct Input {
  const std::uint8_t* p;
  std::size_t n;
  template <class T>
  T take() {
    T v{};
    const std::size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};

void deleter(DLManagedTensor*) {
  ++g_deleted;
}

int element_size(DLDataType t) {
  if (t.lanes != 1) return 0;
  switch (t.code) {
    case kDLFloat: return t.bits == 16 || t.bits == 32 || t.bits == 64 ? t.bits / 8 : 0;
    case kDLBfloat: return t.bits == 16 ? 2 : 0;
    case kDLInt: return t.bits == 8 || t.bits == 32 || t.bits == 64 ? t.bits / 8 : 0;
    case kDLUInt: return t.bits == 8 ? 1 : 0;
    default: return 0;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  static std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/tier-fuzz-c-api-" + std::to_string(::getpid());
  const std::string json =
      "{\"tier\": {\"device\": \"emulated\", \"budgets\": {\"device\": 1048576, \"host\": 4194304, \"nvme\": 0},"
      " \"swap_paths\": [\"" +
      dir + "\"], \"huge_pages\": \"off\", \"log_level\": \"off\"}}";
  tier_engine_config_t config = TIER_ENGINE_CONFIG_INIT;
  config.json = json.c_str();
  config.ignore_env = 1;
  if (tier_engine_create(&config, &g_engine) != TIER_OK) fail("engine");
  g_buffer = static_cast<std::uint8_t*>(std::aligned_alloc(64, kBufferBytes));
  for (std::size_t i = 0; i < kBufferBytes; ++i) g_buffer[i] = static_cast<std::uint8_t>(i * 131 + 7);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  const std::uint8_t flags = in.take<std::uint8_t>();
  DLManagedTensor m{};
  std::int64_t shape[TIER_MAX_NDIM + 2] = {};
  std::int64_t strides[TIER_MAX_NDIM + 2] = {};
  m.dl_tensor.dtype.code = in.take<std::uint8_t>() % 8;
  m.dl_tensor.dtype.bits = in.take<std::uint8_t>();
  m.dl_tensor.dtype.lanes = (flags & 2) ? in.take<std::uint16_t>() : 1;
  m.dl_tensor.ndim = in.take<std::uint8_t>() % (TIER_MAX_NDIM + 2);
  // Small extents usually, any value sometimes.
  for (int i = 0; i < m.dl_tensor.ndim; ++i) {
    const std::uint8_t how = in.take<std::uint8_t>();
    shape[i] = how & 0x80 ? in.take<std::int64_t>() : how % 9;
    strides[i] = how & 0x40 ? in.take<std::int64_t>() : static_cast<std::int8_t>(in.take<std::uint8_t>());
  }
  const std::uint8_t offset_how = in.take<std::uint8_t>();
  m.dl_tensor.byte_offset = offset_how & 0x80 ? in.take<std::uint64_t>() : in.take<std::uint16_t>() % kBufferBytes;
  m.dl_tensor.data = g_buffer;
  m.dl_tensor.device = {kDLCPU, 0};
  m.dl_tensor.shape = shape;
  m.dl_tensor.strides = (flags & 1) ? strides : nullptr;
  m.deleter = deleter;

  // The harness's own reading of the layout.
  const int esize = element_size(m.dl_tensor.dtype);
  const int ndim = m.dl_tensor.ndim;
  bool malformed = esize == 0 || ndim > TIER_MAX_NDIM;
  __int128 numel = 1;
  __int128 lo = 0, hi = esize;
  std::int64_t row_major[TIER_MAX_NDIM + 2] = {};
  for (int i = 0; i < ndim && !malformed; ++i) {
    if (shape[i] < 0) malformed = true;
    numel *= shape[i];
    if (numel * esize > INT64_MAX) malformed = true;
  }
  if (numel == 0) malformed = true;
  bool beyond = false;  // addresses more than any buffer can hold
  if (!malformed) {
    if (m.dl_tensor.strides == nullptr) {
      __int128 s = 1;
      for (int i = ndim - 1; i >= 0; --i) {
        row_major[i] = static_cast<std::int64_t>(s);
        s *= shape[i];
      }
    }
    const std::int64_t* st = m.dl_tensor.strides ? strides : row_major;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] == 1) continue;
      const __int128 reach = static_cast<__int128>(st[i]) * (shape[i] - 1) * esize;
      (reach < 0 ? lo : hi) += reach;
    }
    beyond = hi - lo > kMaxSpan || m.dl_tensor.byte_offset > static_cast<std::uint64_t>(kMaxSpan);
  }
  const __int128 first = static_cast<__int128>(m.dl_tensor.byte_offset) + lo;
  const __int128 end = static_cast<__int128>(m.dl_tensor.byte_offset) + hi;
  const bool inside = !malformed && !beyond && first >= 0 && end <= static_cast<__int128>(kBufferBytes);
  if (!malformed && !beyond && !inside) return 0;  // a real layout over memory we do not own

  tier_tensor_t t{};
  const int deleted_before = g_deleted;
  const tier_status_t s = tier_tensor_register(g_engine, "fuzzed", &m, nullptr, &t);
  if (g_deleted != deleted_before + 1) fail("the deleter did not run exactly once");
  if (malformed || beyond) {
    if (s != TIER_ERROR_INVALID_ARGUMENT) fail("a malformed or impossible layout was not refused as invalid");
    return 0;
  }
  if (s == TIER_ERROR_RESOURCE_EXHAUSTED) return 0;  // more bytes than the budgets (broadcast strides)
  if (s != TIER_OK) fail("a layout inside the buffer was refused");
  const std::size_t bytes = static_cast<std::size_t>(numel * esize);
  std::vector<std::uint8_t> back(bytes), want(bytes);
  if (tier_tensor_read(g_engine, t, back.data(), bytes) != TIER_OK) fail("read back");
  // Gather the elements in row-major order the slow, obvious way.
  const std::int64_t* st = m.dl_tensor.strides ? strides : row_major;
  std::int64_t index[TIER_MAX_NDIM + 2] = {};
  for (std::size_t e = 0; e < static_cast<std::size_t>(numel); ++e) {
    __int128 at = m.dl_tensor.byte_offset;
    for (int i = 0; i < ndim; ++i) at += static_cast<__int128>(index[i]) * st[i] * esize;
    std::memcpy(want.data() + e * esize, g_buffer + static_cast<std::size_t>(at), esize);
    for (int i = ndim - 1; i >= 0; --i) {
      if (++index[i] < shape[i]) break;
      index[i] = 0;
    }
  }
  if (back != want) fail("the registered tensor does not hold the source's elements");
  if (tier_tensor_unregister(g_engine, t) != TIER_OK) fail("unregister");
  return 0;
}
