// The optimizer step's interfaces over engine tensors (include/tier/engine_step_io.hpp).
#include "tier/engine_step_io.hpp"

#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace tier::step {

EngineParamSink::EngineParamSink(Engine& engine, std::vector<std::int64_t> tensors, std::vector<std::int64_t> offsets,
                                 const optim::OffloadedOptimizer& opt)
    : engine_(engine), tensors_(std::move(tensors)), offsets_(std::move(offsets)), opt_(opt) {}

EngineParamSink::~EngineParamSink() {
  close().ignore();
}

Status EngineParamSink::deliver(const optim::OutputChunk& c) {
  if (c.partition >= tensors_.size() || tensors_[c.partition] < 0) return Status::Ok();
  auto it = open_.find(c.partition);
  const std::uint64_t base = c.partition < offsets_.size() ? static_cast<std::uint64_t>(offsets_[c.partition]) : 0;
  if (it == open_.end()) {
    Open o;
    const auto tid = static_cast<TensorId>(tensors_[c.partition]);
    TIER_ASSIGN_OR_RETURN(TensorInfo info, engine_.info(tid));
    const bool whole = base == 0 && info.desc.numel == opt_.partition_numel(c.partition);
    TIER_ASSIGN_OR_RETURN(o.lease, engine_.acquire_now(tid, Tier::kHost, whole ? Access::kWrite : Access::kReadWrite,
                                                       /*traced=*/false));
    it = open_.emplace(c.partition, std::move(o)).first;
  }
  Open& o = it->second;
  const std::size_t esize = optim::param_output_size(c.dtype);
  if ((base + c.offset + c.numel) * esize > o.lease.bytes()) {
    return internal_error(str("partition ", c.partition, ": output past the end of its tensor"));
  }
  std::memcpy(static_cast<char*>(o.lease.data()) + (base + c.offset) * esize, c.data, c.numel * esize);
  o.written += c.numel;
  if (o.written >= opt_.partition_numel(c.partition)) {
    Status s = o.lease.release();
    open_.erase(it);
    return s;
  }
  return Status::Ok();
}

void EngineParamSink::abandoned() {
  for (auto& [pid, o] : open_) o.lease.release().ignore();
  open_.clear();
}

Status EngineParamSink::close() {
  Status first;
  for (auto& [pid, o] : open_) {
    Status s = o.lease.release();
    if (first.ok()) first = s;
  }
  open_.clear();
  return first;
}

PartitionLeases::~PartitionLeases() {
  drop_hints();
  for (auto& [id, lease] : leases_) lease.abandon().ignore();
}

void PartitionLeases::hint(optim::PartitionId id, TensorId tensor) {
  if (ahead_.count(id) || leases_.count(id)) return;
  ahead_.emplace(id, engine_.acquire(tensor, Tier::kHost, access_, /*traced=*/false));
}

Result<void*> PartitionLeases::take(optim::PartitionId id, TensorId tensor) {
  if (leases_.count(id)) return internal_error(str("partition ", id, "'s tensor is leased already"));
  Result<Lease> got{Status(StatusCode::kInternal, "no lease")};
  if (auto ahead = ahead_.find(id); ahead != ahead_.end()) {
    got = ahead->second.wait();
    ahead_.erase(ahead);
  } else {
    got = engine_.acquire_now(tensor, Tier::kHost, access_, /*traced=*/false);
  }
  TIER_ASSIGN_OR_RETURN(Lease lease, std::move(got));
  void* data = lease.data();
  leases_[id] = std::move(lease);
  return data;
}

Status PartitionLeases::end(optim::PartitionId id, bool abandon) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return internal_error(str("partition ", id, "'s tensor is not leased"));
  Status s = abandon ? it->second.abandon() : it->second.release();
  leases_.erase(it);
  return s;
}

void PartitionLeases::drop_hints() {
  for (auto& [id, f] : ahead_) f.cancel();
  ahead_.clear();
}

EngineGradSource::EngineGradSource(Engine& engine, std::vector<std::int64_t> tensors)
    : engine_(engine), tensors_(std::move(tensors)), leases_(engine, Access::kRead) {}

Result<cpu::ConstTensorRef> EngineGradSource::acquire(optim::PartitionId id) {
  if (id >= tensors_.size() || tensors_[id] < 0) {
    return invalid_argument(str("partition ", id, " has a declared gradient but no gradient tensor"));
  }
  const auto tid = static_cast<TensorId>(tensors_[id]);
  TIER_ASSIGN_OR_RETURN(TensorInfo info, engine_.info(tid));
  TIER_ASSIGN_OR_RETURN(void* data, leases_.take(id, tid));
  return cpu::ConstTensorRef(data, info.desc.dtype, info.desc.numel);
}

void EngineGradSource::release(optim::PartitionId id) {
  leases_.end(id).ignore();  // a read lease (or none): nothing to write back
}

// The serial step names the next chunk's gradients while it updates the current one: their reads
// from NVMe start then, instead of stalling the update when it gets there.
void EngineGradSource::prefetch(optim::PartitionId id) {
  if (id >= tensors_.size() || tensors_[id] < 0) return;
  leases_.hint(id, static_cast<TensorId>(tensors_[id]));
}

EngineMasterSource::EngineMasterSource(Engine& engine) : engine_(engine), leases_(engine, Access::kReadWrite) {}

Status EngineMasterSource::bind(optim::PartitionId id, TensorId tensor, std::uint64_t offset, std::uint64_t numel) {
  TIER_ASSIGN_OR_RETURN(TensorInfo info, engine_.info(tensor));
  if (info.desc.dtype != DType::kF32) {
    return invalid_argument(str("the master of partition ", id, " would be tensor '", info.desc.name, "', which is ",
                                dtype_name(info.desc.dtype), "; a master is fp32"));
  }
  if (offset > info.desc.numel || numel > info.desc.numel - offset) {
    return invalid_argument(str("the master of partition ", id, " would be elements [", offset, ", ", offset + numel,
                                ") of tensor '", info.desc.name, "', which has ", info.desc.numel));
  }
  if (id < places_.size() && places_[id].tensor >= 0) {
    return invalid_argument(str("partition ", id, " already has its master in tensor ", places_[id].tensor));
  }
  if (id >= places_.size()) places_.resize(id + 1);
  places_[id] = Place{static_cast<std::int64_t>(tensor), offset};
  return Status::Ok();
}

Result<float*> EngineMasterSource::acquire(optim::PartitionId id) {
  if (id >= places_.size() || places_[id].tensor < 0) {
    return invalid_argument(str("partition ", id, " has no tensor for its master (EngineMasterSource::bind)"));
  }
  TIER_ASSIGN_OR_RETURN(void* data, leases_.take(id, static_cast<TensorId>(places_[id].tensor)));
  return static_cast<float*>(data) + places_[id].offset;
}

Status EngineMasterSource::release(optim::PartitionId id, bool wrote) {
  // Not written: the tensor keeps its contents and nothing is written home.
  return leases_.end(id, /*abandon=*/!wrote);
}

void EngineMasterSource::prefetch(optim::PartitionId id) {
  if (id >= places_.size() || places_[id].tensor < 0) return;
  leases_.hint(id, static_cast<TensorId>(places_[id].tensor));
}

void EngineMasterSource::drop_hints() {
  leases_.drop_hints();
}

namespace {
// Whether two lists of swap paths name the same directories (as sets, after resolving them).
bool same_paths(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  auto resolved = [](const std::vector<std::string>& v) {
    std::set<std::string> out;
    for (const std::string& p : v) {
      std::error_code ec;
      const std::filesystem::path r = std::filesystem::weakly_canonical(p, ec);
      out.insert(ec ? p : (r.has_filename() ? r : r.parent_path()).string());
    }
    return out;
  };
  return resolved(a) == resolved(b);
}
}  // namespace

void serve_beside(optim::OffloadedOptimizerOptions& options, Engine& engine, bool share_swap) {
  options.pinned_source = [e = &engine](std::uint64_t bytes, const std::string& name) {
    return e->reserve_host(name, bytes);
  };
  // Whole at start under an explicit host budget, extent by extent as it is committed under the
  // auto budget (a lazy arena): the buffers' I/O is on fixed buffers either way.
  options.arena = &engine.host_arena();
  if (share_swap && options.home == optim::StateHome::kNvme && engine.swap_space() != nullptr &&
      same_paths(options.swap_options.paths, engine.swap_space()->options().paths)) {
    options.swap = engine.swap_space();
    options.nvme_reserve = [e = &engine](std::uint64_t bytes, const std::string& name) {
      return e->reserve_nvme(name, bytes);
    };
  }
}

}  // namespace tier::step
