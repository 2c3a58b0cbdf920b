// Checkpoints of the offloaded optimizer, streamed chunk by chunk through the pipeline buffers.
//
// File layout (little-endian; docs/optimizer.md has the full description):
//   header  64 bytes: "TIEROPTC", version, header size, meta size, elements, partitions, meta crc,
//                     header crc
//   meta    JSON: groups (hyper-parameters, step counters), loss-scale state, partitions, the
//           state dtype of the moments
//   records one per piece of a partition within a saver's chunk, in partition order:
//           48-byte header ("TREC", partition, element offset, count, crc32c of each of the five
//           sections, header crc) then master[count] (fp32), exp_avg[count] and
//           exp_avg_sq[count] in the state dtype, and for int8 state the fp32 scales of both,
//           ceil(count / 256) each (a record starts on a 256-element block of its partition)
//           (versions 1 and 2: a 40-byte header with three crcs, always fp32 moments)
//   trailer 32 bytes: "TIERTAIL", record count, elements covered, crc32c chained over the file
//           header and every record header, each without its own crc (version 4; versions 1 to
//           3 chained whole record headers, which only counted them: see chain_seed), trailer crc
// A file is written under a fresh, unpredictable temporary name in <path>'s folder
// (detail::AtomicFile: O_EXCL|O_NOFOLLOW), fsync'd and renamed over <path>, then the directory is
// fsync'd: a crash leaves the old file or the new one, never half of one under the real name.
// Loading checks every value of the metadata against the range a running optimizer accepts: the
// checksums find damage, not a file crafted with valid ones.
// read_checkpoint_info and read_checkpoint_masters read a file without an optimizer through the
// same code (open_checkpoint, check_meta, RecordStream), so they check what loading checks.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/atomic_file.hpp"
#include "tier/ext/file_system.hpp"
#include "core/text.hpp"
#include "optim/chunk_pipeline.hpp"
#include "optim/crc32c.hpp"
#include "optim/optimizer_impl.hpp"
#include "tier/units.hpp"

namespace tier::optim {

using detail::Buffer;
using detail::Chunk;
using detail::crc32c;
using detail::crc32c_extend;
using detail::Partition;
using detail::Section;
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little, "the checkpoint format is written little-endian");

namespace {

constexpr char kFileMagic[8] = {'T', 'I', 'E', 'R', 'O', 'P', 'T', 'C'};
constexpr char kRecordMagic[4] = {'T', 'R', 'E', 'C'};
constexpr char kTrailerMagic[8] = {'T', 'I', 'E', 'R', 'T', 'A', 'I', 'L'};
// Version 2 added each group's optimizer kind (and Lamb's coefficients); version 1 files are
// still read, their groups as Adam. Version 3 added the state dtype (compressed moments, kept as
// they are) and the scales' sections; versions 1 and 2 are read as fp32 state. Version 4 chains
// the header and the records' content checksums in the trailer (chain_seed); versions 1 to 3
// still load, with the same range checks on every value, though their chain only counts records.
constexpr std::uint32_t kVersion = 4;
constexpr std::uint32_t kOldestVersion = 1;
constexpr std::size_t kHeaderBytes = 64;
constexpr std::size_t kRecordBytesV2 = 40;
constexpr std::size_t kRecordBytes = 48;
constexpr int kSections = 5;
constexpr std::size_t kTrailerBytes = 32;
constexpr std::uint64_t kMaxMetaBytes = 1ull << 32;

template <class T>
void put(std::uint8_t* p, std::size_t at, T v) {
  std::memcpy(p + at, &v, sizeof v);
}
template <class T>
T get(const std::uint8_t* p, std::size_t at) {
  T v;
  std::memcpy(&v, p + at, sizeof v);
  return v;
}

// All of iov[0..count) at the file's offset, through the file layer.
Status write_all(File& f, iovec* iov, int count, const std::string& path) {
  Status s = f.write_all(iov, count);
  if (!s.ok()) return s.with_context(str("checkpoint ", path));
  return {};
}

Status read_exact(File& f, void* dst, std::uint64_t n, std::uint64_t at, const std::string& path) {
  auto* p = static_cast<std::uint8_t*>(dst);
  while (n > 0) {
    auto r = f.pread(p, std::min<std::uint64_t>(n, 1ull << 30), at);
    if (!r.ok()) return r.status().with_context(str("checkpoint ", path));
    const std::size_t got = *r;
    if (got == 0) return data_loss(str("checkpoint ", path, ": the file ends at byte ", at, "; it is truncated"));
    p += got;
    at += static_cast<std::uint64_t>(got);
    n -= static_cast<std::uint64_t>(got);
  }
  return {};
}

// The trailer's chain. Versions 1 to 3 chained whole record headers; a header ends with its own
// CRC, and a CRC over bytes followed by their own CRC is one constant whatever the bytes, so that
// chain only counted the records. From version 4 the chain covers each record header without its
// CRC (partition, offset, count and the CRCs of its sections: the content), starting from the
// file header without its CRC (which holds the metadata's): records reordered, altered, or
// spliced under another file's header and metadata fail it.
std::uint32_t chain_seed(const std::uint8_t* header, std::uint32_t version) {
  return version >= 4 ? crc32c(header, kHeaderBytes - 4) : 0;
}

std::uint32_t chain_record(std::uint32_t chain, const std::uint8_t* record_header, std::size_t bytes,
                           std::uint32_t version) {
  return crc32c_extend(chain, record_header, version >= 4 ? bytes - 4 : bytes);
}

json group_json(const cpu::AdamGroup& g) {
  const cpu::AdamHyperParams& hp = g.hyper_params();
  return {{"lr", hp.lr},
          {"beta1", hp.beta1},
          {"beta2", hp.beta2},
          {"eps", hp.eps},
          {"weight_decay", hp.weight_decay},
          {"decay_mode", hp.decay_mode == cpu::WeightDecayMode::kL2 ? "l2" : "decoupled"},
          {"bias_correction", hp.bias_correction},
          {"kind", cpu::optimizer_kind_name(hp.kind)},
          {"max_coeff", hp.max_coeff},
          {"min_coeff", hp.min_coeff},
          {"step", g.step()}};
}

json meta_json(const OffloadedOptimizer::Impl& im) {
  json groups = json::array();
  {
    std::lock_guard<std::mutex> lock(im.groups_mu);
    for (const auto& g : im.groups) groups.push_back(group_json(g));
  }
  json parts = json::array();
  for (const Partition& p : im.parts) parts.push_back(json::array({p.numel, p.group, p.name}));
  const LossScaleState& ls = im.scaler->state();
  return {{"format", "tier-optimizer-checkpoint"},
          {"version", kVersion},
          {"elements", im.elements},
          {"saved_chunk_elements", im.chunk_elems},
          {"gradient_accumulation_steps", im.opt.gradient_accumulation_steps},
          {"max_grad_norm", im.opt.max_grad_norm},
          {"state_dtype", cpu::state_dtype_name(im.state_dtype())},
          {"groups", groups},
          {"loss_scale",
           {{"enabled", im.scaler->enabled()},
            {"dynamic", im.scaler->dynamic()},
            {"scale", ls.scale},
            {"iteration", ls.iteration},
            {"last_overflow", ls.last_overflow},
            {"hysteresis_left", ls.hysteresis_left}}},
          {"partitions", parts}};
}

// The most a config accepts for each hyper-parameter (src/core/config_schema.cpp); counters stay
// below 2^53 so that they survive a round trip through a JSON double.
constexpr double kMaxLr = 1e6;
constexpr double kMaxEps = 1;
constexpr double kMaxWeightDecay = 1e6;
constexpr double kMaxCoeff = 1e6;
constexpr std::int64_t kMaxCount = (std::int64_t{1} << 53) - 1;
constexpr std::int64_t kMaxHysteresis = (std::int64_t{1} << 31) - 1;

// Whether `v` is an integer in [lo, hi]; stores it in *out. Floats are not integers here.
bool int_within(const json& v, std::int64_t lo, std::int64_t hi, std::int64_t* out) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(hi)) return false;
    *out = static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    *out = v.get<std::int64_t>();
  } else {
    return false;
  }
  return *out >= lo && *out <= hi;
}

// A JSON value for a message, cut short: a crafted file may hold anything there.
std::string shown(const json& v) {
  std::string t = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (t.size() > 64) t = t.substr(0, 64) + "...";
  return t;
}

// What load_checkpoint takes from the meta section once it is checked.
struct Restored {
  cpu::StateDType state_dtype = cpu::StateDType::kF32;
  std::vector<CheckpointPartition> parts;
  std::vector<cpu::AdamHyperParams> hp;
  std::vector<std::int64_t> steps;
  LossScaleState scale;
};

// The meta section, checked. With `im`, its partitions and groups must be the optimizer's (else
// kInvalidArgument: another model); without (reading a file alone), they are taken from the file
// and checked for what an optimizer accepts.
Result<Restored> check_meta(const OffloadedOptimizer::Impl* im, const json& m, const std::string& path) {
  auto bad = [&](const std::string& what) { return data_loss(str("checkpoint ", path, ": ", what)); };
  // Every field is type-checked before it is read: a damaged file must be an error, not an exception.
  if (!m.is_object() || !m.contains("format") || !m["format"].is_string() ||
      m["format"].get<std::string>() != "tier-optimizer-checkpoint") {
    return bad("the metadata is not a tier optimizer checkpoint's");
  }
  if (!m.contains("version") || !m["version"].is_number_unsigned() ||
      m["version"].get<std::uint32_t>() < kOldestVersion || m["version"].get<std::uint32_t>() > kVersion) {
    return bad(str("unsupported format version (this build reads versions ", kOldestVersion, " to ", kVersion, ")"));
  }
  const json& parts = m.contains("partitions") ? m["partitions"] : json();
  const json& groups = m.contains("groups") ? m["groups"] : json();
  const json& ls = m.contains("loss_scale") ? m["loss_scale"] : json();
  if (!parts.is_array() || !groups.is_array() || !ls.is_object()) return bad("the metadata lacks its sections");
  if (im != nullptr && parts.size() != im->parts.size()) {
    return invalid_argument(str("checkpoint ", path, " holds ", parts.size(), " partitions but this optimizer has ",
                                im->parts.size(), "; it belongs to another model"));
  }
  if (im != nullptr && groups.size() != im->groups.size()) {
    return invalid_argument(str("checkpoint ", path, " holds ", groups.size(),
                                " parameter groups but this optimizer has ", im->groups.size()));
  }
  Restored r;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const json& p = parts[i];
    if (!p.is_array() || p.size() != 3 || !p[0].is_number_unsigned() || !p[1].is_number_integer() ||
        !p[2].is_string()) {
      return bad(str("partition entry ", i, " is malformed"));
    }
    const auto numel = p[0].get<std::uint64_t>();
    const auto name = p[2].get<std::string>();
    if (im != nullptr) {
      const Partition& mine = im->parts[i];
      const auto group = p[1].get<int>();
      if (numel != mine.numel || group != mine.group || (!name.empty() && !mine.name.empty() && name != mine.name)) {
        return invalid_argument(str("checkpoint ", path, ": partition ", i, " is '", name, "' with ", numel,
                                    " elements in group ", group, " but this optimizer's is '", mine.name, "' with ",
                                    mine.numel, " elements in group ", mine.group, "; it belongs to another model"));
      }
      continue;  // the optimizer's own partitions: nothing to take from the file
    }
    // What add_partition accepts: 1 to 2^53 - 1 elements (with the header's total checked by
    // the caller), in one of the file's groups; ids fit a PartitionId.
    std::int64_t group = 0;
    if (i > std::numeric_limits<PartitionId>::max() || numel == 0 || numel > static_cast<std::uint64_t>(kMaxCount) ||
        groups.empty() || !int_within(p[1], 0, static_cast<std::int64_t>(groups.size()) - 1, &group)) {
      return bad(str("partition ", i, " ('", tier::detail::printable(name.substr(0, 64)), "') has ", numel,
                     " elements in group ", shown(p[1]), "; a partition has 1 to 2^53 - 1 elements in one of the ",
                     groups.size(), " groups"));
    }
    r.parts.push_back({static_cast<PartitionId>(i), numel, static_cast<int>(group), name});
  }
  if (m["version"].get<std::uint32_t>() >= 3) {
    if (!m.contains("state_dtype") || !m["state_dtype"].is_string()) return bad("the state dtype is missing");
    auto d = cpu::parse_state_dtype(m["state_dtype"].get<std::string>());
    if (!d.ok()) return bad(str("unknown state dtype: ", d.status().message()));
    r.state_dtype = *d;
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const json& j = groups[g];
    auto num = [&](const char* k) { return j.contains(k) && j[k].is_number(); };
    if (!j.is_object() || !num("lr") || !num("beta1") || !num("beta2") || !num("eps") || !num("weight_decay") ||
        !j.contains("decay_mode") || !j["decay_mode"].is_string() || !j.contains("bias_correction") ||
        !j["bias_correction"].is_boolean() || !j.contains("step")) {
      return bad(str("parameter group ", g, " is malformed"));
    }
    cpu::AdamHyperParams hp;
    hp.lr = j["lr"].get<double>();
    hp.beta1 = j["beta1"].get<double>();
    hp.beta2 = j["beta2"].get<double>();
    hp.eps = j["eps"].get<double>();
    hp.weight_decay = j["weight_decay"].get<double>();
    const std::string decay = j["decay_mode"].get<std::string>();
    if (decay != "l2" && decay != "decoupled") {
      return bad(str("parameter group ", g, " has an unknown weight decay mode '",
                     tier::detail::printable(decay.substr(0, 64)), "' (tier writes 'l2' or 'decoupled')"));
    }
    hp.decay_mode = decay == "l2" ? cpu::WeightDecayMode::kL2 : cpu::WeightDecayMode::kDecoupled;
    hp.bias_correction = j["bias_correction"].get<bool>();
    if (j.contains("kind")) {  // version 2; version 1 groups are Adam
      const std::string kind = j["kind"].is_string() ? j["kind"].get<std::string>() : "";
      bool known = false;
      for (auto k : {cpu::OptimizerKind::kAdam, cpu::OptimizerKind::kAdagrad, cpu::OptimizerKind::kLion,
                     cpu::OptimizerKind::kLamb}) {
        if (kind == cpu::optimizer_kind_name(k)) {
          hp.kind = k;
          known = true;
        }
      }
      if (!known || !num("max_coeff") || !num("min_coeff")) {
        return bad(str("parameter group ", g, " has a malformed or unknown optimizer kind '",
                       tier::detail::printable(kind.substr(0, 64)), "'"));
      }
      hp.max_coeff = j["max_coeff"].get<double>();
      hp.min_coeff = j["min_coeff"].get<double>();
    }
    if (Status s = hp.validate(); !s.ok()) return bad(str("parameter group ", g, ": ", s.message()));
    // The ranges the config accepts (validate() allows what a schedule may reach at run time).
    auto within = [&](const char* name, double v, double hi) -> Status {
      if (v <= hi) return {};
      return bad(str("parameter group ", g, ": ", name, " ", v, " is above ", hi,
                     ", the most a config accepts; the file is damaged or was not written by tier"));
    };
    TIER_RETURN_IF_ERROR(within("lr", hp.lr, kMaxLr));
    TIER_RETURN_IF_ERROR(within("eps", hp.eps, kMaxEps));
    TIER_RETURN_IF_ERROR(within("weight_decay", hp.weight_decay, kMaxWeightDecay));
    if (hp.kind == cpu::OptimizerKind::kLamb) TIER_RETURN_IF_ERROR(within("max_coeff", hp.max_coeff, kMaxCoeff));
    std::int64_t step = 0;
    if (!int_within(j["step"], 0, kMaxCount, &step)) {
      return bad(str("parameter group ", g, " has the step counter ", shown(j["step"]),
                     "; a step counter is an integer in [0, 2^53)"));
    }
    r.hp.push_back(hp);
    r.steps.push_back(step);
  }
  auto num = [&](const char* k) { return ls.contains(k) && ls[k].is_number(); };
  if (!num("scale") || !ls.contains("iteration") || !ls.contains("last_overflow") || !ls.contains("hysteresis_left")) {
    return bad("the loss-scale state is malformed");
  }
  r.scale.scale = ls["scale"].get<double>();
  std::int64_t hysteresis = 0;
  if (!int_within(ls["iteration"], 0, kMaxCount, &r.scale.iteration) ||
      !int_within(ls["last_overflow"], -1, kMaxCount, &r.scale.last_overflow) ||
      !int_within(ls["hysteresis_left"], 0, kMaxHysteresis, &hysteresis) || !std::isfinite(r.scale.scale) ||
      r.scale.scale <= 0) {
    return bad(str("the loss-scale state is out of range (scale ", shown(ls["scale"]), ", iteration ",
                   shown(ls["iteration"]), ", last overflow ", shown(ls["last_overflow"]), ", hysteresis ",
                   shown(ls["hysteresis_left"]),
                   "): the scale must be finite and positive, the counters integers in [0, 2^53)"));
  }
  r.scale.hysteresis_left = static_cast<int>(hysteresis);
  return r;
}

// Walks a checkpoint's records in partition order, checking that each is the next piece of the
// state and, once all its sections are read (section()), its checksums; then the trailer
// (finish()). The shared part of load_checkpoint's reader and read_checkpoint_masters: both check
// the same things the same way. `numels` are the partitions' sizes, in id order.
class RecordStream {
 public:
  RecordStream(File& file, std::string path, const std::uint8_t* header, std::uint64_t data_start,
               std::uint64_t file_size, std::uint32_t version, cpu::StateDType file_dtype,
               std::vector<std::uint64_t> numels)
      : in_(file),
        path_(std::move(path)),
        pos_(data_start),
        size_(file_size),
        header_bytes_(version >= 3 ? kRecordBytes : kRecordBytesV2),
        file_(file_dtype),
        version_(version),
        chain_(chain_seed(header, version)),
        numels_(std::move(numels)) {}

  // After the last record: the trailer must follow and end the file.
  Status finish() {
    if (have_) return data_loss(str("checkpoint ", path_, ": a record runs past the last element"));
    if (pos_ + kTrailerBytes > size_) {
      return data_loss(str("checkpoint ", path_, ": the trailer is missing; the file is truncated"));
    }
    std::uint8_t t[kTrailerBytes];
    TIER_RETURN_IF_ERROR(read_exact(in_, t, kTrailerBytes, pos_, path_));
    if (std::memcmp(t, kTrailerMagic, 8) != 0 || get<std::uint32_t>(t, 28) != crc32c(t, 28)) {
      return data_loss(str("checkpoint ", path_, ": the trailer at byte ", pos_, " is damaged or missing"));
    }
    if (get<std::uint64_t>(t, 8) != records_ || get<std::uint64_t>(t, 16) != covered_) {
      return data_loss(str("checkpoint ", path_, ": the trailer does not match the records read (",
                           get<std::uint64_t>(t, 8), " records claimed, ", records_, " read)"));
    }
    if (get<std::uint32_t>(t, 24) != chain_) {
      return data_loss(str("checkpoint ", path_, ": the trailer's chained checksum does not match the ", records_,
                           " records read and the header; records were reordered, altered or spliced from "
                           "another checkpoint: the file is corrupt"));
    }
    if (pos_ + kTrailerBytes != size_) {
      return data_loss(
          str("checkpoint ", path_, ": ", size_ - pos_ - kTrailerBytes, " unexpected bytes follow the trailer"));
    }
    return {};
  }

  // Whether every partition is covered (the trailer comes next).
  bool done() const { return exp_pid_ == numels_.size(); }

 protected:
  static constexpr std::uint64_t B = cpu::kStateBlock;

  // Byte offset in the payload of section 1 (exp_avg) or 2 (exp_avg_sq).
  std::uint64_t moment_offset(int mo) const {
    return count_ * 4 + (mo == 1 ? count_ * dtype_size(cpu::exp_avg_dtype(file_)) : 0);
  }

  // Reads `bytes` of section s at `off` bytes past the section's start (`sec_at` past the
  // payload's) into dst and extends that section's running checksum.
  Status section(int s, std::uint64_t sec_at, std::uint64_t off, std::uint64_t bytes, void* dst) {
    TIER_RETURN_IF_ERROR(read_exact(in_, dst, bytes, payload_ + sec_at + off, path_));
    run_[s] = crc32c_extend(run_[s], dst, bytes);
    return {};
  }

  // t elements of a moment of the file from the record's element consumed_, as fp32 into dst.
  Status moment_fp32(int mo, DType fd, std::uint64_t t, float* dst) {
    const std::size_t es = dtype_size(fd);
    if (fd == DType::kF32) return section(1 + mo, moment_offset(mo), consumed_ * 4, t * 4, dst);
    bytes_.resize(t * es);
    TIER_RETURN_IF_ERROR(section(1 + mo, moment_offset(mo), consumed_ * es, t * es, bytes_.data()));
    const auto moment = mo == 0 ? cpu::StateMoment::kExpAvg : cpu::StateMoment::kExpAvgSq;
    if (file_ != cpu::StateDType::kInt8) {
      return cpu::decode_state(moment, cpu::ConstTensorRef(bytes_.data(), fd, t), nullptr,
                               cpu::TensorRef{dst, DType::kF32, t});
    }
    // Block piece by block piece, each with its block's scale.
    for (std::uint64_t i = 0; i < t;) {
      const std::uint64_t e = consumed_ + i;
      const std::uint64_t len = std::min(t - i, B - e % B);
      TIER_RETURN_IF_ERROR(cpu::decode_state(moment, cpu::ConstTensorRef(bytes_.data() + i * es, fd, len),
                                             scales_[mo].data() + e / B, cpu::TensorRef{dst + i, DType::kF32, len}));
      i += len;
    }
    return {};
  }

  Status end_record() {
    have_ = false;
    const int n = header_bytes_ == kRecordBytes ? kSections : 3;
    for (int s = 0; s < n; ++s) {
      if (run_[s] != crc_[s]) {
        static const char* const names[kSections] = {"master", "exp_avg", "exp_avg_sq", "exp_avg scales",
                                                     "exp_avg_sq scales"};
        return data_loss(str("checkpoint ", path_, ": record ", records_ - 1, " (partition ", pid_, ", elements [",
                             offset_, ", ", offset_ + count_, ")) fails its ", names[s],
                             " checksum; the file is corrupt"));
      }
    }
    exp_off_ += count_;
    covered_ += count_;
    if (exp_off_ == numels_[exp_pid_]) {
      ++exp_pid_;
      exp_off_ = 0;
    }
    return {};
  }

  Status next_record() {
    if (pos_ + header_bytes_ + kTrailerBytes > size_) {
      return data_loss(str("checkpoint ", path_, ": the file ends at byte ", size_, " before element ", exp_off_,
                           " of partition ", exp_pid_, "; it is truncated"));
    }
    std::uint8_t h[kRecordBytes];
    TIER_RETURN_IF_ERROR(read_exact(in_, h, header_bytes_, pos_, path_));
    const std::size_t crc_at = header_bytes_ - 4;
    if (std::memcmp(h, kRecordMagic, 4) != 0 || get<std::uint32_t>(h, crc_at) != crc32c(h, crc_at)) {
      return data_loss(str("checkpoint ", path_, ": record ", records_, " at byte ", pos_,
                           " has a damaged header; the file is corrupt"));
    }
    pid_ = get<std::uint32_t>(h, 4);
    offset_ = get<std::uint64_t>(h, 8);
    count_ = get<std::uint64_t>(h, 16);
    const int nsec = header_bytes_ == kRecordBytes ? kSections : 3;
    for (int s = 0; s < nsec; ++s) crc_[s] = get<std::uint32_t>(h, 24 + 4 * s);
    if (pid_ >= numels_.size() || pid_ != exp_pid_ || offset_ != exp_off_ || count_ == 0 ||
        count_ > numels_[pid_] - offset_) {
      return data_loss(str("checkpoint ", path_, ": record ", records_, " (partition ", pid_, ", elements [", offset_,
                           ", ", offset_ + count_, ")) is not the next piece of the state (partition ", exp_pid_,
                           " from element ", exp_off_, ")"));
    }
    const std::uint64_t nscales = cpu::state_scale_count(file_, count_);
    payload_ = pos_ + header_bytes_;
    pos_ = payload_ + count_ * 4 + cpu::state_bytes(file_, count_);
    if (pos_ + kTrailerBytes > size_) {
      return data_loss(
          str("checkpoint ", path_, ": record ", records_, " runs past the end of the file; it is truncated"));
    }
    chain_ = chain_record(chain_, h, header_bytes_, version_);
    ++records_;
    consumed_ = 0;
    for (auto& r : run_) r = 0;
    have_ = true;
    if (nscales) {
      // The scales are read whole (1/64 of the codes), so a piece may start anywhere in a record.
      const std::uint64_t at = payload_ + count_ * 4 + count_ * 2;
      for (int mo = 0; mo < 2; ++mo) {
        scales_[mo].resize(nscales);
        TIER_RETURN_IF_ERROR(read_exact(in_, scales_[mo].data(), nscales * 4, at + mo * nscales * 4, path_));
        run_[3 + mo] = crc32c(scales_[mo].data(), nscales * 4);
      }
    }
    return {};
  }

  File& in_;
  std::string path_;
  std::uint64_t pos_;
  std::uint64_t size_;
  std::size_t header_bytes_;
  cpu::StateDType file_;
  bool have_ = false;
  std::uint32_t pid_ = 0;
  std::uint64_t offset_ = 0, count_ = 0, consumed_ = 0, payload_ = 0;
  std::uint32_t crc_[kSections] = {}, run_[kSections] = {};
  PartitionId exp_pid_ = 0;
  std::uint64_t exp_off_ = 0, covered_ = 0, records_ = 0;
  std::uint32_t version_;
  std::uint32_t chain_;
  std::vector<std::uint64_t> numels_;
  std::vector<float> scales_[2];
  std::vector<std::byte> bytes_;
};

// The partitions' sizes in id order (RecordStream's numels), of an optimizer's or a file's.
template <class P>
std::vector<std::uint64_t> numels_of(const std::vector<P>& parts) {
  std::vector<std::uint64_t> n;
  n.reserve(parts.size());
  for (const P& p : parts) n.push_back(p.numel);
  return n;
}

// Reads the records back in partition order into chunk layouts, checking every record's
// checksums once its last element is read. A file whose state dtype is the optimizer's is copied
// as it is; another is decoded to fp32 and encoded into the optimizer's format, one partition
// piece at a time.
class RecordReader : public RecordStream {
 public:
  RecordReader(const OffloadedOptimizer::Impl& im, File& file, std::string path, const std::uint8_t* header,
               std::uint64_t data_start, std::uint64_t file_size, std::uint32_t version, cpu::StateDType file_dtype)
      : RecordStream(file, std::move(path), header, data_start, file_size, version, file_dtype, numels_of(im.parts)),
        im_(im),
        convert_(file_dtype != im.state_dtype()) {}

  // Fills chunk c's partition pieces into `base` (laid out with c's layout).
  Status fill(const Chunk& c, void* base) {
    for (PartitionId pid = c.first; pid <= c.last; ++pid) {
      const Partition& p = im_.parts[pid];
      const std::uint64_t a = std::max(p.start, c.start);
      const std::uint64_t e = std::min(p.start + p.numel, c.start + c.numel);
      if (a < e) TIER_RETURN_IF_ERROR(piece(c, base, a - c.start, e - a));
    }
    return {};
  }

 private:
  // n elements of the next partition piece into chunk elements [ca, ca + n).
  Status piece(const Chunk& c, void* base, std::uint64_t ca, std::uint64_t n) {
    const cpu::StateDType mine = im_.state_dtype();
    if (convert_ && scratch_.size() < 2 * n) scratch_.resize(2 * n);
    std::uint64_t got = 0;
    while (got < n) {
      if (!have_) TIER_RETURN_IF_ERROR(next_record());
      const std::uint64_t t = std::min(count_ - consumed_, n - got);
      const std::uint64_t at = ca + got;
      TIER_RETURN_IF_ERROR(section(0, 0, consumed_ * 4, t * 4, OffloadedOptimizer::Impl::master(base, c) + at));
      for (int mo = 0; mo < 2; ++mo) {
        const auto kind = mo == 0 ? Section::kExpAvg : Section::kExpAvgSq;
        const DType fd = mo == 0 ? cpu::exp_avg_dtype(file_) : cpu::exp_avg_sq_dtype(file_);
        const std::size_t es = dtype_size(fd);
        if (!convert_) {
          std::byte* dst = OffloadedOptimizer::Impl::section(base, c, kind) + at * es;
          TIER_RETURN_IF_ERROR(section(1 + mo, moment_offset(mo), consumed_ * es, t * es, dst));
          if (file_ == cpu::StateDType::kInt8) {
            if (consumed_ % B != 0 || at % B != 0) {
              return data_loss(str("checkpoint ", path_, ": record ", records_ - 1, " (partition ", pid_,
                                   ") is not cut on int8 blocks; the file is corrupt"));
            }
            auto* sc = reinterpret_cast<float*>(OffloadedOptimizer::Impl::section(
                           base, c, mo == 0 ? Section::kExpAvgScales : Section::kExpAvgSqScales)) +
                       at / B;
            const std::uint64_t k = consumed_ / B;
            std::memcpy(sc, scales_[mo].data() + k, (cpu::state_scale_count(file_, consumed_ + t) - k) * 4);
          }
        } else {
          TIER_RETURN_IF_ERROR(moment_fp32(mo, fd, t, scratch_.data() + mo * n + got));
        }
      }
      consumed_ += t;
      got += t;
      if (consumed_ == count_) TIER_RETURN_IF_ERROR(end_record());
    }
    if (!convert_) return {};
    // Into the optimizer's format: the piece starts on a block (the optimizer's own layout).
    for (int mo = 0; mo < 2; ++mo) {
      const auto kind = mo == 0 ? Section::kExpAvg : Section::kExpAvgSq;
      const DType md = mo == 0 ? cpu::exp_avg_dtype(mine) : cpu::exp_avg_sq_dtype(mine);
      float* sc = nullptr;
      if (mine == cpu::StateDType::kInt8) {
        sc = reinterpret_cast<float*>(OffloadedOptimizer::Impl::section(
                 base, c, mo == 0 ? Section::kExpAvgScales : Section::kExpAvgSqScales)) +
             ca / B;
      }
      Status s = cpu::encode_state(
          mo == 0 ? cpu::StateMoment::kExpAvg : cpu::StateMoment::kExpAvgSq,
          cpu::ConstTensorRef(scratch_.data() + mo * n, DType::kF32, n),
          cpu::TensorRef{OffloadedOptimizer::Impl::section(base, c, kind) + ca * dtype_size(md), md, n}, sc);
      if (!s.ok()) {
        return s.with_context(str("checkpoint ", path_, ": converting its ", cpu::state_dtype_name(file_), " state to ",
                                  cpu::state_dtype_name(mine)));
      }
    }
    return {};
  }

  const OffloadedOptimizer::Impl& im_;
  bool convert_;
  std::vector<float> scratch_;
};

// A checkpoint file opened for reading: its header checked (magic, checksum, version, the
// metadata's size) and its metadata read, checked against its checksum and parsed; the values in
// it are check_meta's to check.
struct OpenedCheckpoint {
  std::unique_ptr<File> file;
  std::uint64_t size = 0;
  std::uint8_t header[kHeaderBytes] = {};
  std::uint32_t version = 0;
  std::uint64_t data_start = 0;  // the first record's byte
  json meta;
};

Result<OpenedCheckpoint> open_checkpoint(const std::string& path) {
  if (tier::detail::has_nul(path)) {
    return invalid_argument(str("checkpoint path '", tier::detail::printable(path.substr(0, 200)),
                                "' holds a NUL byte, which would cut it short; give a path without one"));
  }
  auto opened = FileSystem::current()->open(path, O_RDONLY | O_CLOEXEC);
  if (!opened.ok()) return opened.status().with_context(str("checkpoint ", path, ": cannot open it"));
  OpenedCheckpoint c;
  c.file = std::move(opened).value();
  File& f = *c.file;
  TIER_ASSIGN_OR_RETURN(const struct stat st, f.stat());
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < kHeaderBytes + kTrailerBytes) {
    return data_loss(str("checkpoint ", path, ": ", size, " bytes is too short to be a checkpoint; it is truncated"));
  }
  std::uint8_t* header = c.header;
  TIER_RETURN_IF_ERROR(read_exact(f, header, kHeaderBytes, 0, path));
  if (std::memcmp(header, kFileMagic, 8) != 0) {
    return data_loss(str("checkpoint ", path, ": not a tier optimizer checkpoint (bad magic)"));
  }
  if (get<std::uint32_t>(header, 60) != crc32c(header, 60)) {
    return data_loss(str("checkpoint ", path, ": the header fails its checksum; the file is corrupt"));
  }
  if (get<std::uint32_t>(header, 8) < kOldestVersion || get<std::uint32_t>(header, 8) > kVersion ||
      get<std::uint32_t>(header, 12) != kHeaderBytes) {
    return data_loss(str("checkpoint ", path, ": format version ", get<std::uint32_t>(header, 8),
                         " is not one this build reads (", kOldestVersion, " to ", kVersion, ")"));
  }
  const auto meta_bytes = get<std::uint64_t>(header, 16);
  if (meta_bytes > kMaxMetaBytes || kHeaderBytes + meta_bytes + kTrailerBytes > size) {
    return data_loss(str("checkpoint ", path, ": the metadata (", meta_bytes,
                         " bytes) does not fit in the file; it is "
                         "truncated or corrupt"));
  }
  std::string meta(meta_bytes, '\0');
  TIER_RETURN_IF_ERROR(read_exact(f, meta.data(), meta_bytes, kHeaderBytes, path));
  if (get<std::uint32_t>(header, 40) != crc32c(meta.data(), meta.size())) {
    return data_loss(str("checkpoint ", path, ": the metadata fails its checksum; the file is corrupt"));
  }
  c.meta = json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (c.meta.is_discarded()) return data_loss(str("checkpoint ", path, ": the metadata is not valid JSON"));
  c.size = size;
  c.version = get<std::uint32_t>(header, 8);
  c.data_start = kHeaderBytes + meta_bytes;
  return c;
}

// A file's partitions, from its checked metadata; the header's counts must agree with them.
Result<CheckpointInfo> info_of(const OpenedCheckpoint& in, const std::string& path) {
  TIER_ASSIGN_OR_RETURN(Restored r, check_meta(nullptr, in.meta, path));
  std::uint64_t total = 0;
  for (const CheckpointPartition& p : r.parts) {
    total += p.numel;  // each below 2^53: no overflow before the check
    if (total > static_cast<std::uint64_t>(kMaxCount)) {
      return data_loss(str("checkpoint ", path, ": the partitions hold more than 2^53 elements; the file is corrupt"));
    }
  }
  const auto elements = get<std::uint64_t>(in.header, 24);
  const auto partitions = get<std::uint64_t>(in.header, 32);
  if (elements != total || partitions != r.parts.size()) {
    return data_loss(str("checkpoint ", path, ": the header counts ", elements, " elements in ", partitions,
                         " partitions but the metadata lists ", total, " in ", r.parts.size(),
                         "; the file is corrupt"));
  }
  CheckpointInfo info;
  info.version = in.version;
  info.state_dtype = r.state_dtype;
  info.elements = total;
  info.partitions = std::move(r.parts);
  return info;
}

// read_checkpoint_masters' and read_checkpoint_state's walk: each record's sections in bounded
// pieces to the visitor, master first; the moments decoded to fp32 when `moments` is set, else
// read (with, in next_record, their int8 scales) only for their checksums.
class StateReader : public RecordStream {
 public:
  StateReader(const OpenedCheckpoint& in, std::string path, const CheckpointInfo& info)
      : RecordStream(*in.file, std::move(path), in.header, in.data_start, in.size, in.version, info.state_dtype,
                     numels_of(info.partitions)),
        parts_(info.partitions) {}

  Status run(const CheckpointStateVisitor& visit, bool moments) {
    std::vector<float> buf(kPiece);
    while (!done()) {
      TIER_RETURN_IF_ERROR(next_record());
      const CheckpointPartition& part = parts_[pid_];
      const std::uint64_t start = consumed_;
      while (consumed_ < count_) {
        const std::uint64_t t = std::min(count_ - consumed_, kPiece);
        TIER_RETURN_IF_ERROR(section(0, 0, consumed_ * 4, t * 4, buf.data()));
        TIER_RETURN_IF_ERROR(visit(part, StateKind::kMaster, offset_ + consumed_, buf.data(), t));
        consumed_ += t;
      }
      for (int mo = 0; mo < 2; ++mo) {
        const DType fd = mo == 0 ? cpu::exp_avg_dtype(file_) : cpu::exp_avg_sq_dtype(file_);
        if (moments) {
          const StateKind kind = mo == 0 ? StateKind::kExpAvg : StateKind::kExpAvgSq;
          for (consumed_ = start; consumed_ < count_;) {
            const std::uint64_t t = std::min(count_ - consumed_, kPiece);
            TIER_RETURN_IF_ERROR(moment_fp32(mo, fd, t, buf.data()));
            TIER_RETURN_IF_ERROR(visit(part, kind, offset_ + consumed_, buf.data(), t));
            consumed_ += t;
          }
          continue;
        }
        const std::uint64_t bytes = count_ * dtype_size(fd);
        for (std::uint64_t at = 0; at < bytes;) {
          const std::uint64_t b = std::min(bytes - at, kPiece * sizeof(float));
          TIER_RETURN_IF_ERROR(section(1 + mo, moment_offset(mo), at, b, buf.data()));
          at += b;
        }
      }
      TIER_RETURN_IF_ERROR(end_record());
    }
    return finish();
  }

 private:
  static constexpr std::uint64_t kPiece = 1 << 20;  // elements: a 4 MiB buffer

  const std::vector<CheckpointPartition>& parts_;
};

}  // namespace

Status OffloadedOptimizer::save_checkpoint(const std::string& path) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("save_checkpoint"));
  TIER_RETURN_IF_ERROR(im.idle("save_checkpoint"));
  if (path.empty()) return invalid_argument("optimizer save_checkpoint: empty path");
  // Model state is private to its owner, like the swap files; the temporary file is fresh and
  // unpredictably named, so nothing planted in the folder is written through.
  TIER_ASSIGN_OR_RETURN(tier::detail::AtomicFile out, tier::detail::AtomicFile::create(path, 0600, "checkpoint"));
  const std::string& tmp = out.temp_path();
  File& fd = out.file();

  const std::string meta = meta_json(im).dump();
  std::uint8_t header[kHeaderBytes] = {};
  std::memcpy(header, kFileMagic, 8);
  put<std::uint32_t>(header, 8, kVersion);
  put<std::uint32_t>(header, 12, kHeaderBytes);
  put<std::uint64_t>(header, 16, meta.size());
  put<std::uint64_t>(header, 24, im.numel_total);
  put<std::uint64_t>(header, 32, im.parts.size());
  put<std::uint32_t>(header, 40, crc32c(meta.data(), meta.size()));
  put<std::uint32_t>(header, 60, crc32c(header, 60));
  iovec hv[2] = {{header, kHeaderBytes}, {const_cast<char*>(meta.data()), meta.size()}};
  TIER_RETURN_IF_ERROR(write_all(fd, hv, 2, tmp));

  std::uint64_t records = 0, covered = 0;
  // Version 4: the chain starts from the header (which holds the metadata's checksum) and covers
  // each record's content checksums (chain_seed, chain_record).
  std::uint32_t chain = chain_seed(header, kVersion);
  // One record per partition piece of the chunk, its sections written from where they lie.
  const cpu::StateDType sd = im.state_dtype();
  const std::size_t elem_bytes[kSections] = {4, dtype_size(cpu::exp_avg_dtype(sd)),
                                             dtype_size(cpu::exp_avg_sq_dtype(sd)), 0, 0};
  auto write_chunk = [&](const Chunk& c, float* base) -> Status {
    // Masters held by the caller (master_source): into the record's master section first.
    if (im.external()) TIER_RETURN_IF_ERROR(im.fill_masters(c, base));
    struct LetGo {
      Impl& im;
      const Chunk& c;
      float* base;
      ~LetGo() {
        if (im.external()) im.settle_masters(c, base, /*put_back=*/false).ignore();
      }
    } let_go{im, c, base};
    for (PartitionId pid = c.first; pid <= c.last; ++pid) {
      const Partition& p = im.parts[pid];
      const std::uint64_t a = std::max(p.start, c.start);
      const std::uint64_t n = std::min(p.start + p.numel, c.start + c.numel) - a;
      const std::uint64_t ca = a - c.start;  // on a block boundary for int8 state
      const std::uint64_t nscales = cpu::state_scale_count(sd, n);
      iovec v[1 + kSections];
      std::uint8_t h[kRecordBytes] = {};
      std::memcpy(h, kRecordMagic, 4);
      put<std::uint32_t>(h, 4, pid);
      put<std::uint64_t>(h, 8, a - p.start);
      put<std::uint64_t>(h, 16, n);
      for (int s = 0; s < kSections; ++s) {
        std::byte* at = Impl::section(base, c, static_cast<Section>(s));
        const std::uint64_t bytes = s < 3 ? n * elem_bytes[s] : nscales * 4;
        at += s < 3 ? ca * elem_bytes[s] : ca / cpu::kStateBlock * 4;
        put<std::uint32_t>(h, 24 + 4 * s, crc32c(at, bytes));
        v[1 + s] = {at, bytes};
      }
      put<std::uint32_t>(h, 44, crc32c(h, 44));
      v[0] = {h, kRecordBytes};
      TIER_RETURN_IF_ERROR(write_all(fd, v, nscales ? 1 + kSections : 4, tmp));
      chain = chain_record(chain, h, kRecordBytes, kVersion);
      ++records;
      covered += n;
    }
    return {};
  };
  if (im.nvme()) {
    TIER_RETURN_IF_ERROR(detail::run_pipeline(
        *im.swap, im.chunks, im.bufs, true, false,
        [&](std::size_t i, Buffer& b) { return write_chunk(im.chunks[i], b.state); }, nullptr));
  } else {
    for (const Chunk& c : im.chunks) TIER_RETURN_IF_ERROR(write_chunk(c, c.host.get()));
  }
  std::uint8_t trailer[kTrailerBytes] = {};
  std::memcpy(trailer, kTrailerMagic, 8);
  put<std::uint64_t>(trailer, 8, records);
  put<std::uint64_t>(trailer, 16, covered);
  put<std::uint32_t>(trailer, 24, chain);
  put<std::uint32_t>(trailer, 28, crc32c(trailer, 28));
  iovec tv[1] = {{trailer, kTrailerBytes}};
  TIER_RETURN_IF_ERROR(write_all(fd, tv, 1, tmp));
  return out.commit();  // fsync, rename over `path`, fsync the directory
}

Status OffloadedOptimizer::load_checkpoint(const std::string& path, const std::function<Status()>& before_commit) {
  Impl& im = *impl_;
  TIER_RETURN_IF_ERROR(im.usable("load_checkpoint", /*loading=*/true));
  TIER_RETURN_IF_ERROR(im.idle("load_checkpoint"));
  TIER_ASSIGN_OR_RETURN(OpenedCheckpoint in, open_checkpoint(path));
  File& f = *in.file;
  const std::uint8_t* header = in.header;
  const std::uint64_t size = in.size;
  if (get<std::uint64_t>(header, 24) != im.numel_total) {
    return invalid_argument(str("checkpoint ", path, " holds ", get<std::uint64_t>(header, 24),
                                " elements but this optimizer has ", im.numel_total, "; it belongs to another model"));
  }
  TIER_ASSIGN_OR_RETURN(Restored restored, check_meta(&im, in.meta, path));
  const std::uint64_t data_start = in.data_start;
  const std::uint32_t version = in.version;

  if (im.nvme() && !im.once()) {
    // Into the shadow slots; switched over only when every record and the trailer checked out.
    RecordReader rd(im, f, path, header, data_start, size, version, restored.state_dtype);
    TIER_RETURN_IF_ERROR(detail::run_pipeline(
        *im.swap, im.chunks, im.bufs, false, true,
        [&](std::size_t i, Buffer& b) { return rd.fill(im.chunks[i], b.state); }, nullptr));
    TIER_RETURN_IF_ERROR(rd.finish());
    if (before_commit) TIER_RETURN_IF_ERROR(before_commit());
    for (Chunk& c : im.chunks) c.committed ^= 1;
  } else {
    // One copy of the state (host home, or NVMe with state_copies 1): verify the whole file
    // through a buffer first, then copy it in (NVMe: each chunk to a spare that becomes its slot
    // once written). A failure of the copy leaves a mix, which must not pass unnoticed.
    {
      RecordReader check(im, f, path, header, data_start, size, version, restored.state_dtype);
      for (const Chunk& c : im.chunks) TIER_RETURN_IF_ERROR(check.fill(c, im.bufs[0].state));
      TIER_RETURN_IF_ERROR(check.finish());
    }
    if (before_commit) TIER_RETURN_IF_ERROR(before_commit());
    RecordReader rd(im, f, path, header, data_start, size, version, restored.state_dtype);
    Status s;
    if (im.nvme()) {
      const std::function<void(std::size_t)> written = [&](std::size_t i) { im.commit_spare(im.chunks[i]); };
      s = detail::run_pipeline(
          *im.swap, im.chunks, im.bufs, false, true,
          [&](std::size_t i, Buffer& b) -> Status {
            if (!im.take_spare(im.chunks[i])) return internal_error("load_checkpoint: no spare slot");
            TIER_RETURN_IF_ERROR(rd.fill(im.chunks[i], b.state));
            if (!im.external()) return {};
            // The masters are the caller's: copied there now (a failure from here on leaves a
            // mix, reported below as for the state).
            TIER_RETURN_IF_ERROR(im.hold_masters(im.chunks[i]));
            return im.settle_masters(im.chunks[i], b.state, /*put_back=*/true);
          },
          nullptr, nullptr, nullptr, nullptr, &written);
      im.drop_spares();
    } else {
      for (const Chunk& c : im.chunks) {
        s = rd.fill(c, c.host.get());
        if (!s.ok()) break;
      }
    }
    if (s.ok()) s = rd.finish();
    if (!s.ok()) {
      im.state_invalid = s.with_context(
          "loading a checkpoint into the one copy of the state failed after it verified (the file changed while it "
          "was read, or a write failed); the state is partly overwritten: load a good checkpoint");
      return im.state_invalid;
    }
    im.done.assign(im.chunks.size(), 0);
    im.set_owed(nullptr);
  }
  im.state_invalid = Status();
  {
    std::lock_guard<std::mutex> groups_lock(im.groups_mu);
    for (std::size_t g = 0; g < im.groups.size(); ++g) {
      TIER_RETURN_IF_ERROR(im.groups[g].set_hyper_params(restored.hp[g]));
      TIER_RETURN_IF_ERROR(im.groups[g].set_step(restored.steps[g]));
    }
  }
  TIER_RETURN_IF_ERROR(im.scaler->restore(restored.scale));
  clear_grads();
  return {};
}

Result<CheckpointInfo> read_checkpoint_info(const std::string& path) {
  TIER_ASSIGN_OR_RETURN(OpenedCheckpoint in, open_checkpoint(path));
  return info_of(in, path);
}

Status read_checkpoint_masters(const std::string& path, const CheckpointMasterVisitor& visit) {
  if (!visit) return invalid_argument("read_checkpoint_masters: no visitor");
  TIER_ASSIGN_OR_RETURN(OpenedCheckpoint in, open_checkpoint(path));
  TIER_ASSIGN_OR_RETURN(CheckpointInfo info, info_of(in, path));
  return StateReader(in, path, info)
      .run([&](const CheckpointPartition& part, StateKind, std::uint64_t offset, const float* values,
               std::uint64_t count) { return visit(part, offset, values, count); },
           /*moments=*/false);
}

Status read_checkpoint_state(const std::string& path, const CheckpointStateVisitor& visit) {
  if (!visit) return invalid_argument("read_checkpoint_state: no visitor");
  TIER_ASSIGN_OR_RETURN(OpenedCheckpoint in, open_checkpoint(path));
  TIER_ASSIGN_OR_RETURN(CheckpointInfo info, info_of(in, path));
  return StateReader(in, path, info).run(visit, /*moments=*/true);
}

}  // namespace tier::optim
