// The NCCL communicator. Compiled against nccl.h; libnccl.so.2 is loaded at the first use
// (dlopen), so libtier and the Python module load where NCCL is not installed, and a framework's
// own copy of NCCL (torch's nvidia-nccl wheel, say) can be named with TIER_NCCL_LIBRARY.
//
// The communicator is non-blocking (ncclConfig_t::blocking = 0): creation and every collective
// are polled, together with ncclCommGetAsyncError, against the options' timeout. A collective
// waits for its own completion (an event recorded after it), so its Status is the collective's.
// On a timeout or an asynchronous error the communicator is aborted (ncclCommAbort) and refuses
// every later call.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include "gpu/cuda_current_device.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/comm_impl.hpp"
#include "tier/comm.hpp"

#ifndef TIER_NCCL_LIBRARY_PATH
#define TIER_NCCL_LIBRARY_PATH ""
#endif

namespace tier {
namespace {

using Clock = std::chrono::steady_clock;

// The NCCL entry points tier uses, from the loaded library.
struct NcclApi {
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank_config)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*comm_finalize)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  const char* (*get_error_string)(ncclResult_t) = nullptr;
  const char* (*get_last_error)(ncclComm_t) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                 cudaStream_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  int version = 0;
  std::string path;
};

// Loads libnccl once per process; the library stays loaded.
Result<const NcclApi*> nccl_api() {
  static std::once_flag once;
  static NcclApi api;
  static Status error;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("TIER_NCCL_LIBRARY"); env != nullptr && *env != '\0') {
      candidates.emplace_back(env);
    } else {
      candidates.emplace_back("libnccl.so.2");
      if (std::strlen(TIER_NCCL_LIBRARY_PATH) > 0) candidates.emplace_back(TIER_NCCL_LIBRARY_PATH);
    }
    void* lib = nullptr;
    std::string tried;
    for (const auto& c : candidates) {
      lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) {
        api.path = c;
        break;
      }
      const char* why = dlerror();
      tried += str(tried.empty() ? "" : "; ", c, ": ", why ? why : "not found");
    }
    if (lib == nullptr) {
      error = unsupported(str("NCCL: cannot load libnccl (", tried,
                              "); install NCCL, add its lib folder to LD_LIBRARY_PATH, or set TIER_NCCL_LIBRARY to "
                              "the path of libnccl.so.2"));
      return;
    }
    bool missing = false;
    std::string which;
    auto sym = [&](auto& fn, const char* name) {
      void* p = dlsym(lib, name);
      if (p == nullptr) {
        missing = true;
        which += str(which.empty() ? "" : ", ", name);
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym(api.get_version, "ncclGetVersion");
    sym(api.get_unique_id, "ncclGetUniqueId");
    sym(api.comm_init_rank_config, "ncclCommInitRankConfig");
    sym(api.comm_get_async_error, "ncclCommGetAsyncError");
    sym(api.comm_finalize, "ncclCommFinalize");
    sym(api.comm_destroy, "ncclCommDestroy");
    sym(api.comm_abort, "ncclCommAbort");
    sym(api.get_error_string, "ncclGetErrorString");
    sym(api.get_last_error, "ncclGetLastError");
    sym(api.all_reduce, "ncclAllReduce");
    sym(api.reduce_scatter, "ncclReduceScatter");
    sym(api.all_gather, "ncclAllGather");
    sym(api.broadcast, "ncclBroadcast");
    if (missing) {
      error = unsupported(str("NCCL: ", api.path, " lacks ", which, "; tier needs NCCL 2.14 or later"));
      return;
    }
    if (api.get_version(&api.version) != ncclSuccess) api.version = 0;
  });
  if (!error.ok()) return error;
  return &api;
}

Status cuda_failure(cudaError_t err, const std::string& what) {
  cudaGetLastError();  // clear a non-sticky error so the next CUDA call starts clean
  return device_error(str(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

using detail::CurrentDevice;

Result<ncclDataType_t> nccl_dtype(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF64: return ncclFloat64;
    case DType::kI8: return ncclInt8;
    case DType::kU8: return ncclUint8;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return invalid_argument(str("NCCL: unknown dtype ", static_cast<int>(d)));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kSum: break;
  }
  return ncclSum;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclApi& api, const NcclOptions& o) : api_(api), opt_(o) {}

  ~NcclCommunicator() override {
    CurrentDevice dev(opt_.device);
    if (comm_ != nullptr) {
      // A clean end flushes what is in flight (bounded by the timeout); after a failure, abort.
      bool clean = false;
      if (!broken_) {
        const ncclResult_t r = api_.comm_finalize(comm_);
        clean = (r == ncclSuccess || r == ncclInProgress) && wait_comm("finalize").ok();
      }
      if (clean) {
        api_.comm_destroy(comm_);
      } else {
        api_.comm_abort(comm_);
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (event_ != nullptr) cudaEventDestroy(event_);
    if (own_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status init() {
    CurrentDevice dev(opt_.device);
    if (dev.status() != cudaSuccess)
      return cuda_failure(dev.status(), str(where(), ": cudaSetDevice(", opt_.device, ")"));
    if (opt_.stream != nullptr) {
      stream_ = static_cast<cudaStream_t>(opt_.stream);
    } else {
      cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
      if (e != cudaSuccess) return cuda_failure(e, str(where(), ": creating its stream"));
      own_stream_ = true;
    }
    cudaError_t e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (e != cudaSuccess) return cuda_failure(e, str(where(), ": creating its event"));
    ncclUniqueId id;
    static_assert(sizeof(id.internal) == sizeof(opt_.id.bytes));
    std::memcpy(id.internal, opt_.id.bytes.data(), sizeof id.internal);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = api_.comm_init_rank_config(&comm_, opt_.world, id, opt_.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      Status s = nccl_failure(r, "ncclCommInitRankConfig");
      if (comm_ != nullptr) api_.comm_abort(comm_);
      comm_ = nullptr;
      return s;
    }
    Status joined = wait_comm("joining (ncclCommInitRankConfig)");
    if (!joined.ok()) {
      if (comm_ != nullptr) api_.comm_abort(comm_);
      comm_ = nullptr;
      return joined;
    }
    return Status::Ok();
  }

  int rank() const noexcept override { return opt_.rank; }
  int world() const noexcept override { return opt_.world; }
  std::uint32_t memory() const noexcept override { return kCommDeviceMemory | kCommHostMemory; }
  const char* name() const noexcept override { return "nccl"; }

  Status all_reduce(void* buf, std::uint64_t count, DType dtype, ReduceOp op) override {
    TIER_ASSIGN_OR_RETURN(ncclDataType_t dt, nccl_dtype(dtype));
    const std::uint64_t bytes = count * dtype_size(dtype);
    return run("all_reduce", count, dtype, buf, bytes, buf, bytes, [&](const void* in, void* out) {
      return api_.all_reduce(in, out, count, dt, nccl_op(op), comm_, stream_);
    });
  }

  Status reduce_scatter(const void* in, void* out, std::uint64_t count, DType dtype, ReduceOp op) override {
    TIER_ASSIGN_OR_RETURN(ncclDataType_t dt, nccl_dtype(dtype));
    const std::uint64_t bytes = count * dtype_size(dtype);
    return run("reduce_scatter", count, dtype, in, bytes * opt_.world, out, bytes, [&](const void* i, void* o) {
      return api_.reduce_scatter(i, o, count, dt, nccl_op(op), comm_, stream_);
    });
  }

  Status all_gather(const void* in, void* out, std::uint64_t count, DType dtype) override {
    TIER_ASSIGN_OR_RETURN(ncclDataType_t dt, nccl_dtype(dtype));
    const std::uint64_t bytes = count * dtype_size(dtype);
    return run("all_gather", count, dtype, in, bytes, out, bytes * opt_.world,
               [&](const void* i, void* o) { return api_.all_gather(i, o, count, dt, comm_, stream_); });
  }

  Status broadcast(void* buf, std::uint64_t count, DType dtype, int root) override {
    if (root < 0 || root >= opt_.world) {
      return invalid_argument(str(where(), ": broadcast root ", root, " is not a rank of world ", opt_.world));
    }
    TIER_ASSIGN_OR_RETURN(ncclDataType_t dt, nccl_dtype(dtype));
    const std::uint64_t bytes = count * dtype_size(dtype);
    return run("broadcast", count, dtype, buf, bytes, buf, bytes,
               [&](const void* i, void* o) { return api_.broadcast(i, o, count, dt, root, comm_, stream_); });
  }

  Status barrier() override {
    std::int32_t one = 1;
    return all_reduce(&one, 1, DType::kI32, ReduceOp::kSum).with_context("barrier");
  }

 private:
  std::string where() const { return str("nccl communicator (rank ", opt_.rank, " of ", opt_.world, ")"); }

  Status nccl_failure(ncclResult_t r, const std::string& what) const {
    const char* last = comm_ != nullptr ? api_.get_last_error(comm_) : nullptr;
    const StatusCode code =
        r == ncclInvalidArgument || r == ncclInvalidUsage ? StatusCode::kInvalidArgument : StatusCode::kDeviceError;
    return Status(code, str(where(), ": ", what, ": ", api_.get_error_string(r),
                            last != nullptr && *last != '\0' ? str(" (", last, ")") : std::string()));
  }

  // Aborts the communicator after a failure; every later call is refused.
  void abort() {
    broken_ = true;
    if (comm_ != nullptr) api_.comm_abort(comm_);
    comm_ = nullptr;
  }

  Clock::time_point deadline() const {
    return opt_.timeout.count() > 0 ? Clock::now() + opt_.timeout : Clock::time_point::max();
  }

  // Sleeps a little longer each round: spins first (collectives of a few KiB take microseconds),
  // then up to a millisecond.
  static void backoff(int round) {
    if (round < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 10 * (round - 63))));
    }
  }

  // Waits for the non-blocking communicator to leave ncclInProgress.
  Status wait_comm(const std::string& what) {
    const auto end = deadline();
    for (int round = 0;; ++round) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = api_.comm_get_async_error(comm_, &state);
      if (r != ncclSuccess) return nccl_failure(r, str(what, ": ncclCommGetAsyncError"));
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) return nccl_failure(state, what);
      if (Clock::now() > end) {
        return timed_out(str(where(), ": ", what, " did not finish within ", opt_.timeout.count(),
                             " ms: a peer rank may have failed or not joined (every rank must join with the same "
                             "unique id and world size)"));
      }
      backoff(round);
    }
  }

  // Waits for the work queued so far on the stream, watching NCCL's asynchronous error.
  Status wait_stream(const std::string& what) {
    cudaError_t e = cudaEventRecord(event_, stream_);
    if (e != cudaSuccess) return cuda_failure(e, str(where(), ": ", what, ": cudaEventRecord"));
    const auto end = deadline();
    for (int round = 0;; ++round) {
      e = cudaEventQuery(event_);
      if (e == cudaSuccess) return Status::Ok();
      if (e != cudaErrorNotReady) return cuda_failure(e, str(where(), ": ", what));
      ncclResult_t state = ncclSuccess;
      if (api_.comm_get_async_error(comm_, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress) {
        return nccl_failure(state, what);
      }
      if (Clock::now() > end) {
        return timed_out(str(where(), ": ", what, " did not complete within ", opt_.timeout.count(),
                             " ms: a peer rank may have failed, hung, or not called it (every rank must call the "
                             "same collectives in the same order)"));
      }
      backoff(round);
    }
  }

  // Whether `p` can be handed to NCCL as it is (device or managed memory), or must be staged.
  Result<bool> is_device(const void* p, const char* what) const {
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) return cuda_failure(e, str(where(), ": ", what, ": cudaPointerGetAttributes"));
    if (attr.type == cudaMemoryTypeDevice && attr.device != opt_.device) {
      return invalid_argument(str(where(), ": ", what, " is memory of CUDA device ", attr.device,
                                  "; this communicator's device is ", opt_.device));
    }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  }

  Result<void*> scratch(std::uint64_t bytes) {
    if (bytes <= scratch_bytes_) return scratch_;
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    cudaError_t e = cudaMalloc(&scratch_, bytes);
    if (e != cudaSuccess) return cuda_failure(e, str(where(), ": staging buffer of ", bytes, " bytes"));
    scratch_bytes_ = bytes;
    return scratch_;
  }

  // Runs one collective: stages host buffers through the device, enqueues, waits for it.
  template <class F>
  Status run(const char* op, std::uint64_t count, DType dtype, const void* in, std::uint64_t in_bytes, void* out,
             std::uint64_t out_bytes, F&& enqueue) {
    const std::string what = str(op, " of ", count, " ", dtype_name(dtype));
    if (broken_) {
      return failed_precondition(
          str(where(), ": ", what, ": the communicator was aborted after an earlier failure; make a new one"));
    }
    if (count == 0) return Status::Ok();
    if (in == nullptr || out == nullptr) return invalid_argument(str(where(), ": ", what, ": a buffer is null"));
    CurrentDevice dev(opt_.device);
    if (dev.status() != cudaSuccess) return cuda_failure(dev.status(), str(where(), ": cudaSetDevice"));
    TIER_ASSIGN_OR_RETURN(bool in_dev, is_device(in, "the input"));
    TIER_ASSIGN_OR_RETURN(bool out_dev, is_device(out, "the output"));
    const void* nin = in;
    void* nout = out;
    const bool in_place = in == out;
    if (!in_dev || !out_dev) {
      // Host memory: through one device buffer (input first, output after it unless in place).
      const std::uint64_t in_room = in_dev ? 0 : (in_bytes + 255) / 256 * 256;
      TIER_ASSIGN_OR_RETURN(void* s, scratch(in_room + (out_dev || in_place ? 0 : out_bytes)));
      auto* base = static_cast<std::uint8_t*>(s);
      if (!in_dev) {
        cudaError_t e = cudaMemcpyAsync(base, in, in_bytes, cudaMemcpyHostToDevice, stream_);
        if (e != cudaSuccess) return cuda_failure(e, str(where(), ": ", what, ": staging the input"));
        nin = base;
      }
      if (in_place) {
        nout = const_cast<void*>(nin);
      } else if (!out_dev) {
        nout = base + in_room;
      }
    }
    ncclResult_t r = enqueue(nin, nout);
    if (r != ncclSuccess && r != ncclInProgress) {
      Status s = nccl_failure(r, what);
      if (s.code() != StatusCode::kInvalidArgument) abort();
      return s;
    }
    if (r == ncclInProgress) {
      Status s = wait_comm(what);
      if (!s.ok()) {
        abort();
        return s;
      }
    }
    if (nout != out) {
      cudaError_t e = cudaMemcpyAsync(out, nout, out_bytes, cudaMemcpyDeviceToHost, stream_);
      if (e != cudaSuccess) {
        abort();
        return cuda_failure(e, str(where(), ": ", what, ": copying the result back"));
      }
    }
    Status done = wait_stream(what);
    if (!done.ok()) abort();
    return done.ok() ? done : done.with_context("the communicator was aborted");
  }

  const NcclApi& api_;
  NcclOptions opt_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  cudaEvent_t event_ = nullptr;
  void* scratch_ = nullptr;
  std::uint64_t scratch_bytes_ = 0;
  bool broken_ = false;
};

}  // namespace

Status nccl_available() {
  TIER_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  (void)api;
  return Status::Ok();
}

Result<NcclUniqueId> make_nccl_unique_id() {
  TIER_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  ncclUniqueId id;
  ncclResult_t r = api->get_unique_id(&id);
  if (r != ncclSuccess) return device_error(str("NCCL: ncclGetUniqueId: ", api->get_error_string(r)));
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), id.internal, out.bytes.size());
  return out;
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options) {
  TIER_RETURN_IF_ERROR(detail::check_rank_world("make_nccl_communicator", options.rank, options.world));
  if (options.device < 0) {
    return invalid_argument(str("make_nccl_communicator: device ", options.device, " is not a CUDA device"));
  }
  if (options.timeout.count() < 0) return invalid_argument("make_nccl_communicator: negative timeout");
  TIER_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  auto comm = std::make_unique<NcclCommunicator>(*api, options);
  TIER_RETURN_IF_ERROR(comm->init());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace tier
