// CudaDevice: the Device on an NVIDIA GPU, through the CUDA runtime (linked statically, so it
// loads where no driver is installed; probe_cuda() decides whether it may be created).
//
// Streams: one non-blocking stream per copy direction, so copies never serialize behind the
// legacy default stream that a framework's compute may use, and H2D and D2H overlap on GPUs with
// two copy engines. Every copy records an event (blocking-sync, no timing) on its stream; a
// completion thread per stream waits for those events in submission order, counts the transfer,
// completes the DeviceEvent and runs its callbacks. Waiting in order is exact, not a heuristic:
// copies on one stream complete in order. Events recorded on callers' streams have a completion
// thread of their own; there, an event of a slow stream can delay the notification of a later one
// from another stream (never its GPU-side ordering, which cudaStreamWaitEvent does).
//
// Every call that touches CUDA first makes this device current on the calling thread and puts the
// caller's device back afterwards, so a framework using another GPU on the same thread is not
// disturbed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>

#include "gpu/caching_allocator.hpp"
#include "gpu/cuda_error.hpp"
#include "gpu/event_state.hpp"
#include "gpu/ordered_worker.hpp"
#include "tier/ext/cuda_probe.hpp"
#include "tier/ext/device.hpp"
#include "tier/log.hpp"
#include "tier/stats.hpp"
#include "tier/units.hpp"

namespace tier {

namespace {

// cudaLaunchHostFunc's function: runs and frees the std::function enqueue_host gave it. Nothing
// may escape into the CUDA runtime's thread.
void CUDART_CB run_host_fn(void* user) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(user));
  detail::run_host_function(*fn, "enqueue_host on a CUDA stream");
}

Status cuda_status(cudaError_t err, const std::string& what) {
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  return detail::cuda_error_status(err, what);
}

// The auto device budget (tier.budgets.device = 0): this share of the GPU's free memory when the
// device is created. The rest is left to the framework running beside tier (PyTorch's caching
// allocator holds activations, gradients and temporaries there), which would otherwise fail with
// out-of-memory errors tier cannot see; give tier.budgets.device to take more.
constexpr double kAutoBudgetFractionOfFree = 0.5;

// Whether CUDA knows [p, p + bytes) as page-locked host memory. Its first and last byte are
// checked: a range that only starts in a registered (or cudaHostAlloc'd) block and runs past its end
// is not pinned, and a copy from it would be staged by the driver after all.
bool cuda_pinned_range(const void* p, std::uint64_t bytes) {
  const auto* first = static_cast<const std::byte*>(p);
  for (const void* q : {static_cast<const void*>(first), static_cast<const void*>(first + (bytes ? bytes - 1 : 0))}) {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, q) != cudaSuccess) {
      cudaGetLastError();  // not a pointer CUDA knows: clear the error for the next call
      return false;
    }
    if (attr.type != cudaMemoryTypeHost) return false;
  }
  return true;
}

// Makes `id` the current device of this thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int id) : id_(id) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != id_) cudaSetDevice(id_);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != id_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int id_;
  int prev_ = -1;
};

void destroy_cuda_event(void* e) noexcept {
  cudaEventDestroy(static_cast<cudaEvent_t>(e));  // fails harmlessly once the runtime is unloading
}

class CudaRawMemory final : public detail::RawDeviceMemory {
 public:
  explicit CudaRawMemory(int id) : id_(id) {}
  Result<void*> allocate(std::uint64_t bytes) override {
    DeviceGuard g(id_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) return cuda_status(err, str("cudaMalloc(", format_bytes(bytes), ") on device ", id_));
    return p;
  }
  void free(void* p, std::uint64_t bytes) noexcept override {
    DeviceGuard g(id_);
    const cudaError_t err = cudaFree(p);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      TIER_LOG(kWarn, cuda_status(err, str("cudaFree of a ", format_bytes(bytes), " block on device ", id_)));
    }
  }

 private:
  int id_;
};

// Waits for the native events of one stream in order and completes them.
class CompletionQueue {
 public:
  CompletionQueue(std::string name, int device_id)
      : name_(std::move(name)), device_id_(device_id), worker_([this](Item& item) { complete(item); }) {}

  void push(std::shared_ptr<detail::EventState> state, Counters::Transfer transfer, std::uint64_t bytes) {
    worker_.push(Item{std::move(state), std::move(transfer), bytes});
  }

  // Waits until every event pushed before the call has completed and its callbacks have run;
  // false without waiting when called from this queue's own thread (a callback).
  bool drain() { return worker_.drain(); }

 private:
  struct Item {
    std::shared_ptr<detail::EventState> state;
    Counters::Transfer transfer;
    std::uint64_t bytes = 0;
  };

  void complete(Item& item) {
    if (!device_set_) {  // (the worker's thread, on its first item)
      cudaSetDevice(device_id_);
      device_set_ = true;
    }
    const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(item.state->native));
    Status s = err == cudaSuccess ? Status() : cuda_status(err, str(name_, ": the copy failed"));
    item.transfer.finish(item.bytes, s.ok());
    item.state->complete(std::move(s));
    item.state.reset();
  }

  const std::string name_;
  const int device_id_;
  bool device_set_ = false;             // used by the worker's thread only
  detail::OrderedWorker<Item> worker_;  // last: its thread uses the members above
};

class CudaDevice final : public Device {
 public:
  static Result<std::unique_ptr<Device>> create(const DeviceOptions& o) {
    const CudaProbe& probe = probe_cuda();
    if (!probe.usable()) {
      return unsupported(str("no CUDA device: ", probe.status.message(),
                             "; use the emulated device (tier.device=emulated or auto) on this machine"));
    }
    if (o.device_id < 0 || o.device_id >= static_cast<int>(probe.gpus.size())) {
      return invalid_argument(str("tier.device_id ", o.device_id, ": this machine has ", probe.gpus.size(),
                                  " CUDA device(s), numbered from 0"));
    }
    if (o.alloc_timeout.count() < 0) {
      return invalid_argument(
          str("tier.device_alloc_timeout_ms must not be negative (got ", o.alloc_timeout.count(), ")"));
    }
    std::unique_ptr<CudaDevice> d(new CudaDevice(o.device_id, o.counters));
    TIER_RETURN_IF_ERROR(d->init(o, probe.gpus[static_cast<std::size_t>(o.device_id)]));
    return std::unique_ptr<Device>(std::move(d));
  }

  ~CudaDevice() override {
    shutdown();
    recorded_.reset();
    for (auto& q : queues_) q.reset();
    DeviceGuard g(id_);
    for (cudaStream_t s : streams_) {
      if (s) cudaStreamDestroy(s);
    }
  }

 protected:
  Result<DeviceEvent> submit_copy(CopyDirection dir, void* dst, const void* src, std::uint64_t bytes,
                                  const std::vector<DeviceEvent>& after) override {
    const int i = static_cast<int>(dir);
    const bool h2d = dir == CopyDirection::kHostToDevice;
    const void* host = h2d ? src : dst;
    if (!is_registered(host, bytes)) warn_if_pageable(host, bytes);

    std::lock_guard<std::mutex> lock(submit_mu_[i]);
    DeviceGuard g(id_);
    cudaStream_t stream = streams_[i];
    for (const auto& e : after) {
      if (e.ready()) continue;
      const auto& st = e.state();
      if (st->domain != detail::EventDomain::kCuda || st->native == nullptr) {
        return invalid_argument(str(info_.name, ": a copy was ordered after an event that is not a CUDA event (",
                                    "from another kind of device); wait for it on the host first"));
      }
      if (cudaError_t err = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(st->native), 0); err != cudaSuccess) {
        return cuda_status(err, str(info_.name, ": cudaStreamWaitEvent on the ", copy_direction_name(dir), " stream"));
      }
    }
    cudaEvent_t ev = nullptr;
    if (cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
        err != cudaSuccess) {
      return cuda_status(err, str(info_.name, ": cudaEventCreate"));
    }
    Counters::Transfer transfer =
        counters_ ? counters_->begin(h2d ? Link::kHostToDevice : Link::kDeviceToHost) : Counters::Transfer();
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) {
      err = cudaEventRecord(ev, stream);
      // Without an event nothing would say when the copy ends: let it end before returning.
      if (err != cudaSuccess) cudaStreamSynchronize(stream);
    }
    if (err != cudaSuccess) {
      cudaEventDestroy(ev);
      transfer.finish(0, false);
      return cuda_status(err,
                         str(info_.name, ": cudaMemcpyAsync ", copy_direction_name(dir), " of ", format_bytes(bytes)));
    }
    auto state = detail::EventState::pending(detail::EventDomain::kCuda);
    state->native = ev;
    state->destroy_native = &destroy_cuda_event;
    queues_[i]->push(state, std::move(transfer), bytes);
    return DeviceEvent(std::move(state));
  }

  Status do_register_host(void* base, std::uint64_t bytes, bool* owned) override {
    DeviceGuard g(id_);
    *owned = false;
    if (cuda_pinned_range(base, bytes)) {
      return Status();  // cudaHostAlloc'd or registered by someone else, first byte to last: pinned already
    }
    const cudaError_t err = cudaHostRegister(base, bytes, cudaHostRegisterPortable);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();
      return Status();
    }
    if (err != cudaSuccess) {
      return cuda_status(err, str(info_.name, ": cudaHostRegister of ", format_bytes(bytes), " at ", base,
                                  " (copies from unregistered memory are staged by the driver and much slower)"));
    }
    *owned = true;
    return Status();
  }

  Status do_unregister_host(void* base, std::uint64_t bytes) override {
    DeviceGuard g(id_);
    const cudaError_t err = cudaHostUnregister(base);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      return cuda_status(err, str(info_.name, ": cudaHostUnregister of ", format_bytes(bytes), " at ", base));
    }
    return Status();
  }

  Status do_stream_wait(DeviceStream stream, const DeviceEvent& event) override {
    if (event.ready()) return event.status();
    const auto& st = event.state();
    if (st->domain != detail::EventDomain::kCuda || st->native == nullptr) return event.wait();  // a host-side event
    DeviceGuard g(id_);
    const cudaError_t err =
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(st->native), 0);
    if (err != cudaSuccess) return cuda_status(err, str(info_.name, ": cudaStreamWaitEvent on the caller's stream"));
    return Status();
  }

  Result<DeviceEvent> do_record_event(DeviceStream stream) override {
    DeviceGuard g(id_);
    cudaEvent_t ev = nullptr;
    cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
    if (err != cudaSuccess) return cuda_status(err, str(info_.name, ": cudaEventCreate"));
    err = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      cudaEventDestroy(ev);
      return cuda_status(err, str(info_.name, ": cudaEventRecord on the caller's stream"));
    }
    auto state = detail::EventState::pending(detail::EventDomain::kCuda);
    state->native = ev;
    state->destroy_native = &destroy_cuda_event;
    recorded_->push(state, Counters::Transfer(), 0);
    return DeviceEvent(std::move(state));
  }

  Status do_enqueue_host(DeviceStream stream, std::function<void()> fn) override {
    DeviceGuard g(id_);
    auto held = std::make_unique<std::function<void()>>(std::move(fn));
    const cudaError_t err = cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &run_host_fn, held.get());
    if (err != cudaSuccess) return cuda_status(err, str(info_.name, ": cudaLaunchHostFunc on the caller's stream"));
    held.release();  // run_host_fn frees it
    return Status();
  }

  Status do_synchronize() override {
    for (auto& q : queues_) {
      if (q && !q->drain()) {
        return failed_precondition(str(info_.name,
                                       ": synchronize() (or read_device/write_device) called from a copy callback, "
                                       "which cannot wait for its own stream; callbacks must not block"));
      }
    }
    DeviceGuard g(id_);
    for (cudaStream_t s : streams_) {
      if (s == nullptr) continue;  // a device that failed to start
      if (cudaError_t err = cudaStreamSynchronize(s); err != cudaSuccess) {
        return cuda_status(err, str(info_.name, ": cudaStreamSynchronize of a copy stream"));
      }
    }
    return Status();
  }

  Status do_read(void* dst, const void* device_src, std::uint64_t bytes) override {
    DeviceGuard g(id_);
    const cudaError_t err = cudaMemcpy(dst, device_src, bytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return cuda_status(err, str(info_.name, ": read_device of ", format_bytes(bytes)));
    return Status();
  }

  Status do_write(void* device_dst, const void* src, std::uint64_t bytes) override {
    DeviceGuard g(id_);
    const cudaError_t err = cudaMemcpy(device_dst, src, bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) return cuda_status(err, str(info_.name, ": write_device of ", format_bytes(bytes)));
    return Status();
  }

 private:
  CudaDevice(int id, Counters* counters) : id_(id) { counters_ = counters; }

  Status init(const DeviceOptions& o, const GpuInfo& gpu) {
    DeviceGuard g(id_);
    std::size_t free_b = 0, total_b = 0;
    if (cudaError_t err = cudaMemGetInfo(&free_b, &total_b); err != cudaSuccess) {
      return cuda_status(err, str("cuda device ", id_, ": cudaMemGetInfo"));
    }
    int engines = 0;
    cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, id_);
    const std::uint64_t budget =
        o.budget_bytes ? o.budget_bytes
                       : static_cast<std::uint64_t>(static_cast<double>(free_b) * kAutoBudgetFractionOfFree);
    if (o.budget_bytes > total_b) {
      TIER_LOG(kWarn, "cuda device ", id_, ": tier.budgets.device ", format_bytes(o.budget_bytes), " exceeds the ",
               format_bytes(total_b), " the GPU has; allocations will fail when the GPU runs out first");
    }
    info_.kind = DeviceKind::kCuda;
    info_.device_id = id_;
    info_.name =
        str("cuda: ", gpu.name, " (", format_bytes(total_b), ", sm_", gpu.cc_major, gpu.cc_minor, "), device ", id_);
    info_.total_bytes = total_b;
    info_.caps = static_cast<std::uint32_t>(DeviceCap::kAsyncCopy) |
                 static_cast<std::uint32_t>(DeviceCap::kGpuStreams) |
                 static_cast<std::uint32_t>(DeviceCap::kHostRegister) |
                 (engines >= 2 ? static_cast<std::uint32_t>(DeviceCap::kDuplexCopy) : 0u);
    info_.detail =
        str("budget ", format_bytes(budget), " of ", format_bytes(free_b), " free, ", engines,
            " copy engine(s), runtime ", probe_cuda().runtime_version, ", driver ", probe_cuda().driver_version);
    for (cudaStream_t& s : streams_) {
      if (cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); err != cudaSuccess) {
        return cuda_status(err, str("cuda device ", id_, ": cudaStreamCreateWithFlags"));
      }
    }
    init_allocator(std::make_unique<CudaRawMemory>(id_), budget, o.alloc_timeout);
    queues_[0] = std::make_unique<CompletionQueue>(str("cuda device ", id_, " h2d stream"), id_);
    queues_[1] = std::make_unique<CompletionQueue>(str("cuda device ", id_, " d2h stream"), id_);
    recorded_ = std::make_unique<CompletionQueue>(str("cuda device ", id_, " recorded events"), id_);
    return Status();
  }

  // A copy from pageable memory works, but the driver stages it through its own pinned buffer:
  // slower, and synchronous for the caller. Say so once.
  void warn_if_pageable(const void* host, std::uint64_t bytes) {
    if (cuda_pinned_range(host, bytes)) return;
    log_once("cuda.pageable_copy", LogLevel::kWarn,
             str(info_.name, ": a copy of ", format_bytes(bytes), " at ", host,
                 " uses host memory that is not registered with CUDA; the driver stages such copies, which is "
                 "slower and blocks the caller; register the pinned arena with Device::register_host"));
  }

  const int id_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
  std::mutex submit_mu_[2];
  std::unique_ptr<CompletionQueue> queues_[2];
  std::unique_ptr<CompletionQueue> recorded_;
};

}  // namespace

Result<std::unique_ptr<Device>> create_cuda_device(const DeviceOptions& options) {
  return CudaDevice::create(options);
}

}  // namespace tier
