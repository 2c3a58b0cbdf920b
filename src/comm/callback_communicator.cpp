// The communicator over a host framework's collectives (CommCallbacks; the C ABI's
// tier_comm_callbacks_t). Optional collectives the framework leaves out are built from all_reduce
// on host memory.
#include <cstring>
#include <utility>
#include <vector>

#include "comm/comm_impl.hpp"
#include "tier/comm.hpp"

namespace tier {
namespace {

class CallbackCommunicator final : public Communicator {
 public:
  explicit CallbackCommunicator(CommCallbacks cb) : cb_(std::move(cb)) {}
  ~CallbackCommunicator() override {
    if (cb_.on_destroy) cb_.on_destroy();
  }

  int rank() const noexcept override { return cb_.rank; }
  int world() const noexcept override { return cb_.world; }
  std::uint32_t memory() const noexcept override { return cb_.memory; }
  const char* name() const noexcept override { return cb_.name.c_str(); }

  Status all_reduce(void* buf, std::uint64_t count, DType dtype, ReduceOp op) override {
    const std::string what = describe("all_reduce", count, dtype);
    if (count == 0) return Status::Ok();
    TIER_RETURN_IF_ERROR(check_buffers(what, buf, buf));
    return cb_.all_reduce(buf, count, dtype, op).with_context(what);
  }

  Status reduce_scatter(const void* in, void* out, std::uint64_t count, DType dtype, ReduceOp op) override {
    const std::string what = describe("reduce_scatter", count, dtype);
    if (count == 0) return Status::Ok();
    TIER_RETURN_IF_ERROR(check_buffers(what, in, out));
    if (cb_.reduce_scatter) return cb_.reduce_scatter(in, out, count, dtype, op).with_context(what);
    TIER_RETURN_IF_ERROR(need_host(what));
    const std::size_t block = count * dtype_size(dtype);
    scratch_.resize(block * static_cast<std::size_t>(cb_.world));
    std::memcpy(scratch_.data(), in, scratch_.size());
    TIER_RETURN_IF_ERROR(cb_.all_reduce(scratch_.data(), count * cb_.world, dtype, op).with_context(what));
    std::memcpy(out, scratch_.data() + block * static_cast<std::size_t>(cb_.rank), block);
    return Status::Ok();
  }

  Status all_gather(const void* in, void* out, std::uint64_t count, DType dtype) override {
    const std::string what = describe("all_gather", count, dtype);
    if (count == 0) return Status::Ok();
    TIER_RETURN_IF_ERROR(check_buffers(what, in, out));
    if (cb_.all_gather) return cb_.all_gather(in, out, count, dtype).with_context(what);
    TIER_RETURN_IF_ERROR(need_host(what));
    // Every block but this rank's is zero; the sum over ranks puts each rank's block in place.
    const std::size_t block = count * dtype_size(dtype);
    auto* o = static_cast<std::uint8_t*>(out);
    std::memmove(o + block * static_cast<std::size_t>(cb_.rank), in, block);
    std::memset(o, 0, block * static_cast<std::size_t>(cb_.rank));
    std::memset(o + block * static_cast<std::size_t>(cb_.rank + 1), 0,
                block * static_cast<std::size_t>(cb_.world - cb_.rank - 1));
    return cb_.all_reduce(out, count * cb_.world, dtype, ReduceOp::kSum).with_context(what);
  }

  Status broadcast(void* buf, std::uint64_t count, DType dtype, int root) override {
    const std::string what = describe("broadcast", count, dtype);
    if (root < 0 || root >= cb_.world) {
      return invalid_argument(str(what, ": root ", root, " is not a rank of world ", cb_.world));
    }
    if (count == 0) return Status::Ok();
    TIER_RETURN_IF_ERROR(check_buffers(what, buf, buf));
    if (cb_.broadcast) return cb_.broadcast(buf, count, dtype, root).with_context(what);
    TIER_RETURN_IF_ERROR(need_host(what));
    if (cb_.rank != root) std::memset(buf, 0, count * dtype_size(dtype));
    return cb_.all_reduce(buf, count, dtype, ReduceOp::kSum).with_context(what);
  }

  Status barrier() override {
    const std::string what = str(where(), ": barrier");
    if (cb_.barrier) return cb_.barrier().with_context(what);
    std::int32_t one = 1;
    return cb_.all_reduce(&one, 1, DType::kI32, ReduceOp::kSum).with_context(what);
  }

 private:
  std::string where() const { return str(cb_.name, " communicator (rank ", cb_.rank, " of ", cb_.world, ")"); }
  std::string describe(const char* op, std::uint64_t count, DType dtype) const {
    return str(where(), ": ", op, " of ", count, " ", dtype_name(dtype));
  }
  static Status check_buffers(const std::string& what, const void* in, const void* out) {
    if (in == nullptr || out == nullptr) return invalid_argument(str(what, ": a buffer is null"));
    return Status::Ok();
  }
  Status need_host(const std::string& what) const {
    if ((cb_.memory & kCommHostMemory) == 0) {
      return unsupported(str(what,
                             ": the framework gave no callback for it, and the fallback through all_reduce "
                             "needs host memory; supply the callback"));
    }
    return Status::Ok();
  }

  CommCallbacks cb_;
  std::vector<std::uint8_t> scratch_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_callback_communicator(CommCallbacks callbacks) {
  TIER_RETURN_IF_ERROR(detail::check_rank_world("make_callback_communicator", callbacks.rank, callbacks.world));
  if (!callbacks.all_reduce) return invalid_argument("make_callback_communicator: all_reduce is required");
  if ((callbacks.memory & (kCommHostMemory | kCommDeviceMemory)) == 0) {
    return invalid_argument(
        "make_callback_communicator: memory names neither host nor device memory (kCommHostMemory, "
        "kCommDeviceMemory)");
  }
  if (callbacks.name.empty()) callbacks.name = "callbacks";
  return std::unique_ptr<Communicator>(std::make_unique<CallbackCommunicator>(std::move(callbacks)));
}

}  // namespace tier
