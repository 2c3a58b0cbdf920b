// TEST DOUBLE: an in-process "process group" whose ranks are threads of the test, with the
// collectives a host framework would supply (all_reduce, reduce_scatter, all_gather, broadcast,
// barrier) on host memory. Not part of tier: the tests drive tier's callback communicator (the C
// table of tier.h and tier::CommCallbacks) with it, as torch.distributed would be driven.
//
// Each collective is two rendezvous of a cyclic barrier (mutex + condition variable): every rank
// posts its input pointer, waits until all have, computes its own result from every rank's input
// into a private buffer (reductions in rank order 0..world-1, so every rank gets the same bits),
// waits until every rank has read the inputs, then writes its output. A rank that fails
// (fail()) or a rendezvous that times out breaks the group: every waiting and later call returns
// an error instead of hanging, as an aborted NCCL communicator does.
//
// Thread safety: one thread per rank; ranks call the same collectives in the same order.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "tier/comm.hpp"
#include "tier/status.hpp"
#include "tier/tier.h"
#include "tier/types.hpp"

namespace tier::test {

class ThreadGroup {
 public:
  explicit ThreadGroup(int world, std::chrono::milliseconds timeout = std::chrono::seconds(20))
      : world_(world), timeout_(timeout), slots_(static_cast<std::size_t>(world), nullptr) {}

  int world() const { return world_; }
  std::uint64_t collectives() const {
    std::lock_guard<std::mutex> lock(mu_);
    return collectives_;
  }

  // Rank `rank` failed: the group is broken; peers waiting (or arriving later) get an error.
  void fail(int rank, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.ok()) broken_ = Status(StatusCode::kCancelled, str("peer rank ", rank, " failed: ", why));
    cv_.notify_all();
  }

  Status all_reduce(int rank, void* buf, std::uint64_t count, DType dtype, ReduceOp op) {
    const std::size_t bytes = count * dtype_size(dtype);
    std::vector<std::uint8_t> result(bytes);
    TIER_RETURN_IF_ERROR(post(rank, buf));
    Status s = reduce(inputs(), result.data(), 0, count, dtype, op);
    TIER_RETURN_IF_ERROR(arrive());
    if (s.ok()) std::memcpy(buf, result.data(), bytes);
    return s;
  }

  Status reduce_scatter(int rank, const void* in, void* out, std::uint64_t count, DType dtype, ReduceOp op) {
    TIER_RETURN_IF_ERROR(post(rank, in));
    Status s = reduce(inputs(), out, count * static_cast<std::uint64_t>(rank), count, dtype, op);
    TIER_RETURN_IF_ERROR(arrive());
    return s;
  }

  Status all_gather(int rank, const void* in, void* out, std::uint64_t count, DType dtype) {
    const std::size_t block = count * dtype_size(dtype);
    std::vector<std::uint8_t> result(block * static_cast<std::size_t>(world_));
    TIER_RETURN_IF_ERROR(post(rank, in));
    const auto in_all = inputs();
    for (int r = 0; r < world_; ++r) std::memcpy(result.data() + block * r, in_all[static_cast<std::size_t>(r)], block);
    TIER_RETURN_IF_ERROR(arrive());
    std::memcpy(out, result.data(), result.size());
    return Status::Ok();
  }

  Status broadcast(int rank, void* buf, std::uint64_t count, DType dtype, int root) {
    const std::size_t bytes = count * dtype_size(dtype);
    std::vector<std::uint8_t> result(bytes);
    TIER_RETURN_IF_ERROR(post(rank, buf));
    std::memcpy(result.data(), inputs()[static_cast<std::size_t>(root)], bytes);
    TIER_RETURN_IF_ERROR(arrive());
    std::memcpy(buf, result.data(), bytes);
    return Status::Ok();
  }

  Status barrier(int rank) {
    TIER_RETURN_IF_ERROR(post(rank, nullptr));
    return arrive();
  }

 private:
  // Every rank's posted input (after post() returned: nobody changes them until the next arrive).
  std::vector<const void*> inputs() {
    std::lock_guard<std::mutex> lock(mu_);
    return slots_;
  }

  // Posts this rank's input and waits until every rank has posted.
  Status post(int rank, const void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_[static_cast<std::size_t>(rank)] = p;
      if (rank == 0) ++collectives_;
    }
    return arrive();
  }

  // The cyclic barrier.
  Status arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
    const std::uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return Status::Ok();
    }
    const bool done = cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || !broken_.ok(); });
    if (generation_ != gen) return Status::Ok();
    if (!done && broken_.ok()) {
      broken_ = timed_out(str("thread group: a rank did not arrive within ", timeout_.count(), " ms"));
      cv_.notify_all();
    }
    return broken_;
  }

  template <class T>
  void reduce_as(const std::vector<const void*>& in, void* out, std::uint64_t first, std::uint64_t count, ReduceOp op) {
    auto* o = static_cast<T*>(out);
    for (std::uint64_t i = 0; i < count; ++i) {
      T acc = static_cast<const T*>(in[0])[first + i];
      for (int r = 1; r < world_; ++r) {
        const T v = static_cast<const T*>(in[static_cast<std::size_t>(r)])[first + i];
        acc = op == ReduceOp::kSum   ? static_cast<T>(acc + v)
              : op == ReduceOp::kMax ? (v > acc ? v : acc)
                                     : (v < acc ? v : acc);
      }
      o[i] = acc;
    }
  }

  // Elements [first, first + count) of every rank's input, reduced in rank order, into out.
  Status reduce(const std::vector<const void*>& in, void* out, std::uint64_t first, std::uint64_t count, DType dtype,
                ReduceOp op) {
    switch (dtype) {
      case DType::kF32: reduce_as<float>(in, out, first, count, op); return Status::Ok();
      case DType::kF64: reduce_as<double>(in, out, first, count, op); return Status::Ok();
      case DType::kI32: reduce_as<std::int32_t>(in, out, first, count, op); return Status::Ok();
      case DType::kI64: reduce_as<std::int64_t>(in, out, first, count, op); return Status::Ok();
      case DType::kU8: reduce_as<std::uint8_t>(in, out, first, count, op); return Status::Ok();
      case DType::kI8: reduce_as<std::int8_t>(in, out, first, count, op); return Status::Ok();
      default: break;
    }
    return unsupported(str("thread group: no reduction for ", dtype_name(dtype)));
  }

  const int world_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<const void*> slots_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t collectives_ = 0;
  Status broken_;
};

// One rank's view of a ThreadGroup through tier.h's C table, with a switch that makes its next
// collectives fail (as a framework error would).
struct ThreadRank {
  ThreadGroup* group = nullptr;
  int rank = 0;
  bool fail_collectives = false;  // every collective returns TIER_ERROR_IO and breaks the group
  std::string error;
  int destroyed = 0;

  int failed(const char* op) {
    error = str("rank ", rank, ": ", op, " failed (injected)");
    group->fail(rank, error);
    return TIER_ERROR_IO;
  }
  int code(const Status& s) {
    if (s.ok()) return TIER_OK;
    error = s.to_string();
    return static_cast<int>(s.code());
  }

  static ThreadRank& of(void* user) { return *static_cast<ThreadRank*>(user); }

  // The table; `full`: every callback, else all_reduce alone (tier builds the rest from it).
  tier_comm_callbacks_t table(bool full) {
    tier_comm_callbacks_t t = TIER_COMM_CALLBACKS_INIT;
    t.user = this;
    t.rank = rank;
    t.world = group->world();
    t.memory = TIER_COMM_MEMORY_HOST;
    t.all_reduce = [](void* u, void* buf, uint64_t n, tier_dtype_t d, tier_reduce_op_t op) {
      ThreadRank& r = of(u);
      if (r.fail_collectives) return r.failed("all_reduce");
      return r.code(r.group->all_reduce(r.rank, buf, n, static_cast<DType>(d), static_cast<ReduceOp>(op)));
    };
    t.error_message = [](void* u) { return of(u).error.c_str(); };
    t.destroy = [](void* u) { ++of(u).destroyed; };
    if (!full) return t;
    t.reduce_scatter = [](void* u, const void* in, void* out, uint64_t n, tier_dtype_t d, tier_reduce_op_t op) {
      ThreadRank& r = of(u);
      if (r.fail_collectives) return r.failed("reduce_scatter");
      return r.code(r.group->reduce_scatter(r.rank, in, out, n, static_cast<DType>(d), static_cast<ReduceOp>(op)));
    };
    t.all_gather = [](void* u, const void* in, void* out, uint64_t n, tier_dtype_t d) {
      ThreadRank& r = of(u);
      if (r.fail_collectives) return r.failed("all_gather");
      return r.code(r.group->all_gather(r.rank, in, out, n, static_cast<DType>(d)));
    };
    t.broadcast = [](void* u, void* buf, uint64_t n, tier_dtype_t d, int32_t root) {
      ThreadRank& r = of(u);
      if (r.fail_collectives) return r.failed("broadcast");
      return r.code(r.group->broadcast(r.rank, buf, n, static_cast<DType>(d), root));
    };
    t.barrier = [](void* u) {
      ThreadRank& r = of(u);
      if (r.fail_collectives) return r.failed("barrier");
      return r.code(r.group->barrier(r.rank));
    };
    return t;
  }

  // The same rank as tier::CommCallbacks for make_callback_communicator (all_reduce alone when
  // not `full`).
  CommCallbacks callbacks(bool full) {
    CommCallbacks cb;
    cb.rank = rank;
    cb.world = group->world();
    cb.name = "thread-group";
    cb.all_reduce = [this](void* buf, std::uint64_t n, DType d, ReduceOp op) -> Status {
      if (fail_collectives) {
        failed("all_reduce");
        return Status(StatusCode::kIoError, error);
      }
      return group->all_reduce(rank, buf, n, d, op);
    };
    if (!full) return cb;
    cb.reduce_scatter = [this](const void* in, void* out, std::uint64_t n, DType d, ReduceOp op) {
      return group->reduce_scatter(rank, in, out, n, d, op);
    };
    cb.all_gather = [this](const void* in, void* out, std::uint64_t n, DType d) {
      return group->all_gather(rank, in, out, n, d);
    };
    cb.broadcast = [this](void* buf, std::uint64_t n, DType d, int root) {
      return group->broadcast(rank, buf, n, d, root);
    };
    cb.barrier = [this] { return group->barrier(rank); };
    return cb;
  }
};

}  // namespace tier::test
