// The C ABI (include/tier/tier.h) over tier::Engine. Every entry point validates its arguments,
// runs its body inside guarded(), which turns a Status into a code plus the thread's last error and
// catches every C++ exception, and never lets one out.
#include "tier/tier.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda_copy.hpp"
#include "dlpack_convert.hpp"
#include "engine_core.hpp"
#include "tier/comm.hpp"
#include "tier/config.hpp"
#include "tier/cpu_kernels.hpp"
#include "tier/ext/device.hpp"
#include "tier/engine.hpp"
#include "tier/engine_step_io.hpp"
#include "tier/log.hpp"
#include "tier/step_driver.hpp"

using tier::Access;
using tier::DType;
using tier::Engine;
using tier::Lease;
using tier::Result;
using tier::Role;
using tier::Status;
using tier::StatusCode;
using tier::str;
using tier::TensorId;
using tier::Tier;
using tier::capi::EngineCore;
using tier::capi::ExportedTensor;
using tier::capi::TensorMeta;

// The codes mirror tier::StatusCode value for value.
static_assert(TIER_OK == static_cast<int>(StatusCode::kOk));
static_assert(TIER_ERROR_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(TIER_ERROR_NOT_FOUND == static_cast<int>(StatusCode::kNotFound));
static_assert(TIER_ERROR_ALREADY_EXISTS == static_cast<int>(StatusCode::kAlreadyExists));
static_assert(TIER_ERROR_OUT_OF_RANGE == static_cast<int>(StatusCode::kOutOfRange));
static_assert(TIER_ERROR_RESOURCE_EXHAUSTED == static_cast<int>(StatusCode::kResourceExhausted));
static_assert(TIER_ERROR_TIMED_OUT == static_cast<int>(StatusCode::kTimedOut));
static_assert(TIER_ERROR_CANCELLED == static_cast<int>(StatusCode::kCancelled));
static_assert(TIER_ERROR_IO == static_cast<int>(StatusCode::kIoError));
static_assert(TIER_ERROR_NO_SPACE == static_cast<int>(StatusCode::kNoSpace));
static_assert(TIER_ERROR_UNSUPPORTED == static_cast<int>(StatusCode::kUnsupported));
static_assert(TIER_ERROR_FAILED_PRECONDITION == static_cast<int>(StatusCode::kFailedPrecondition));
static_assert(TIER_ERROR_DATA_LOSS == static_cast<int>(StatusCode::kDataLoss));
static_assert(TIER_ERROR_DEVICE == static_cast<int>(StatusCode::kDeviceError));
static_assert(TIER_ERROR_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(TIER_TIER_DEVICE == static_cast<int>(Tier::kDevice) && TIER_TIER_HOST == static_cast<int>(Tier::kHost) &&
              TIER_TIER_NVME == static_cast<int>(Tier::kNvme) && TIER_NUM_TIERS == tier::kNumTiers);
static_assert(TIER_ACCESS_READ == static_cast<int>(Access::kRead) &&
              TIER_ACCESS_WRITE == static_cast<int>(Access::kWrite) &&
              TIER_ACCESS_READ_WRITE == static_cast<int>(Access::kReadWrite));
static_assert(TIER_ROLE_PARAM == static_cast<int>(Role::kParam) && TIER_ROLE_USER == static_cast<int>(Role::kUser) &&
              TIER_ROLE_ACTIVATION == static_cast<int>(Role::kActivation) &&
              TIER_ROLE_ACTIVATION + 1 == tier::kNumRoles);
static_assert(TIER_DTYPE_F32 == static_cast<int>(DType::kF32) && TIER_DTYPE_F16 == static_cast<int>(DType::kF16) &&
              TIER_DTYPE_BF16 == static_cast<int>(DType::kBF16) && TIER_DTYPE_F64 == static_cast<int>(DType::kF64) &&
              TIER_DTYPE_I8 == static_cast<int>(DType::kI8) && TIER_DTYPE_U8 == static_cast<int>(DType::kU8) &&
              TIER_DTYPE_I32 == static_cast<int>(DType::kI32) && TIER_DTYPE_I64 == static_cast<int>(DType::kI64) &&
              TIER_DTYPE_I64 + 1 == tier::kNumDTypes);
static_assert(TIER_REDUCE_SUM == static_cast<int>(tier::ReduceOp::kSum) &&
              TIER_REDUCE_MAX == static_cast<int>(tier::ReduceOp::kMax) &&
              TIER_REDUCE_MIN == static_cast<int>(tier::ReduceOp::kMin));
static_assert(TIER_COMM_MEMORY_HOST == tier::kCommHostMemory && TIER_COMM_MEMORY_DEVICE == tier::kCommDeviceMemory);
static_assert(TIER_COMM_UNIQUE_ID_BYTES == sizeof(tier::NcclUniqueId::bytes));
// The header's version is the project's (CMake passes PROJECT_VERSION in).
static_assert(TIER_VERSION_MAJOR == TIER_PROJECT_VERSION_MAJOR && TIER_VERSION_MINOR == TIER_PROJECT_VERSION_MINOR &&
                  TIER_VERSION_PATCH == TIER_PROJECT_VERSION_PATCH,
              "include/tier/tier.h: TIER_VERSION_* differ from project(tier VERSION ...) in CMakeLists.txt");

namespace {

// The size of version 1 of each versioned struct: the smallest struct_size ever valid. A later
// version appends fields and keeps these numbers.
constexpr std::size_t kEngineConfigV1 = sizeof(tier_engine_config_t);
constexpr std::size_t kTensorOptionsV1 = sizeof(tier_tensor_options_t);
constexpr std::size_t kTensorInfoV1 = sizeof(tier_tensor_info_t);
constexpr std::size_t kCommCallbacksV1 = sizeof(tier_comm_callbacks_t);
constexpr std::size_t kCommNcclConfigV1 = sizeof(tier_comm_nccl_config_t);
constexpr std::size_t kOptimizerConfigV1 = offsetof(tier_optimizer_config_t, engine);
constexpr std::size_t kParamGroupV1 = sizeof(tier_param_group_t);
constexpr std::size_t kStepOptionsV1 = offsetof(tier_step_options_t, skip_missing);
constexpr std::size_t kStepReportV1 = offsetof(tier_step_report_t, overlapped);

// ---- errors

thread_local std::string t_last_error;

// Records the message of a failed call; never throws (an allocation failure keeps a short text).
tier_status_t fail(const char* fn, tier_status_t code, const char* message) noexcept {
  try {
    t_last_error.assign(fn).append(": ").append(tier_status_string(code)).append(": ").append(message);
  } catch (...) {
    t_last_error.clear();  // noexcept; then the short text fits the string's own storage
    t_last_error.append("out of memory");
  }
  return code;
}

tier_status_t fail(const char* fn, const Status& s) noexcept {
  try {
    t_last_error = str(fn, ": ", s.to_string());
  } catch (...) {
    t_last_error.clear();
    t_last_error.append("out of memory");
  }
  return static_cast<tier_status_t>(s.code());
}

// Runs an entry point's body: a Status becomes a code plus the last error, an exception becomes
// TIER_ERROR_RESOURCE_EXHAUSTED (allocation) or TIER_ERROR_INTERNAL. Nothing escapes.
template <class F>
tier_status_t guarded(const char* fn, F&& body) noexcept {
  try {
    Status s = body();
    return s.ok() ? TIER_OK : fail(fn, s);
  } catch (const std::bad_alloc&) {
    return fail(fn, TIER_ERROR_RESOURCE_EXHAUSTED, "out of host memory");
  } catch (const std::exception& e) {
    try {
      return fail(fn, TIER_ERROR_INTERNAL, str("unexpected C++ exception: ", e.what()).c_str());
    } catch (...) {
      return fail(fn, TIER_ERROR_INTERNAL, "unexpected C++ exception");
    }
  } catch (...) {
    return fail(fn, TIER_ERROR_INTERNAL, "unexpected exception of unknown type");
  }
}

Status null_argument(const char* name) {
  return tier::invalid_argument(str("argument '", name, "' is NULL"));
}

#define TIER_C_REQUIRE(arg) \
  if ((arg) == nullptr) return null_argument(#arg)

// Reads a size-versioned input struct: the fields the caller's version has, defaults for the rest;
// a larger struct (a newer header) is accepted when the fields this library does not know are 0.
template <class T>
Result<T> read_versioned(const T* in, T defaults, std::size_t v1_size, const char* arg, const char* type,
                         const char* init) {
  std::size_t size = 0;
  std::memcpy(&size, in, sizeof size);
  if (size < v1_size) {
    return tier::invalid_argument(str(arg, "->struct_size is ", size, "; set it to sizeof(", type, ") (", sizeof(T),
                                      " in this library), best with ", init));
  }
  if (size > sizeof(T)) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(in);
    for (std::size_t i = sizeof(T); i < size; ++i) {
      if (bytes[i] != 0) {
        return tier::invalid_argument(str(arg, "->struct_size is ", size, " but this library's ", type, " has ",
                                          sizeof(T),
                                          " bytes, and the fields it does not know are set; use the "
                                          "libtier that matches your tier.h"));
      }
    }
  }
  T out = defaults;
  std::memcpy(static_cast<void*>(&out), in, std::min(size, sizeof(T)));
  return out;
}

// Checks an output struct's struct_size; returns how many bytes to write (the caller's version's).
template <class T>
Result<std::size_t> output_size(const T* out, std::size_t v1_size, const char* arg, const char* type,
                                const char* init) {
  std::size_t size = 0;
  std::memcpy(&size, out, sizeof size);
  if (size < v1_size) {
    return tier::invalid_argument(str(arg, "->struct_size is ", size, "; set it to sizeof(", type,
                                      ") before the "
                                      "call, best with ",
                                      init));
  }
  return std::min(size, sizeof(T));
}

// The integer in a C enum object. C callers may store any int there; in C++ loading an enum
// outside its values' range is undefined (UBSan's -fsanitize=enum flags it), so read the bytes.
template <class E>
int enum_value(const E& e) noexcept {
  static_assert(std::is_enum_v<E> && sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

Status check_tier(int v, const char* arg) {
  if (v < 0 || v >= tier::kNumTiers) {
    return tier::invalid_argument(
        str("argument '", arg, "' is ", v, "; use TIER_TIER_DEVICE (0), TIER_TIER_HOST (1) or TIER_TIER_NVME (2)"));
  }
  return Status::Ok();
}

Status check_role(int v, const char* arg) {
  if (v < 0 || v >= tier::kNumRoles) {
    return tier::invalid_argument(
        str("argument '", arg, "' is ", v, "; use one of TIER_ROLE_* (0 to ", tier::kNumRoles - 1, ")"));
  }
  return Status::Ok();
}

EngineCore& core_of(tier_engine_t* engine) {
  return *engine->core;
}

// Copies `text` into malloc'ed storage the caller frees with tier_string_free.
Status hand_out_string(const std::string& text, char** out) {
  char* p = static_cast<char*>(std::malloc(text.size() + 1));
  if (p == nullptr) return tier::resource_exhausted(str("out of host memory for a ", text.size(), "-byte string"));
  std::memcpy(p, text.c_str(), text.size() + 1);
  *out = p;
  return Status::Ok();
}

// ---- the producer's tensor given to tier_tensor_register

// Calls the producer's deleter exactly once: finish() reports a throwing deleter, the destructor
// covers every path that did not reach finish().
class ProducerTensor {
 public:
  explicit ProducerTensor(DLManagedTensor* t) noexcept : t_(t) {}
  ~ProducerTensor() {
    try {
      finish().ignore();
    } catch (...) {
    }
  }
  ProducerTensor(const ProducerTensor&) = delete;
  ProducerTensor& operator=(const ProducerTensor&) = delete;

  Status finish() noexcept {
    DLManagedTensor* t = t_;
    t_ = nullptr;
    if (t == nullptr || t->deleter == nullptr) return Status::Ok();
    try {
      t->deleter(t);
      return Status::Ok();
    } catch (...) {
      return Status(StatusCode::kInternal, "the source tensor's DLPack deleter threw a C++ exception");
    }
  }

 private:
  DLManagedTensor* t_;
};

// Where a source tensor's bytes can be read from.
enum class SourceKind { kHost, kHostAfterStream, kCuda };

Result<SourceKind> source_kind(const DLDevice& d) {
  const int type = enum_value(d.device_type);
  switch (type) {
    case kDLCPU: return SourceKind::kHost;
    case kDLCUDAHost:
    case kDLCUDAManaged: return SourceKind::kHostAfterStream;
    case kDLCUDA: return SourceKind::kCuda;
    default: break;
  }
  return tier::unsupported(str("src->dl_tensor.device.device_type is ", type,
                               "; tier registers tensors from kDLCPU (1), kDLCUDA (2), kDLCUDAHost (3) and "
                               "kDLCUDAManaged (13) memory"));
}

// Registers `src` with the engine and copies its contents in; returns the engine's id.
Result<TensorId> register_source(Engine& e, const char* name, const DLTensor& src,
                                 const tier::capi::SourceLayout& layout, const tier_tensor_options_t& opt) {
  TIER_ASSIGN_OR_RETURN(SourceKind kind, source_kind(src.device));
  if (kind == SourceKind::kCuda && !layout.compact) {
    return tier::unsupported(
        "src: a CUDA tensor must be compact row-major (strides NULL or row-major); make it contiguous first");
  }
  const tier::TensorDesc desc{name, layout.dtype, layout.numel, static_cast<Role>(opt.role), opt.group};
  TIER_RETURN_IF_ERROR(desc.validate());
  const Tier home = static_cast<Tier>(opt.home);
  if (kind == SourceKind::kHostAfterStream) {
    TIER_RETURN_IF_ERROR(tier::capi::sync_cuda_stream(static_cast<int>(src.device.device_id), opt.stream));
  }
  if (kind != SourceKind::kCuda && layout.compact) return e.register_tensor(desc, home, layout.base);

  // Strided or CUDA source: register, then fill the host copy through a write lease (gathering the
  // elements, or one copy from the GPU straight into pinned memory), then make the home copy hold it.
  TIER_ASSIGN_OR_RETURN(TensorId id, e.register_tensor(desc, home, nullptr));
  Status filled = [&]() -> Status {
    TIER_ASSIGN_OR_RETURN(Lease lease, e.acquire_now(id, Tier::kHost, Access::kWrite));
    if (kind == SourceKind::kCuda) {
      TIER_RETURN_IF_ERROR(
          tier::capi::copy_from_cuda(lease.data(), layout.base, layout.bytes, src.device.device_id, opt.stream));
    } else {
      tier::capi::gather_row_major(src, layout, lease.data());
    }
    TIER_RETURN_IF_ERROR(lease.release());
    if (home != Tier::kHost) {
      TIER_ASSIGN_OR_RETURN(Lease at_home, e.acquire_now(id, home, Access::kRead));
      TIER_RETURN_IF_ERROR(at_home.release());
    }
    return Status::Ok();
  }();
  if (!filled.ok()) {
    // Leases are released by now (they end with their scope), so the tensor is idle.
    e.unregister_tensor(id).ignore();
    return filled.with_context(str("register '", name, "'"));
  }
  return id;
}

// ---- DLPack tensors handed out by tickets

void exported_deleter(DLManagedTensor* self) noexcept {
  if (self == nullptr) return;
  std::unique_ptr<ExportedTensor> ctx(static_cast<ExportedTensor*>(self->manager_ctx));
  try {
    std::shared_ptr<EngineCore> core = std::move(ctx->core);
    core->release_after(std::move(ctx->lease), ctx->stream);
    ctx.reset();
    core.reset();  // may be the last reference: the engine goes here, on the consumer's thread
  } catch (...) {
    // release_after does not throw; destroying the engine does not either. Nothing escapes.
  }
}

DLDevice device_of(Engine& e, Tier where, const void* data, std::uint64_t bytes) {
  tier::Device& d = e.device();
  const bool cuda = d.info().kind == tier::DeviceKind::kCuda;
  if (where == Tier::kDevice) {
    return cuda ? DLDevice{kDLCUDA, d.info().device_id} : DLDevice{kDLCPU, 0};
  }
  // Host copies live in the pinned arena; say kDLCUDAHost only when CUDA really has it registered.
  return cuda && d.is_registered(data, bytes) ? DLDevice{kDLCUDAHost, 0} : DLDevice{kDLCPU, 0};
}

Status wait_ticket(tier_ticket_t* ticket, const std::chrono::milliseconds* timeout, DLManagedTensor** out) {
  if (ticket->handed_out) {
    return tier::failed_precondition(
        "this ticket was already waited on to completion (its tensor was handed out, or its "
        "acquire failed); acquire again for another");
  }
  Result<Lease> lease = timeout ? ticket->future.wait_for(*timeout) : ticket->future.wait();
  if (!lease.ok()) {
    if (lease.status().code() != StatusCode::kTimedOut) ticket->handed_out = true;
    return lease.status();
  }
  ticket->handed_out = true;
  auto ctx = std::make_unique<ExportedTensor>();
  ctx->core = ticket->core;
  ctx->stream = ticket->stream;
  ctx->shape = ticket->meta.shape;
  ctx->strides = tier::capi::row_major_strides(ctx->shape, ticket->meta.ndim);
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = lease->data();
  t.device = device_of(ctx->core->engine(), ticket->where, lease->data(), lease->bytes());
  t.ndim = ticket->meta.ndim;
  t.dtype = tier::capi::to_dl_dtype(ticket->meta.dtype);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  t.byte_offset = 0;
  ctx->lease = std::move(lease).value();
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &exported_deleter;
  *out = &ctx.release()->managed;
  return Status::Ok();
}

std::optional<tier_copy_state_t> copy_state_from(const char* name) {
  static constexpr std::pair<const char*, tier_copy_state_t> kNames[] = {{"absent", TIER_COPY_ABSENT},
                                                                         {"loading", TIER_COPY_LOADING},
                                                                         {"valid_clean", TIER_COPY_VALID_CLEAN},
                                                                         {"valid_dirty", TIER_COPY_VALID_DIRTY},
                                                                         {"writing_back", TIER_COPY_WRITING_BACK},
                                                                         {"reserved", TIER_COPY_RESERVED},
                                                                         {"stale", TIER_COPY_STALE}};
  for (const auto& [n, v] : kNames) {
    if (name != nullptr && std::strcmp(name, n) == 0) return v;
  }
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Version, status, errors (the definitions take C linkage from their declarations in tier.h)

int tier_version(void) {
  return TIER_VERSION;
}

const char* tier_version_string(void) {
#define TIER_C_STR2(x) #x
#define TIER_C_STR(x) TIER_C_STR2(x)
  return TIER_C_STR(TIER_VERSION_MAJOR) "." TIER_C_STR(TIER_VERSION_MINOR) "." TIER_C_STR(TIER_VERSION_PATCH);
#undef TIER_C_STR
#undef TIER_C_STR2
}

const char* tier_optimizer_types(void) {
  return "adam,adamw,adagrad,lion,lamb";
}

int tier_optimizer_supported(const char* type) {
  if (type == nullptr) return 0;
  std::string t(type);
  for (char& ch : t) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const char* k : {"adam", "adamw", "adagrad", "lion", "lamb"}) {
    if (t == k) return 1;
  }
  return 0;
}

const char* tier_status_string(tier_status_t code) {
  const int v = enum_value(code);
  if (v < 0 || v > TIER_ERROR_INTERNAL) return "unknown";
  return tier::status_code_name(static_cast<StatusCode>(v));
}

const char* tier_last_error(void) {
  return t_last_error.c_str();
}

// ---------------------------------------------------------------------------------------------
// Engine

namespace {

// A configuration from JSON text or a file (neither: every default), as the *_config_t structs
// give it.
Result<tier::EngineConfig> parse_config(const char* json, const char* json_path, int32_t strict, int32_t ignore_env) {
  tier::ConfigOptions options;
  options.strict = strict != 0;
  options.apply_env = ignore_env == 0;
  return json_path != nullptr ? tier::EngineConfig::from_file(json_path, options)
                              : tier::EngineConfig::from_json(json != nullptr && *json != '\0' ? json : "{}", options);
}

}  // namespace

tier_status_t tier_engine_create(const tier_engine_config_t* config, tier_engine_t** out_engine) {
  return guarded("tier_engine_create", [&]() -> Status {
    TIER_C_REQUIRE(out_engine);
    *out_engine = nullptr;
    TIER_C_REQUIRE(config);
    const tier_engine_config_t defaults = TIER_ENGINE_CONFIG_INIT;
    TIER_ASSIGN_OR_RETURN(tier_engine_config_t c, read_versioned(config, defaults, kEngineConfigV1, "config",
                                                                 "tier_engine_config_t", "TIER_ENGINE_CONFIG_INIT"));
    if (c.json != nullptr && c.json_path != nullptr) {
      return tier::invalid_argument("config: set json or json_path, not both");
    }
    Result<tier::EngineConfig> cfg = parse_config(c.json, c.json_path, c.strict, c.ignore_env);
    if (!cfg.ok()) return cfg.status().with_context("config");
    TIER_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(*cfg));
    auto handle = std::make_unique<tier_engine>();
    handle->core = std::make_shared<EngineCore>(std::move(engine));
    *out_engine = handle.release();
    return Status::Ok();
  });
}

void tier_engine_destroy(tier_engine_t* engine) {
  try {
    delete engine;
  } catch (...) {
    // Destructors here do not throw; the ABI must not let anything through regardless.
  }
}

tier_status_t tier_engine_device(tier_engine_t* engine, DLDevice* out_device) {
  return guarded("tier_engine_device", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(out_device);
    const tier::DeviceInfo& info = core_of(engine).engine().device().info();
    *out_device = info.kind == tier::DeviceKind::kCuda ? DLDevice{kDLCUDA, info.device_id} : DLDevice{kDLCPU, 0};
    return Status::Ok();
  });
}

tier_status_t tier_engine_flush(tier_engine_t* engine) {
  return guarded("tier_engine_flush", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    return core_of(engine).engine().flush();
  });
}

tier_status_t tier_engine_begin_step(tier_engine_t* engine) {
  return guarded("tier_engine_begin_step", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    core_of(engine).engine().begin_step();
    return Status::Ok();
  });
}

tier_status_t tier_engine_end_step(tier_engine_t* engine) {
  return guarded("tier_engine_end_step", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    core_of(engine).engine().end_step();
    return Status::Ok();
  });
}

tier_status_t tier_engine_stats_json(tier_engine_t* engine, char** out_json) {
  return guarded("tier_engine_stats_json", [&]() -> Status {
    TIER_C_REQUIRE(out_json);
    *out_json = nullptr;
    TIER_C_REQUIRE(engine);
    return hand_out_string(core_of(engine).engine().stats().to_json(), out_json);
  });
}

tier_status_t tier_engine_config_json(tier_engine_t* engine, char** out_json) {
  return guarded("tier_engine_config_json", [&]() -> Status {
    TIER_C_REQUIRE(out_json);
    *out_json = nullptr;
    TIER_C_REQUIRE(engine);
    return hand_out_string(core_of(engine).engine().config().to_json(), out_json);
  });
}

tier_status_t tier_engine_check(tier_engine_t* engine) {
  return guarded("tier_engine_check", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    return core_of(engine).engine().check_invariants();
  });
}

void tier_string_free(char* s) {
  std::free(s);
}

// ---------------------------------------------------------------------------------------------
// Tensors

tier_status_t tier_tensor_register(tier_engine_t* engine, const char* name, DLManagedTensor* src,
                                   const tier_tensor_options_t* options, tier_tensor_t* out_tensor) {
  // tier owns `src` from here on: its deleter runs exactly once before this call returns.
  ProducerTensor producer(src);
  return guarded("tier_tensor_register", [&]() -> Status {
    TIER_C_REQUIRE(out_tensor);
    out_tensor->id = 0;
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(name);
    TIER_C_REQUIRE(src);
    const tier_tensor_options_t defaults = TIER_TENSOR_OPTIONS_INIT;
    tier_tensor_options_t opt = defaults;
    if (options != nullptr) {
      TIER_ASSIGN_OR_RETURN(opt, read_versioned(options, defaults, kTensorOptionsV1, "options", "tier_tensor_options_t",
                                                "TIER_TENSOR_OPTIONS_INIT"));
    }
    TIER_RETURN_IF_ERROR(check_tier(enum_value(opt.home), "options->home"));
    TIER_RETURN_IF_ERROR(check_role(enum_value(opt.role), "options->role"));
    TIER_ASSIGN_OR_RETURN(tier::capi::SourceLayout layout, tier::capi::inspect_source(src->dl_tensor));
    EngineCore& core = core_of(engine);
    TIER_ASSIGN_OR_RETURN(TensorId id, register_source(core.engine(), name, src->dl_tensor, layout, opt));
    // The contents are in: give the source back now, and count a throwing deleter as a failure.
    if (Status s = producer.finish(); !s.ok()) {
      core.engine().unregister_tensor(id).ignore();
      return s.with_context(str("register '", name, "'"));
    }
    TensorMeta meta;
    meta.dtype = layout.dtype;
    meta.ndim = layout.ndim;
    meta.shape = layout.shape;
    out_tensor->id = core.add_tensor(id, meta);
    return Status::Ok();
  });
}

tier_status_t tier_tensor_unregister(tier_engine_t* engine, tier_tensor_t tensor) {
  return guarded("tier_tensor_unregister", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    return core_of(engine).remove_tensor(tensor.id);
  });
}

tier_status_t tier_tensor_find(tier_engine_t* engine, const char* name, tier_tensor_t* out_tensor) {
  return guarded("tier_tensor_find", [&]() -> Status {
    TIER_C_REQUIRE(out_tensor);
    out_tensor->id = 0;
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(name);
    TIER_ASSIGN_OR_RETURN(out_tensor->id, core_of(engine).find(name));
    return Status::Ok();
  });
}

tier_status_t tier_tensor_info(tier_engine_t* engine, tier_tensor_t tensor, tier_tensor_info_t* info) {
  return guarded("tier_tensor_info", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(info);
    TIER_ASSIGN_OR_RETURN(std::size_t size,
                          output_size(info, kTensorInfoV1, "info", "tier_tensor_info_t", "TIER_TENSOR_INFO_INIT"));
    EngineCore& core = core_of(engine);
    tier_tensor_info_t out = TIER_TENSOR_INFO_INIT;
    TIER_RETURN_IF_ERROR(core.with_tensor(tensor.id, [&](TensorId id, const TensorMeta& meta) -> Status {
      TIER_ASSIGN_OR_RETURN(tier::TensorInfo ti, core.engine().info(id));
      out.dtype = tier::capi::to_dl_dtype(meta.dtype);
      out.ndim = meta.ndim;
      for (int i = 0; i < meta.ndim; ++i) out.shape[i] = meta.shape[static_cast<std::size_t>(i)];
      out.numel = ti.desc.numel;
      out.nbytes = ti.desc.bytes();
      out.home = static_cast<tier_tier_t>(ti.home);
      out.role = static_cast<tier_role_t>(ti.desc.role);
      out.group = ti.desc.group;
      for (int t = 0; t < tier::kNumTiers; ++t) {
        const char* state = ti.copy_state[static_cast<std::size_t>(t)];
        const std::optional<tier_copy_state_t> c = copy_state_from(state);
        if (!c) {
          return tier::internal_error(
              str("tensor '", ti.desc.name, "': copy state '", state ? state : "(null)", "' has no C name"));
        }
        out.copies[t] = *c;
      }
      out.readers = ti.readers;
      out.writer = ti.writer ? 1 : 0;
      return Status::Ok();
    }));
    out.struct_size = info->struct_size;
    std::memcpy(static_cast<void*>(info), &out, size);
    return Status::Ok();
  });
}

namespace {

// Acquires the tensor on the host tier for a blocking read or write of all its bytes.
Result<Lease> host_lease(tier_engine_t* engine, tier_tensor_t tensor, std::size_t bytes, Access access,
                         const char* buffer_arg) {
  EngineCore& core = core_of(engine);
  tier::AcquireFuture future;
  TIER_RETURN_IF_ERROR(core.with_tensor(tensor.id, [&](TensorId id, const TensorMeta& meta) -> Status {
    // The shape was checked at registration; the arithmetic is checked again rather than trusted.
    std::uint64_t want = tier::dtype_size(meta.dtype);
    for (int i = 0; i < meta.ndim; ++i) {
      if (__builtin_mul_overflow(want, static_cast<std::uint64_t>(meta.shape[static_cast<std::size_t>(i)]), &want)) {
        return tier::internal_error(str("tensor shape[", i, "]: its byte size overflows 64 bits"));
      }
    }
    if (bytes != want) {
      return tier::invalid_argument(str("argument 'bytes' is ", bytes, " but the tensor holds ", want, " bytes; ",
                                        buffer_arg, " must cover all of it"));
    }
    future = core.engine().acquire(id, Tier::kHost, access);
    return Status::Ok();
  }));
  return future.wait();
}

}  // namespace

tier_status_t tier_tensor_read(tier_engine_t* engine, tier_tensor_t tensor, void* dst, size_t bytes) {
  return guarded("tier_tensor_read", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(dst);
    TIER_ASSIGN_OR_RETURN(Lease lease, host_lease(engine, tensor, bytes, Access::kRead, "dst"));
    std::memcpy(dst, lease.data(), bytes);
    return lease.release();
  });
}

tier_status_t tier_tensor_write(tier_engine_t* engine, tier_tensor_t tensor, const void* src, size_t bytes) {
  return guarded("tier_tensor_write", [&]() -> Status {
    TIER_C_REQUIRE(engine);
    TIER_C_REQUIRE(src);
    TIER_ASSIGN_OR_RETURN(Lease lease, host_lease(engine, tensor, bytes, Access::kWrite, "src"));
    std::memcpy(lease.data(), src, bytes);
    return lease.release();
  });
}

// ---------------------------------------------------------------------------------------------
// Acquire and tickets

tier_status_t tier_tensor_acquire(tier_engine_t* engine, tier_tensor_t tensor, tier_tier_t where, tier_access_t access,
                                  void* stream, tier_ticket_t** out_ticket) {
  return guarded("tier_tensor_acquire", [&]() -> Status {
    TIER_C_REQUIRE(out_ticket);
    *out_ticket = nullptr;
    TIER_C_REQUIRE(engine);
    TIER_RETURN_IF_ERROR(check_tier(enum_value(where), "where"));
    if (enum_value(where) == TIER_TIER_NVME) {
      return tier::invalid_argument(
          "argument 'where' is TIER_TIER_NVME; a DLPack tensor needs addressable memory: acquire on "
          "TIER_TIER_DEVICE or TIER_TIER_HOST");
    }
    if (enum_value(access) < 0 || enum_value(access) > TIER_ACCESS_READ_WRITE) {
      return tier::invalid_argument(str("argument 'access' is ", enum_value(access),
                                        "; use TIER_ACCESS_READ (0), TIER_ACCESS_WRITE (1) or "
                                        "TIER_ACCESS_READ_WRITE (2)"));
    }
    const auto& core = engine->core;
    auto ticket = std::make_unique<tier_ticket>();
    ticket->core = core;
    ticket->where = static_cast<Tier>(where);
    ticket->access = static_cast<Access>(access);
    ticket->stream = stream;
    TIER_RETURN_IF_ERROR(core->with_tensor(tensor.id, [&](TensorId id, const TensorMeta& meta) -> Status {
      ticket->meta = meta;
      ticket->future = core->engine().acquire(id, static_cast<Tier>(where), static_cast<Access>(access));
      return Status::Ok();
    }));
    *out_ticket = ticket.release();
    return Status::Ok();
  });
}

tier_status_t tier_tensor_acquire_on_stream(tier_engine_t* engine, tier_tensor_t tensor, void* stream,
                                            tier_ticket_t** out_ticket) {
  return guarded("tier_tensor_acquire_on_stream", [&]() -> Status {
    TIER_C_REQUIRE(out_ticket);
    *out_ticket = nullptr;
    TIER_C_REQUIRE(engine);
    const auto& core = engine->core;
    auto ticket = std::make_unique<tier_ticket>();
    ticket->core = core;
    ticket->where = Tier::kDevice;
    ticket->access = Access::kRead;
    ticket->stream = stream;
    TIER_RETURN_IF_ERROR(core->with_tensor(tensor.id, [&](TensorId id, const TensorMeta& meta) -> Status {
      ticket->meta = meta;
      ticket->future = core->engine().acquire_on_stream(id, stream);
      return Status::Ok();
    }));
    *out_ticket = ticket.release();
    return Status::Ok();
  });
}

tier_status_t tier_ticket_poll(tier_ticket_t* ticket, int* out_ready) {
  return guarded("tier_ticket_poll", [&]() -> Status {
    TIER_C_REQUIRE(out_ready);
    *out_ready = 0;
    TIER_C_REQUIRE(ticket);
    *out_ready = ticket->handed_out || ticket->future.ready() ? 1 : 0;
    return Status::Ok();
  });
}

tier_status_t tier_ticket_wait(tier_ticket_t* ticket, DLManagedTensor** out_tensor) {
  return guarded("tier_ticket_wait", [&]() -> Status {
    TIER_C_REQUIRE(out_tensor);
    *out_tensor = nullptr;
    TIER_C_REQUIRE(ticket);
    return wait_ticket(ticket, nullptr, out_tensor);
  });
}

tier_status_t tier_ticket_wait_for(tier_ticket_t* ticket, uint64_t timeout_ms, DLManagedTensor** out_tensor) {
  return guarded("tier_ticket_wait_for", [&]() -> Status {
    TIER_C_REQUIRE(out_tensor);
    *out_tensor = nullptr;
    TIER_C_REQUIRE(ticket);
    // Beyond ~35 years a deadline would overflow the clock: that is waiting without a limit.
    if (timeout_ms >= (std::uint64_t{1} << 40)) return wait_ticket(ticket, nullptr, out_tensor);
    const std::chrono::milliseconds timeout(static_cast<std::int64_t>(timeout_ms));
    return wait_ticket(ticket, &timeout, out_tensor);
  });
}

void tier_ticket_destroy(tier_ticket_t* ticket) {
  try {
    // A ticket dropped before its tensor was taken gives the acquire up: its lease ends unused and
    // a write lease is abandoned, so the tensor keeps its contents.
    if (ticket != nullptr && !ticket->handed_out) ticket->future.cancel();
    delete ticket;
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------------------------
// Communicators

struct tier_comm {
  std::unique_ptr<tier::Communicator> comm;
};

namespace {

Result<DType> comm_dtype(const tier_dtype_t& d, const char* arg) {
  const int v = enum_value(d);
  if (v < 0 || v >= tier::kNumDTypes) {
    return tier::invalid_argument(
        str("argument '", arg, "' is ", v, "; use one of TIER_DTYPE_* (0 to ", tier::kNumDTypes - 1, ")"));
  }
  return static_cast<DType>(v);
}

Result<tier::ReduceOp> comm_op(const tier_reduce_op_t& op, const char* arg) {
  const int v = enum_value(op);
  if (v < TIER_REDUCE_SUM || v > TIER_REDUCE_MIN) {
    return tier::invalid_argument(
        str("argument '", arg, "' is ", v, "; use TIER_REDUCE_SUM (0), TIER_REDUCE_MAX (1) or TIER_REDUCE_MIN (2)"));
  }
  return static_cast<tier::ReduceOp>(v);
}

// A callback's return code as a Status, with the framework's message when it gives one.
Status from_callback(const tier_comm_callbacks_t& t, const char* name, int rc) {
  if (rc == 0) return Status::Ok();
  std::string msg = str("the framework's ", name, " callback returned ", rc);
  if (t.error_message != nullptr) {
    const char* m = t.error_message(t.user);
    if (m != nullptr && *m != '\0') msg += str(": ", m);
  }
  const StatusCode code = rc > 0 && rc <= TIER_ERROR_INTERNAL ? static_cast<StatusCode>(rc) : StatusCode::kIoError;
  return Status(code, std::move(msg));
}

// Calls a C callback; a C++ exception thrown through it (a C++ host) becomes an error.
template <class F>
Status call_back(const tier_comm_callbacks_t& t, const char* name, F&& f) {
  try {
    return from_callback(t, name, f());
  } catch (const std::exception& e) {
    return tier::internal_error(str("the framework's ", name, " callback threw: ", e.what()));
  } catch (...) {
    return tier::internal_error(str("the framework's ", name, " callback threw"));
  }
}

tier::CommCallbacks adapt(const tier_comm_callbacks_t& t) {
  tier::CommCallbacks cb;
  cb.rank = t.rank;
  cb.world = t.world;
  cb.memory = t.memory;
  cb.name = "callbacks";
  if (t.all_reduce != nullptr) {
    cb.all_reduce = [t](void* buf, std::uint64_t n, DType d, tier::ReduceOp op) {
      return call_back(t, "all_reduce", [&] {
        return t.all_reduce(t.user, buf, n, static_cast<tier_dtype_t>(d), static_cast<tier_reduce_op_t>(op));
      });
    };
  }
  if (t.reduce_scatter != nullptr) {
    cb.reduce_scatter = [t](const void* in, void* out, std::uint64_t n, DType d, tier::ReduceOp op) {
      return call_back(t, "reduce_scatter", [&] {
        return t.reduce_scatter(t.user, in, out, n, static_cast<tier_dtype_t>(d), static_cast<tier_reduce_op_t>(op));
      });
    };
  }
  if (t.all_gather != nullptr) {
    cb.all_gather = [t](const void* in, void* out, std::uint64_t n, DType d) {
      return call_back(t, "all_gather", [&] { return t.all_gather(t.user, in, out, n, static_cast<tier_dtype_t>(d)); });
    };
  }
  if (t.broadcast != nullptr) {
    cb.broadcast = [t](void* buf, std::uint64_t n, DType d, int root) {
      return call_back(t, "broadcast", [&] { return t.broadcast(t.user, buf, n, static_cast<tier_dtype_t>(d), root); });
    };
  }
  if (t.barrier != nullptr) {
    cb.barrier = [t] { return call_back(t, "barrier", [&] { return t.barrier(t.user); }); };
  }
  if (t.destroy != nullptr) {
    cb.on_destroy = [t] {
      try {
        t.destroy(t.user);
      } catch (...) {
        // Nothing crosses the ABI; a throwing destroy has nobody to report to.
      }
    };
  }
  return cb;
}

tier::Communicator& comm_of(tier_comm_t* comm) {
  return *comm->comm;
}

}  // namespace

tier_status_t tier_comm_create_callbacks(const tier_comm_callbacks_t* callbacks, tier_comm_t** out_comm) {
  return guarded("tier_comm_create_callbacks", [&]() -> Status {
    TIER_C_REQUIRE(out_comm);
    *out_comm = nullptr;
    TIER_C_REQUIRE(callbacks);
    const tier_comm_callbacks_t defaults = TIER_COMM_CALLBACKS_INIT;
    TIER_ASSIGN_OR_RETURN(tier_comm_callbacks_t t, read_versioned(callbacks, defaults, kCommCallbacksV1, "callbacks",
                                                                  "tier_comm_callbacks_t", "TIER_COMM_CALLBACKS_INIT"));
    if (t.all_reduce == nullptr) return tier::invalid_argument("callbacks->all_reduce is NULL; it is required");
    if ((t.memory & ~(TIER_COMM_MEMORY_HOST | TIER_COMM_MEMORY_DEVICE)) != 0) {
      return tier::invalid_argument(
          str("callbacks->memory is ", t.memory, "; use TIER_COMM_MEMORY_HOST and/or TIER_COMM_MEMORY_DEVICE"));
    }
    auto handle = std::make_unique<tier_comm>();
    // The communicator calls destroy when it goes; a failed creation never calls it.
    TIER_ASSIGN_OR_RETURN(handle->comm, tier::make_callback_communicator(adapt(t)));
    *out_comm = handle.release();
    return Status::Ok();
  });
}

tier_status_t tier_comm_nccl_unique_id(uint8_t out_id[TIER_COMM_UNIQUE_ID_BYTES]) {
  return guarded("tier_comm_nccl_unique_id", [&]() -> Status {
    TIER_C_REQUIRE(out_id);
    TIER_ASSIGN_OR_RETURN(tier::NcclUniqueId id, tier::make_nccl_unique_id());
    std::memcpy(out_id, id.bytes.data(), id.bytes.size());
    return Status::Ok();
  });
}

tier_status_t tier_comm_create_nccl(const tier_comm_nccl_config_t* config, tier_comm_t** out_comm) {
  return guarded("tier_comm_create_nccl", [&]() -> Status {
    TIER_C_REQUIRE(out_comm);
    *out_comm = nullptr;
    TIER_C_REQUIRE(config);
    const tier_comm_nccl_config_t defaults = TIER_COMM_NCCL_CONFIG_INIT;
    TIER_ASSIGN_OR_RETURN(tier_comm_nccl_config_t c,
                          read_versioned(config, defaults, kCommNcclConfigV1, "config", "tier_comm_nccl_config_t",
                                         "TIER_COMM_NCCL_CONFIG_INIT"));
    tier::NcclOptions o;
    std::memcpy(o.id.bytes.data(), c.unique_id, o.id.bytes.size());
    o.rank = c.rank;
    o.world = c.world;
    o.device = c.device;
    o.stream = c.stream;
    if (c.timeout_ms == UINT64_MAX) {
      o.timeout = std::chrono::milliseconds(0);
    } else if (c.timeout_ms != 0) {
      // Beyond ~35 years a deadline would overflow the clock: that is waiting without a limit.
      o.timeout = std::chrono::milliseconds(
          c.timeout_ms >= (std::uint64_t{1} << 40) ? 0 : static_cast<std::int64_t>(c.timeout_ms));
    }
    auto handle = std::make_unique<tier_comm>();
    TIER_ASSIGN_OR_RETURN(handle->comm, tier::make_nccl_communicator(o));
    *out_comm = handle.release();
    return Status::Ok();
  });
}

void tier_comm_destroy(tier_comm_t* comm) {
  try {
    delete comm;
  } catch (...) {
  }
}

tier_status_t tier_comm_rank_world(tier_comm_t* comm, int32_t* out_rank, int32_t* out_world) {
  return guarded("tier_comm_rank_world", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    TIER_C_REQUIRE(out_rank);
    TIER_C_REQUIRE(out_world);
    *out_rank = comm_of(comm).rank();
    *out_world = comm_of(comm).world();
    return Status::Ok();
  });
}

tier_status_t tier_comm_all_reduce(tier_comm_t* comm, void* buf, uint64_t count, tier_dtype_t dtype,
                                   tier_reduce_op_t op) {
  return guarded("tier_comm_all_reduce", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    TIER_ASSIGN_OR_RETURN(DType d, comm_dtype(dtype, "dtype"));
    TIER_ASSIGN_OR_RETURN(tier::ReduceOp o, comm_op(op, "op"));
    if (count > 0) TIER_C_REQUIRE(buf);
    return comm_of(comm).all_reduce(buf, count, d, o);
  });
}

tier_status_t tier_comm_reduce_scatter(tier_comm_t* comm, const void* in, void* out, uint64_t count, tier_dtype_t dtype,
                                       tier_reduce_op_t op) {
  return guarded("tier_comm_reduce_scatter", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    TIER_ASSIGN_OR_RETURN(DType d, comm_dtype(dtype, "dtype"));
    TIER_ASSIGN_OR_RETURN(tier::ReduceOp o, comm_op(op, "op"));
    if (count > 0) {
      TIER_C_REQUIRE(in);
      TIER_C_REQUIRE(out);
    }
    return comm_of(comm).reduce_scatter(in, out, count, d, o);
  });
}

tier_status_t tier_comm_all_gather(tier_comm_t* comm, const void* in, void* out, uint64_t count, tier_dtype_t dtype) {
  return guarded("tier_comm_all_gather", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    TIER_ASSIGN_OR_RETURN(DType d, comm_dtype(dtype, "dtype"));
    if (count > 0) {
      TIER_C_REQUIRE(in);
      TIER_C_REQUIRE(out);
    }
    return comm_of(comm).all_gather(in, out, count, d);
  });
}

tier_status_t tier_comm_broadcast(tier_comm_t* comm, void* buf, uint64_t count, tier_dtype_t dtype, int32_t root) {
  return guarded("tier_comm_broadcast", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    TIER_ASSIGN_OR_RETURN(DType d, comm_dtype(dtype, "dtype"));
    if (count > 0) TIER_C_REQUIRE(buf);
    return comm_of(comm).broadcast(buf, count, d, root);
  });
}

tier_status_t tier_comm_barrier(tier_comm_t* comm) {
  return guarded("tier_comm_barrier", [&]() -> Status {
    TIER_C_REQUIRE(comm);
    return comm_of(comm).barrier();
  });
}

tier_status_t tier_shard_range(uint64_t numel, int32_t world, int32_t rank, uint64_t* out_offset, uint64_t* out_count) {
  return guarded("tier_shard_range", [&]() -> Status {
    TIER_C_REQUIRE(out_offset);
    TIER_C_REQUIRE(out_count);
    *out_offset = 0;
    *out_count = 0;
    TIER_ASSIGN_OR_RETURN(tier::ShardMap map, tier::ShardMap::create(numel, world));
    if (rank < 0 || rank >= world) {
      return tier::invalid_argument(str("rank ", rank, " is outside [0, ", world, ")"));
    }
    *out_offset = map.offset(rank);
    *out_count = map.count(rank);
    return Status::Ok();
  });
}

// ---------------------------------------------------------------------------------------------
// Training: the step driver

struct tier_optimizer {
  // The engine the optimizer serves beside (tier_optimizer_config_t::engine), if any: declared
  // before the driver, so that it goes after it.
  std::shared_ptr<tier::capi::EngineCore> engine;
  std::unique_ptr<tier::step::StepDriver> driver;
};

namespace {

tier::step::StepDriver& driver_of(tier_optimizer_t* o) {
  return *o->driver;
}

// A tensor the optimizer reads or writes during the call: checked layout, host memory (a CUDA
// gradient is copied to `staging` first when the library has CUDA).
struct HostView {
  tier::capi::SourceLayout layout;
  const void* data = nullptr;
  std::span<const std::int64_t> shape() const { return {layout.shape.data(), static_cast<std::size_t>(layout.ndim)}; }
};

Result<HostView> host_view(const DLTensor* t, const char* arg, const std::string& param, bool allow_cuda,
                           std::vector<std::uint8_t>* staging) {
  if (t == nullptr) return null_argument(arg);
  Result<tier::capi::SourceLayout> layout = tier::capi::inspect_source(*t);
  if (!layout.ok()) return layout.status().with_context(str(arg, " of '", param, "'"));
  if (!layout->compact) {
    return tier::invalid_argument(str(arg, " of '", param, "': strides are not compact row-major; make it contiguous"));
  }
  HostView v{*layout, layout->base};
  const int type = enum_value(t->device.device_type);
  if (type == kDLCPU || type == kDLCUDAHost || type == kDLCUDAManaged) {
    if (type != kDLCPU) TIER_RETURN_IF_ERROR(tier::capi::sync_cuda_stream(t->device.device_id, nullptr));
    return v;
  }
  if (type == kDLCUDA && allow_cuda && staging != nullptr) {
    if (!tier::capi::cuda_built()) {
      return tier::invalid_argument(str(arg, " of '", param,
                                        "' is in CUDA memory and this library was built without CUDA; hand in "
                                        "host memory"));
    }
    staging->resize(layout->bytes);
    TIER_RETURN_IF_ERROR(
        tier::capi::copy_from_cuda(staging->data(), layout->base, layout->bytes, t->device.device_id, nullptr));
    v.data = staging->data();
    return v;
  }
  return tier::invalid_argument(str(arg, " of '", param, "': device type ", type, " is not host memory (kDLCPU or ",
                                    "kDLCUDAHost", allow_cuda ? ", or kDLCUDA" : "", ")"));
}

Status check_index(tier::step::StepDriver& d, uint32_t index) {
  if (index >= d.param_count()) {
    return tier::invalid_argument(
        str("parameter index ", index, " is out of range (", d.param_count(), " parameters were added)"));
  }
  return Status::Ok();
}

// An output tensor for parameter `index`: its shape, and `dtype` (the parameter's own when
// kNumDTypes), host memory.
Result<void*> output_view(tier::step::StepDriver& d, uint32_t index, DLTensor* t, const char* arg,
                          std::optional<DType> dtype) {
  const tier::step::ParamInfo& p = d.param(index);
  TIER_ASSIGN_OR_RETURN(HostView v, host_view(t, arg, p.name, false, nullptr));
  const auto shape = v.shape();
  if (!std::equal(shape.begin(), shape.end(), p.shape.begin(), p.shape.end())) {
    return tier::invalid_argument(str(arg, " of '", p.name, "' has ", v.layout.ndim, " dimensions / ", v.layout.numel,
                                      " elements; the parameter's shape has ", p.shape.size(), " / ", p.numel));
  }
  if (dtype && v.layout.dtype != *dtype) {
    return tier::invalid_argument(str(arg, " of '", p.name, "' is ", tier::dtype_name(v.layout.dtype), "; it must be ",
                                      tier::dtype_name(*dtype)));
  }
  return const_cast<void*>(v.data);
}

Result<tier::optim::StateKind> state_kind(const tier_state_kind_t& k) {
  const int v = enum_value(k);
  if (v < 0 || v > 2) {
    return tier::invalid_argument(
        str("kind is ", v, "; use TIER_STATE_MASTER (0), TIER_STATE_EXP_AVG (1) or TIER_STATE_EXP_AVG_SQ (2)"));
  }
  return static_cast<tier::optim::StateKind>(v);
}

}  // namespace

tier_status_t tier_optimizer_create(const tier_optimizer_config_t* config, tier_optimizer_t** out_optimizer) {
  return guarded("tier_optimizer_create", [&]() -> Status {
    TIER_C_REQUIRE(out_optimizer);
    *out_optimizer = nullptr;
    TIER_C_REQUIRE(config);
    const tier_optimizer_config_t defaults = TIER_OPTIMIZER_CONFIG_INIT;
    TIER_ASSIGN_OR_RETURN(tier_optimizer_config_t c,
                          read_versioned(config, defaults, kOptimizerConfigV1, "config", "tier_optimizer_config_t",
                                         "TIER_OPTIMIZER_CONFIG_INIT"));
    if (c.json != nullptr && c.json_path != nullptr) {
      return tier::invalid_argument("config: set json or json_path, not both");
    }
    Result<tier::EngineConfig> cfg = parse_config(c.json, c.json_path, c.strict, c.ignore_env);
    if (!cfg.ok()) return cfg.status().with_context("config");
    auto handle = std::make_unique<tier_optimizer>();
    if (c.engine_masters != 0 && c.engine == nullptr) {
      return tier::invalid_argument("config->engine_masters: the masters are engine tensors; set config->engine");
    }
    if (c.engine == nullptr) {
      TIER_ASSIGN_OR_RETURN(handle->driver, tier::step::StepDriver::create(*cfg, c.max_elements, c.max_params));
    } else {
      handle->engine = c.engine->core;
      tier::Engine& engine = handle->engine->engine();
      TIER_ASSIGN_OR_RETURN(
          auto options, tier::optim::OffloadedOptimizerOptions::from_config(*cfg, c.max_elements, &engine.counters()));
      options.max_partitions = c.max_params;
      tier::step::serve_beside(options, engine);
      TIER_ASSIGN_OR_RETURN(handle->driver,
                            tier::step::StepDriver::create(options, c.engine_masters != 0 ? &engine : nullptr));
    }
    *out_optimizer = handle.release();
    return Status::Ok();
  });
}

void tier_optimizer_destroy(tier_optimizer_t* optimizer) {
  try {
    delete optimizer;
  } catch (...) {
  }
}

tier_status_t tier_optimizer_add_param(tier_optimizer_t* optimizer, const char* name, const DLTensor* initial,
                                       int32_t group, uint32_t* out_index) {
  return guarded("tier_optimizer_add_param", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(name);
    TIER_ASSIGN_OR_RETURN(HostView v, host_view(initial, "initial", name, false, nullptr));
    TIER_ASSIGN_OR_RETURN(std::size_t index,
                          driver_of(optimizer).add_param(name, {v.data, v.layout.dtype, v.shape()}, group));
    if (out_index != nullptr) *out_index = static_cast<uint32_t>(index);
    return Status::Ok();
  });
}

namespace {
Result<tier::TensorId> resolve_handle(tier::capi::EngineCore& core, uint64_t handle, const std::string& what,
                                      const std::function<Status(const tier::capi::TensorMeta&)>& check);
}  // namespace

tier_status_t tier_optimizer_add_engine_param(tier_optimizer_t* optimizer, const char* name, const int64_t* shape,
                                              int32_t ndim, tier_tensor_t tensor, uint64_t offset, int32_t group,
                                              uint32_t* out_index) {
  return guarded("tier_optimizer_add_engine_param", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(name);
    if (ndim < 0 || (ndim > 0 && shape == nullptr)) {
      return tier::invalid_argument(
          str("add_engine_param '", name, "': ndim ", ndim, " with shape ", shape == nullptr ? "NULL" : "given"));
    }
    if (!optimizer->engine) {
      return tier::invalid_argument(str("add_engine_param '", name, "': the optimizer has no engine (config->engine)"));
    }
    const std::string what = str("add_engine_param '", name, "': tensor ", tensor.id);
    TIER_ASSIGN_OR_RETURN(tier::TensorId id,
                          resolve_handle(*optimizer->engine, tensor.id, what,
                                         [](const tier::capi::TensorMeta&) { return Status::Ok(); }));
    TIER_ASSIGN_OR_RETURN(
        std::size_t index,
        driver_of(optimizer).add_engine_param(
            name, std::span<const std::int64_t>(shape, static_cast<std::size_t>(ndim)), group, id, offset));
    if (out_index != nullptr) *out_index = static_cast<uint32_t>(index);
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_add_group(tier_optimizer_t* optimizer, const tier_param_group_t* group,
                                       int32_t* out_group) {
  return guarded("tier_optimizer_add_group", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(group);
    TIER_C_REQUIRE(out_group);
    const tier_param_group_t defaults = TIER_PARAM_GROUP_INIT;
    TIER_ASSIGN_OR_RETURN(tier_param_group_t g, read_versioned(group, defaults, kParamGroupV1, "group",
                                                               "tier_param_group_t", "TIER_PARAM_GROUP_INIT"));
    TIER_ASSIGN_OR_RETURN(int index, driver_of(optimizer).add_group(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay));
    *out_group = index;
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_param_count(tier_optimizer_t* optimizer, uint32_t* out_count) {
  return guarded("tier_optimizer_param_count", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(out_count);
    *out_count = static_cast<uint32_t>(driver_of(optimizer).param_count());
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_find_param(tier_optimizer_t* optimizer, const char* name, uint32_t* out_index) {
  return guarded("tier_optimizer_find_param", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(name);
    TIER_C_REQUIRE(out_index);
    TIER_ASSIGN_OR_RETURN(std::size_t index, driver_of(optimizer).find(name));
    *out_index = static_cast<uint32_t>(index);
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_add_grad(tier_optimizer_t* optimizer, uint32_t index, const DLTensor* grad) {
  return guarded("tier_optimizer_add_grad", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    std::vector<std::uint8_t> staging;
    TIER_ASSIGN_OR_RETURN(HostView v, host_view(grad, "grad", d.param(index).name, true, &staging));
    return d.add_grad(index, {v.data, v.layout.dtype, v.shape()});
  });
}

tier_status_t tier_optimizer_add_grad_borrowed(tier_optimizer_t* optimizer, uint32_t index, const DLTensor* grad) {
  return guarded("tier_optimizer_add_grad_borrowed", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    // Host memory only: a device gradient would need a copy, which would not outlive this call.
    TIER_ASSIGN_OR_RETURN(HostView v, host_view(grad, "grad", d.param(index).name, false, nullptr));
    return d.add_grad(index, {v.data, v.layout.dtype, v.shape()}, tier::step::GradIntake::kBorrow);
  });
}

tier_status_t tier_optimizer_clear_grads(tier_optimizer_t* optimizer) {
  return guarded("tier_optimizer_clear_grads", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    driver_of(optimizer).clear_grads();
    return Status::Ok();
  });
}

tier_status_t tier_sum_of_squares(const DLTensor* x, double* out_sumsq) {
  return guarded("tier_sum_of_squares", [&]() -> Status {
    TIER_C_REQUIRE(out_sumsq);
    TIER_ASSIGN_OR_RETURN(HostView v, host_view(x, "x", "tier_sum_of_squares", false, nullptr));
    uint64_t numel = 1;
    for (const std::int64_t d : v.shape()) numel *= static_cast<uint64_t>(d);
    TIER_ASSIGN_OR_RETURN(*out_sumsq,
                          tier::cpu::sum_of_squares(tier::cpu::ConstTensorRef(v.data, v.layout.dtype, numel)));
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_declare_grad(tier_optimizer_t* optimizer, uint32_t index, double sumsq) {
  return guarded("tier_optimizer_declare_grad", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    return d.declare_grad(index, sumsq);
  });
}

namespace {

// A live handle of the step's engine, as its engine id; kInvalidArgument saying `what` otherwise.
Result<tier::TensorId> resolve_handle(tier::capi::EngineCore& core, uint64_t handle, const std::string& what,
                                      const std::function<Status(const tier::capi::TensorMeta&)>& check) {
  tier::TensorId out = 0;
  Status s = core.with_tensor(handle, [&](tier::TensorId id, const tier::capi::TensorMeta& m) -> Status {
    TIER_RETURN_IF_ERROR(check(m));
    out = id;
    return Status::Ok();
  });
  if (s.code() == tier::StatusCode::kNotFound) {
    return tier::invalid_argument(str(what, ": not a live tensor of options->engine (", s.message(), ")"));
  }
  TIER_RETURN_IF_ERROR(s);
  return out;
}

uint64_t numel_of(const tier::capi::TensorMeta& m) {
  uint64_t numel = 1;
  for (int k = 0; k < m.ndim; ++k) numel *= static_cast<uint64_t>(m.shape[static_cast<std::size_t>(k)]);
  return numel;
}

// The engine tensors a step writes its params into and reads declared gradients from
// (tier_step_options_t::engine), each handle resolved and checked against its parameter now,
// before anything is applied.
Result<tier::step::EngineTargets> engine_targets(tier::step::StepDriver& d, const tier_step_options_t& o) {
  if (o.engine == nullptr) {
    return tier::invalid_argument(
        "options->param_tensors, param_offsets or grad_tensors is set but options->engine is NULL");
  }
  const bool params = o.param_tensors != nullptr || o.num_param_tensors != 0 || o.param_offsets != nullptr;
  const bool grads = o.grad_tensors != nullptr || o.num_grad_tensors != 0;
  if ((params || !grads) && (o.param_tensors == nullptr || o.num_param_tensors != d.param_count())) {
    return tier::invalid_argument(str("options->engine is set with ", o.num_param_tensors, " param_tensors but ",
                                      d.param_count(), " parameters were added (one per parameter, id 0 to skip one)"));
  }
  if (grads && (o.grad_tensors == nullptr || o.num_grad_tensors != d.param_count())) {
    return tier::invalid_argument(str("options->grad_tensors has ", o.num_grad_tensors, " entries but ",
                                      d.param_count(), " parameters were added (one per parameter, id 0 for none)"));
  }
  tier::capi::EngineCore& core = *o.engine->core;
  tier::step::EngineTargets t;
  t.engine = &core.engine();
  if (grads) {
    t.grads.assign(d.param_count(), -1);
    for (uint32_t i = 0; i < o.num_grad_tensors; ++i) {
      const uint64_t handle = o.grad_tensors[i].id;
      if (handle == 0) continue;
      const tier::step::ParamInfo& p = d.param(i);
      const std::string what = str("options->grad_tensors[", i, "] (parameter '", p.name, "')");
      TIER_ASSIGN_OR_RETURN(
          tier::TensorId id, resolve_handle(core, handle, what, [&](const tier::capi::TensorMeta& m) -> Status {
            if (m.dtype != tier::DType::kF32 && m.dtype != tier::DType::kBF16 && m.dtype != tier::DType::kF16) {
              return tier::invalid_argument(
                  str(what, ": the tensor is ", tier::dtype_name(m.dtype), "; a gradient is fp32, bf16 or fp16"));
            }
            if (numel_of(m) != p.numel) {
              return tier::invalid_argument(
                  str(what, ": the tensor has ", numel_of(m), " elements, the parameter ", p.numel));
            }
            return Status::Ok();
          }));
      t.grads[i] = static_cast<std::int64_t>(id);
    }
  }
  if (!params && grads) return t;
  t.params.assign(d.param_count(), -1);
  t.offsets.assign(d.param_count(), 0);
  for (uint32_t i = 0; i < o.num_param_tensors; ++i) {
    const uint64_t handle = o.param_tensors[i].id;
    if (handle == 0) continue;
    const tier::step::ParamInfo& p = d.param(i);
    const uint64_t offset = o.param_offsets != nullptr ? o.param_offsets[i] : 0;
    const std::string what = str("options->param_tensors[", i, "] (parameter '", p.name, "')");
    TIER_ASSIGN_OR_RETURN(
        tier::TensorId id, resolve_handle(core, handle, what, [&](const tier::capi::TensorMeta& m) -> Status {
          if (m.dtype != p.dtype) {
            return tier::invalid_argument(str(what, ": the tensor is ", tier::dtype_name(m.dtype), ", the parameter ",
                                              tier::dtype_name(p.dtype)));
          }
          const uint64_t numel = numel_of(m);
          if (offset > numel || numel - offset < p.numel) {
            return tier::invalid_argument(
                str(what, ": ", p.numel, " elements from offset ", offset, " do not fit the tensor's ", numel));
          }
          return Status::Ok();
        }));
    t.params[i] = static_cast<std::int64_t>(id);
    t.offsets[i] = static_cast<std::int64_t>(offset);
  }
  return t;
}

// tier_step_options_t (NULL: the defaults) as the driver's arguments, each output checked.
Result<tier::step::StepArgs> step_args(tier::step::StepDriver& d, const tier_step_options_t* options) {
  tier_step_options_t o = TIER_STEP_OPTIONS_INIT;
  if (options != nullptr) {
    const tier_step_options_t defaults = TIER_STEP_OPTIONS_INIT;
    TIER_ASSIGN_OR_RETURN(o, read_versioned(options, defaults, kStepOptionsV1, "options", "tier_step_options_t",
                                            "TIER_STEP_OPTIONS_INIT"));
  }
  tier::step::StepArgs args;
  if (o.set_lr != 0) args.lr = o.lr;
  args.skip_missing = o.skip_missing != 0;
  if (o.comm != nullptr) args.comm = o.comm->comm.get();
  if (o.engine != nullptr || o.param_tensors != nullptr || o.param_offsets != nullptr || o.num_param_tensors != 0 ||
      o.grad_tensors != nullptr || o.num_grad_tensors != 0) {
    TIER_ASSIGN_OR_RETURN(args.engine, engine_targets(d, o));
  }
  if (o.params_out != nullptr) {
    if (o.num_params_out != d.param_count()) {
      return tier::invalid_argument(str("options->num_params_out is ", o.num_params_out, " but ", d.param_count(),
                                        " parameters were added (one entry per parameter, NULL to skip one)"));
    }
    args.outputs.resize(d.param_count(), nullptr);
    for (uint32_t i = 0; i < o.num_params_out; ++i) {
      if (o.params_out[i] == nullptr) continue;
      const std::string arg = str("options->params_out[", i, "]");
      TIER_ASSIGN_OR_RETURN(args.outputs[i], output_view(d, i, o.params_out[i], arg.c_str(), d.param(i).dtype));
    }
  } else if (o.num_params_out != 0) {
    return tier::invalid_argument("options->num_params_out is set but params_out is NULL");
  }
  return args;
}

// Checks an out_report's struct_size (NULL: none); the bytes to write.
Result<std::size_t> report_size(const tier_step_report_t* out_report) {
  if (out_report == nullptr) return std::size_t{0};
  return output_size(out_report, kStepReportV1, "out_report", "tier_step_report_t", "TIER_STEP_REPORT_INIT");
}

void write_report(const tier::optim::StepReport& r, tier_step_report_t* out_report, std::size_t bytes) {
  if (out_report == nullptr) return;
  tier_step_report_t rep = TIER_STEP_REPORT_INIT;
  rep.step = r.step;
  rep.applied = r.applied ? 1 : 0;
  rep.grad_norm = r.grad_norm;
  rep.clip_coefficient = r.clip_coefficient;
  rep.loss_scale = r.loss_scale;
  rep.seconds = r.seconds;
  rep.overlapped = r.overlapped ? 1 : 0;
  rep.redone = r.redone ? 1 : 0;
  std::memcpy(static_cast<void*>(out_report), &rep, bytes);
  out_report->struct_size = bytes;
}

}  // namespace

tier_status_t tier_optimizer_step(tier_optimizer_t* optimizer, const tier_step_options_t* options,
                                  tier_step_report_t* out_report) {
  return guarded("tier_optimizer_step", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_ASSIGN_OR_RETURN(const std::size_t report_bytes, report_size(out_report));
    TIER_ASSIGN_OR_RETURN(const tier::step::StepArgs args, step_args(d, options));
    TIER_ASSIGN_OR_RETURN(tier::optim::StepReport r, d.step(args));
    write_report(r, out_report, report_bytes);
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_start_overlap(tier_optimizer_t* optimizer, const tier_step_options_t* options) {
  return guarded("tier_optimizer_start_overlap", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_ASSIGN_OR_RETURN(const tier::step::StepArgs args, step_args(d, options));
    return d.start_overlap(args);
  });
}

tier_status_t tier_optimizer_finish_overlap(tier_optimizer_t* optimizer, tier_step_report_t* out_report) {
  return guarded("tier_optimizer_finish_overlap", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_ASSIGN_OR_RETURN(const std::size_t report_bytes, report_size(out_report));
    TIER_ASSIGN_OR_RETURN(tier::optim::StepReport r, driver_of(optimizer).finish_overlap());
    write_report(r, out_report, report_bytes);
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_cancel_overlap(tier_optimizer_t* optimizer) {
  return guarded("tier_optimizer_cancel_overlap", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    driver_of(optimizer).cancel_overlap();
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_get_group(tier_optimizer_t* optimizer, int32_t group, tier_param_group_t* out_group) {
  return guarded("tier_optimizer_get_group", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(out_group);
    TIER_ASSIGN_OR_RETURN(const std::size_t bytes, output_size(out_group, kParamGroupV1, "out_group",
                                                               "tier_param_group_t", "TIER_PARAM_GROUP_INIT"));
    TIER_ASSIGN_OR_RETURN(const tier::cpu::AdamHyperParams hp, driver_of(optimizer).hyper_params(group));
    tier_param_group_t g = TIER_PARAM_GROUP_INIT;
    g.lr = hp.lr;
    g.beta1 = hp.beta1;
    g.beta2 = hp.beta2;
    g.eps = hp.eps;
    g.weight_decay = hp.weight_decay;
    std::memcpy(static_cast<void*>(out_group), &g, bytes);
    out_group->struct_size = bytes;
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_set_group(tier_optimizer_t* optimizer, int32_t group,
                                       const tier_param_group_t* group_params) {
  return guarded("tier_optimizer_set_group", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(group_params);
    const tier_param_group_t defaults = TIER_PARAM_GROUP_INIT;
    TIER_ASSIGN_OR_RETURN(tier_param_group_t g, read_versioned(group_params, defaults, kParamGroupV1, "group_params",
                                                               "tier_param_group_t", "TIER_PARAM_GROUP_INIT"));
    return driver_of(optimizer).set_hyper_params(group, g.lr, g.beta1, g.beta2, g.eps, g.weight_decay);
  });
}

tier_status_t tier_optimizer_read_param(tier_optimizer_t* optimizer, uint32_t index, DLTensor* dst) {
  return guarded("tier_optimizer_read_param", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    TIER_ASSIGN_OR_RETURN(void* out, output_view(d, index, dst, "dst", std::nullopt));
    TIER_ASSIGN_OR_RETURN(DType dtype, tier::capi::from_dl_dtype(dst->dtype));
    return d.read_param(index, dtype, out);
  });
}

tier_status_t tier_optimizer_read_state(tier_optimizer_t* optimizer, uint32_t index, tier_state_kind_t kind,
                                        DLTensor* dst) {
  return guarded("tier_optimizer_read_state", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    TIER_ASSIGN_OR_RETURN(tier::optim::StateKind k, state_kind(kind));
    TIER_ASSIGN_OR_RETURN(void* out, output_view(d, index, dst, "dst", DType::kF32));
    return d.read_state(index, k, static_cast<float*>(out));
  });
}

tier_status_t tier_optimizer_write_state(tier_optimizer_t* optimizer, uint32_t index, tier_state_kind_t kind,
                                         const DLTensor* src) {
  return guarded("tier_optimizer_write_state", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    tier::step::StepDriver& d = driver_of(optimizer);
    TIER_RETURN_IF_ERROR(check_index(d, index));
    TIER_ASSIGN_OR_RETURN(tier::optim::StateKind k, state_kind(kind));
    TIER_ASSIGN_OR_RETURN(void* in, output_view(d, index, const_cast<DLTensor*>(src), "src", DType::kF32));
    return d.write_state(index, k, static_cast<const float*>(in));
  });
}

tier_status_t tier_optimizer_group_step(tier_optimizer_t* optimizer, int32_t group, int64_t* out_step) {
  return guarded("tier_optimizer_group_step", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(out_step);
    TIER_ASSIGN_OR_RETURN(*out_step, driver_of(optimizer).group_step(group));
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_set_group_step(tier_optimizer_t* optimizer, int32_t group, int64_t step) {
  return guarded("tier_optimizer_set_group_step", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    return driver_of(optimizer).set_group_step(group, step);
  });
}

tier_status_t tier_optimizer_loss_scale(tier_optimizer_t* optimizer, double* out_scale) {
  return guarded("tier_optimizer_loss_scale", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(out_scale);
    *out_scale = driver_of(optimizer).loss_scale();
    return Status::Ok();
  });
}

tier_status_t tier_optimizer_save(tier_optimizer_t* optimizer, const char* path) {
  return guarded("tier_optimizer_save", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(path);
    return driver_of(optimizer).save(path);
  });
}

tier_status_t tier_optimizer_load(tier_optimizer_t* optimizer, const char* path) {
  return guarded("tier_optimizer_load", [&]() -> Status {
    TIER_C_REQUIRE(optimizer);
    TIER_C_REQUIRE(path);
    return driver_of(optimizer).load(path);
  });
}

tier_status_t tier_optimizer_stats_json(tier_optimizer_t* optimizer, char** out_json) {
  return guarded("tier_optimizer_stats_json", [&]() -> Status {
    TIER_C_REQUIRE(out_json);
    *out_json = nullptr;
    TIER_C_REQUIRE(optimizer);
    return hand_out_string(driver_of(optimizer).stats_json(), out_json);
  });
}
