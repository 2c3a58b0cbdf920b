#include "tier/config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "core/config_schema.hpp"
#include "core/text.hpp"
#include "tier/ext/file_system.hpp"
#include "tier/units.hpp"

namespace tier {

using json = nlohmann::json;
using detail::KeySpec;
using detail::ValueKind;

const char* offload_device_name(OffloadDevice d) noexcept {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "unknown";
}

const char* io_engine_kind_name(IoEngineKind k) noexcept {
  switch (k) {
    case IoEngineKind::kAuto: return "auto";
    case IoEngineKind::kUring: return "uring";
    case IoEngineKind::kAio: return "aio";
    case IoEngineKind::kPosix: return "posix";
  }
  return "unknown";
}

const char* device_kind_name(DeviceKind k) noexcept {
  switch (k) {
    case DeviceKind::kAuto: return "auto";
    case DeviceKind::kCuda: return "cuda";
    case DeviceKind::kEmulated: return "emulated";
  }
  return "unknown";
}

const char* huge_page_mode_name(HugePageMode m) noexcept {
  switch (m) {
    case HugePageMode::kAuto: return "auto";
    case HugePageMode::kThp: return "thp";
    case HugePageMode::kHugetlbfs: return "hugetlbfs";
    case HugePageMode::kOff: return "off";
  }
  return "unknown";
}

namespace {

std::string shown(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return detail::printable(s);
}

Status bad_value(const KeySpec& spec, const json& v, const std::string& allowed = {}) {
  return invalid_argument(str("config key '", spec.path, "': ", shown(v),
                              " is not allowed; allowed: ", allowed.empty() ? spec.allowed() : allowed));
}

// A NUL byte cuts a path short where the system reads it (a swap path "/nvme\0/x" is "/nvme"):
// no config string may hold one.
Status check_no_nul(const KeySpec& spec, const std::string& text) {
  const auto at = text.find('\0');
  if (at == std::string::npos) return Status::Ok();
  return invalid_argument(str("config key '", spec.path, "': ", shown(json(text)), " holds a NUL byte at offset ", at,
                              ", which would cut a path short there; remove it"));
}

// An unknown key as a message quotes it: cut short, control bytes escaped (a config may hold
// anything, megabytes of it).
std::string shown_key(const std::string& path) {
  constexpr std::size_t kShown = 100;
  if (path.size() <= kShown) return detail::printable(path);
  return str(detail::printable(path.substr(0, kShown)), "... (", path.size(), " bytes)");
}

bool integral(double d) {
  return std::isfinite(d) && d == std::floor(d);
}

// Checks a value against its spec and returns it in normal form (sizes and integers as
// integers, enums lower-case, a lone string list as an array).
Result<json> normalize(const KeySpec& spec, const json& v) {
  auto in_range = [&](double d) { return d >= spec.min && d <= spec.max; };
  json out;
  switch (spec.kind) {
    case ValueKind::kObject:
    case ValueKind::kOpaque:
      if (!v.is_object()) return bad_value(spec, v);
      out = v;
      break;
    case ValueKind::kBool:
      if (!v.is_boolean()) return bad_value(spec, v);
      out = v;
      break;
    case ValueKind::kInt: {
      if (!v.is_number()) return bad_value(spec, v);
      const double d = v.get<double>();
      if (!integral(d) || !in_range(d)) return bad_value(spec, v);
      if (v.is_number_unsigned()) {
        out = v.get<std::uint64_t>();
      } else if (v.is_number_integer()) {
        out = v.get<std::int64_t>();
      } else {
        out = static_cast<std::int64_t>(d);
      }
      if (spec.multiple_of && out.get<std::int64_t>() % static_cast<std::int64_t>(spec.multiple_of) != 0) {
        return bad_value(spec, v);
      }
      break;
    }
    case ValueKind::kNumber:
      if (!v.is_number() || !std::isfinite(v.get<double>()) || !in_range(v.get<double>())) {
        return bad_value(spec, v);
      }
      out = v.get<double>();
      break;
    case ValueKind::kSize: {
      if (v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0)) {
        out = v.get<std::uint64_t>();
      } else if (v.is_number_float() && v.get<double>() >= 0 && integral(v.get<double>()) && v.get<double>() < 1.8e19) {
        out = static_cast<std::uint64_t>(v.get<double>());
      } else if (v.is_string()) {
        auto parsed = parse_size(v.get<std::string>());
        if (!parsed.ok()) return bad_value(spec, v);
        out = *parsed;
      } else {
        return bad_value(spec, v);
      }
      break;
    }
    case ValueKind::kString:
      if (!v.is_string()) return bad_value(spec, v);
      TIER_RETURN_IF_ERROR(check_no_nul(spec, v.get<std::string>()));
      out = v;
      break;
    case ValueKind::kEnum: {
      if (!v.is_string()) return bad_value(spec, v);
      const std::string s = detail::lower(v.get<std::string>());
      bool found = false;
      for (const auto& c : spec.choices) found = found || c == s;
      if (!found) {
        // A check may explain why a value is refused (an optimizer tier lacks, say).
        const std::string why = spec.check ? spec.check(json(s)) : std::string();
        return bad_value(spec, v, why);
      }
      out = s;
      break;
    }
    case ValueKind::kStringList: {
      if (v.is_string()) {
        out = json::array({v});
      } else if (v.is_array()) {
        for (const auto& e : v) {
          if (!e.is_string()) return bad_value(spec, v);
        }
        out = v;
      } else {
        return bad_value(spec, v);
      }
      for (const auto& e : out) TIER_RETURN_IF_ERROR(check_no_nul(spec, e.get<std::string>()));
      break;
    }
    case ValueKind::kPair: {
      if (!v.is_array() || v.size() != 2) return bad_value(spec, v);
      for (const auto& e : v) {
        if (!e.is_number() || !in_range(e.get<double>())) return bad_value(spec, v);
      }
      out = json::array({v[0].get<double>(), v[1].get<double>()});
      break;
    }
  }
  if (spec.check) {
    const std::string why = spec.check(out);
    if (!why.empty()) return bad_value(spec, v, why);
  }
  return out;
}

// Turns an environment string into the JSON a config file would hold for that key.
Result<json> env_to_json(const KeySpec& spec, const std::string& name, const std::string& text) {
  const std::string t = detail::trim(text);
  if (detail::lower(t) == "auto") return json("auto");
  switch (spec.kind) {
    case ValueKind::kBool: {
      const std::string l = detail::lower(t);
      if (l == "1" || l == "true" || l == "yes" || l == "on") return json(true);
      if (l == "0" || l == "false" || l == "no" || l == "off") return json(false);
      return invalid_argument(str("environment ", name, "='", detail::printable(text),
                                  "' is not allowed; allowed: 1/0, true/false, yes/no, on/off"));
    }
    case ValueKind::kInt:
    case ValueKind::kNumber: {
      char* end = nullptr;
      const double d = std::strtod(t.c_str(), &end);
      if (t.empty() || end == nullptr || *end != '\0') {
        return invalid_argument(
            str("environment ", name, "='", detail::printable(text), "' is not allowed; allowed: ", spec.allowed()));
      }
      return json(d);
    }
    case ValueKind::kStringList: {
      json arr = json::array();
      std::stringstream ss(t);
      std::string part;
      while (std::getline(ss, part, ',')) arr.push_back(detail::trim(part));
      return arr;
    }
    default: return json(t);
  }
}

struct Parser {
  EngineConfig cfg;
  bool strict = false;
  std::set<std::string> given;                                       // canonical paths set explicitly
  std::map<std::string, std::pair<std::string, json>> by_canonical;  // canonical -> (path, value)

  std::vector<std::string> children_of(const std::string& prefix) const {
    std::vector<std::string> names;
    for (const auto& k : detail::config_schema()) {
      if (k.path.empty()) continue;
      const auto dot = k.path.rfind('.');
      const std::string parent = dot == std::string::npos ? "" : k.path.substr(0, dot);
      if (parent == prefix) names.push_back(dot == std::string::npos ? k.path : k.path.substr(dot + 1));
    }
    return names;
  }

  Status unknown(const std::string& prefix, const std::string& key, const std::string& path) {
    // closest_match bounds its own work; a key far longer than any known one has no near match.
    const std::string guess = detail::closest_match(key, children_of(prefix));
    std::string msg = str("config key '", shown_key(path), "' is not known to tier or DeepSpeed");
    msg += guess.empty() ? "" : str("; did you mean '", prefix.empty() ? guess : prefix + "." + guess, "'?");
    const bool in_tier = path.rfind("tier.", 0) == 0;
    // DeepSpeed refuses unknown keys in zero_optimization (its config models forbid extras): a
    // typo there (offload_parm) would otherwise leave the params silently not offloaded.
    const bool in_zero = path.rfind("zero_optimization.", 0) == 0;
    if (strict || in_tier || in_zero) {
      return invalid_argument(msg + (in_tier || in_zero ? "" : " (strict mode: unknown keys are errors)"));
    }
    cfg.notes.push_back(msg + "; ignored");
    TIER_LOG(kWarn, "config: ", msg, "; ignored");
    return Status::Ok();
  }

  Status apply(const KeySpec& spec, json value, const std::string& origin) {
    if (value.is_string() && detail::lower(value.get<std::string>()) == "auto" && spec.kind != ValueKind::kString &&
        spec.kind != ValueKind::kStringList) {
      if (!spec.auto_ok) return bad_value(spec, value);
      cfg.auto_keys.push_back(spec.path);
      return store(spec, spec.auto_value, origin);  // the table's default needs no checking
    }
    TIER_ASSIGN_OR_RETURN(json norm, normalize(spec, value));
    return store(spec, std::move(norm), origin);
  }

  Status store(const KeySpec& spec, json norm, const std::string& origin) {
    const std::string& canon = spec.canonical_path();
    auto prev = by_canonical.find(canon);
    if (prev != by_canonical.end() && prev->second.first != spec.path && prev->second.second != norm &&
        spec.kind != ValueKind::kObject) {
      return invalid_argument(str("config key '", spec.path, "' (", shown(norm), ") conflicts with '",
                                  prev->second.first, "' (", shown(prev->second.second),
                                  "): they are the same setting; keep one"));
    }
    by_canonical[canon] = {spec.path, norm};
    given.insert(canon);
    if (spec.set) spec.set(cfg, norm);
    if (spec.treatment == detail::Treatment::kNoted) {
      // An alias's note says where its value goes; any other note says why tier does not act on it.
      cfg.notes.push_back(str(spec.path, spec.canonical.empty() ? ": accepted, not acted on: " : ": ", spec.note));
    }
    if (spec.kind == ValueKind::kObject) return walk(norm, spec.path);
    if (!origin.empty()) cfg.notes.push_back(str(spec.path, " = ", shown(norm), " (from ", origin, ")"));
    return Status::Ok();
  }

  Status walk(const json& obj, const std::string& prefix) {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      const std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
      const KeySpec* spec = detail::find_key_spec(path);
      if (spec == nullptr) {
        TIER_RETURN_IF_ERROR(unknown(prefix, it.key(), path));
        continue;
      }
      TIER_RETURN_IF_ERROR(apply(*spec, it.value(), ""));
    }
    return Status::Ok();
  }

  Status apply_env() {
    for (const auto& spec : detail::config_schema()) {
      if (spec.kind == ValueKind::kObject || spec.kind == ValueKind::kOpaque) continue;
      const std::string name = detail::env_name_for(spec);
      if (name.empty()) continue;
      const char* text = std::getenv(name.c_str());
      if (text == nullptr) continue;
      TIER_ASSIGN_OR_RETURN(json value, env_to_json(spec, name, text));
      by_canonical.erase(spec.canonical_path());  // the environment wins over the file
      TIER_RETURN_IF_ERROR(apply(spec, value, "environment " + name).with_context("environment " + name));
    }
    return Status::Ok();
  }

  // The scheduler's parameters against its type, as DeepSpeed's constructors take them.
  Status check_scheduler() {
    if (cfg.scheduler_json.empty()) return Status::Ok();
    const json sched = json::parse(cfg.scheduler_json);
    if (!sched.contains("type")) {
      cfg.notes.push_back("scheduler: no type given, so no schedule runs (as in DeepSpeed)");
      return Status::Ok();
    }
    static const std::map<std::string, std::pair<std::string, std::vector<std::string>>> kParams = {
        {"warmuplr",
         {"WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}}},
        {"warmupdecaylr",
         {"WarmupDecayLR",
          {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
           "last_batch_iteration"}}},
        {"warmupcosinelr",
         {"WarmupCosineLR",
          {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
           "last_batch_iteration"}}},
        {"onecycle",
         {"OneCycle",
          {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
           "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom",
           "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"}}},
        {"lrrangetest",
         {"LRRangeTest",
          {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase",
           "last_batch_iteration"}}},
    };
    const auto& [name, names] = kParams.at(detail::lower(sched["type"].get<std::string>()));
    const json params = sched.value("params", json::object());
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    for (auto it = params.begin(); it != params.end(); ++it) {
      const bool known = detail::find_key_spec("scheduler.params." + it.key()) != nullptr;
      if (known && std::find(names.begin(), names.end(), it.key()) == names.end()) {
        return invalid_argument(str("config key 'scheduler.params.", it.key(), "' does not apply to ", name,
                                    "; its parameters are: ", list));
      }
    }
    std::vector<std::string> required;
    if (name == "WarmupDecayLR" || name == "WarmupCosineLR") required = {"total_num_steps"};
    if (name == "OneCycle") required = {"cycle_min_lr", "cycle_max_lr"};
    for (const auto& r : required) {
      if (!params.contains(r)) {
        return invalid_argument(str("config key 'scheduler.params.", r, "' is missing: ", name,
                                    " needs it; set it (or \"auto\" to take it from the trainer)"));
      }
    }
    return Status::Ok();
  }

  void finish() {
    auto& opt = cfg.optimizer;
    if (!given.count("optimizer")) {
      cfg.notes.push_back(
          "optimizer: no section, so the client passes the optimizer (as in DeepSpeed): "
          "tier.torch.initialize(model, config, optimizer=torch.optim.AdamW(...)) takes Adam, AdamW or Adagrad; "
          "a program without one must add an \"optimizer\" section");
    }
    if (!given.count("optimizer.params.weight_decay")) {
      opt.weight_decay = opt.type == OptimizerType::kAdamW ? 0.01 : 0.0;
    }
    // Defaults of the other kinds where they differ from Adam's (DeepSpeed / torch / lion-pytorch).
    if (opt.type == OptimizerType::kAdagrad && !given.count("optimizer.params.eps")) opt.eps = 1e-10;
    if (opt.type == OptimizerType::kLion && !given.count("optimizer.params.betas")) {
      opt.beta1 = 0.9;
      opt.beta2 = 0.99;
    }
    if (opt.type == OptimizerType::kAdamW) {
      if (given.count("optimizer.params.adam_w_mode") && !opt.decoupled_weight_decay) {
        cfg.notes.push_back(
            "optimizer.params.adam_w_mode: false is ignored for AdamW, whose weight decay is "
            "always decoupled; use type Adam for L2 weight decay");
      }
      opt.decoupled_weight_decay = true;
    }
    if (cfg.offload_param.device != OffloadDevice::kNone && cfg.zero_stage < 3) {
      cfg.notes.push_back(
          str("zero_optimization.offload_param: DeepSpeed needs stage 3 for parameter offload; "
              "tier offloads parameters at stage ",
              cfg.zero_stage, " too (the stage only decides partitioning across ranks)"));
    }
  }
};

// Limits on a config document, checked before anything recursive touches it. DeepSpeed configs are
// a few KiB and four or five levels deep; a document far beyond either is not a config, and one
// nested tens of thousands of levels would overflow the stack while a message quotes it.
constexpr std::size_t kMaxConfigBytes = std::size_t{16} << 20;
constexpr int kMaxConfigDepth = 64;

// A SAX pass over the text that only counts nesting and keeps the first syntax error. The parser
// itself is iterative, so this runs in constant stack whatever the input.
class DepthCheck final : public nlohmann::json_sax<json> {
 public:
  bool too_deep = false;
  std::string syntax_error;

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool key(string_t&) override { return true; }
  bool start_object(std::size_t) override { return enter(); }
  bool start_array(std::size_t) override { return enter(); }
  bool end_object() override { return leave(); }
  bool end_array() override { return leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    syntax_error = e.what();
    return false;
  }

 private:
  int depth_ = 0;
  bool enter() {
    if (++depth_ > kMaxConfigDepth) too_deep = true;
    return !too_deep;
  }
  bool leave() {
    --depth_;
    return true;
  }
};

// Size, nesting and syntax of a config text, before it becomes a json tree.
Status check_config_text(std::string_view json_text) {
  if (json_text.size() > kMaxConfigBytes) {
    return invalid_argument(str("config is ", format_bytes(json_text.size()), " (", json_text.size(),
                                " bytes), over the limit of ", format_bytes(kMaxConfigBytes),
                                "; a DeepSpeed config is a few KiB: check that this is the config"));
  }
  DepthCheck check;
  const bool ok = json::sax_parse(json_text, &check, nlohmann::detail::input_format_t::json, /*strict=*/true,
                                  /*ignore_comments=*/true);
  if (check.too_deep) {
    return invalid_argument(str("config nests arrays and objects more than ", kMaxConfigDepth,
                                " levels deep, over the limit of ", kMaxConfigDepth,
                                "; a DeepSpeed config is a few levels deep: check that this is the config"));
  }
  if (!ok) return invalid_argument(str("config is not valid JSON: ", check.syntax_error));
  return Status::Ok();
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Reads a config file: a regular file of at most kMaxConfigBytes. Devices, FIFOs and the like are
// refused before a byte is read (O_NONBLOCK keeps the open of a FIFO without a writer from waiting).
// The layer's error as this reader words it ("cannot open it: <strerror>"); one without an errno
// (a NUL in the path) as the layer said it.
Status reworded(const Status& s, std::string_view what) {
  return s.sys_errno() != 0 ? errno_status(s.sys_errno(), what) : s;
}

Result<std::string> read_config_file(const std::string& path) {
  auto opened = FileSystem::current()->open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (!opened.ok()) return reworded(opened.status(), "cannot open it");
  File& f = **opened;
  auto stated = f.stat();
  if (!stated.ok()) return reworded(stated.status(), "fstat");
  const struct stat st = *stated;
  if (!S_ISREG(st.st_mode)) {
    return invalid_argument(str("is ", file_kind(st.st_mode), "; give the path of a JSON file"));
  }
  if (static_cast<std::uint64_t>(st.st_size) > kMaxConfigBytes) {
    return invalid_argument(str("is ", format_bytes(static_cast<std::uint64_t>(st.st_size)), " (", st.st_size,
                                " bytes), over the limit of ", format_bytes(kMaxConfigBytes),
                                "; a DeepSpeed config is a few KiB: check that this is the config"));
  }
  // Read one byte past the limit so that a file growing while it is read is caught too.
  std::string text(static_cast<std::size_t>(st.st_size) + 1, '\0');
  std::size_t got = 0;
  for (;;) {
    if (got == text.size()) {
      if (text.size() > kMaxConfigBytes) {
        return invalid_argument(str("grew past the limit of ", format_bytes(kMaxConfigBytes), " while being read"));
      }
      text.resize(std::min(text.size() * 2, kMaxConfigBytes + 1));
    }
    auto n = f.pread(text.data() + got, text.size() - got, got);
    if (!n.ok()) return reworded(n.status(), "read");
    if (*n == 0) break;
    got += *n;
  }
  text.resize(got);
  return text;
}

}  // namespace

Result<EngineConfig> EngineConfig::from_json(std::string_view json_text, const ConfigOptions& options) {
  TIER_RETURN_IF_ERROR(check_config_text(json_text));
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false,
                         /*ignore_comments=*/true);
  if (doc.is_discarded()) {
    // Re-parse with exceptions on to get the position of the error.
    std::string where;
    try {
      const json ignored = json::parse(json_text.begin(), json_text.end(), nullptr, true, true);
    } catch (const json::parse_error& e) {
      where = e.what();
    }
    return invalid_argument(str("config is not valid JSON: ", where));
  }
  if (!doc.is_object()) {
    return invalid_argument(str("config must be a JSON object, got ", shown(doc)));
  }
  Parser p;
  p.strict = options.strict;
  if (auto t = doc.find("tier"); t != doc.end() && t->is_object()) {
    if (auto s = t->find("strict"); s != t->end() && s->is_boolean()) p.strict = p.strict || s->get<bool>();
  }
  TIER_RETURN_IF_ERROR(p.walk(doc, ""));
  if (options.apply_env) TIER_RETURN_IF_ERROR(p.apply_env());
  TIER_RETURN_IF_ERROR(p.check_scheduler());
  p.finish();
  TIER_RETURN_IF_ERROR(p.cfg.validate());
  return std::move(p.cfg);
}

Result<EngineConfig> EngineConfig::from_file(const std::string& path, const ConfigOptions& options) {
  auto text = read_config_file(path);
  if (!text.ok()) return text.status().with_context(str("config file '", path, "'"));
  auto cfg = from_json(*text, options);
  if (!cfg.ok()) return cfg.status().with_context(str("config file '", path, "'"));
  return cfg;
}

Status EngineConfig::validate() const {
  auto needs_path = [&](const char* section, OffloadDevice dev, const std::string& p) -> Status {
    if (dev == OffloadDevice::kNvme && p.empty() && tier.swap_paths.empty()) {
      return invalid_argument(str("config key 'zero_optimization.", section,
                                  ".nvme_path' is missing: device is 'nvme'; set nvme_path (or tier.swap_paths) "
                                  "to a directory on an SSD"));
    }
    return Status::Ok();
  };
  TIER_RETURN_IF_ERROR(needs_path("offload_param", offload_param.device, offload_param.nvme_path));
  TIER_RETURN_IF_ERROR(needs_path("offload_optimizer", offload_optimizer.device, offload_optimizer.nvme_path));
  if (tier.nvme_budget != 0 && resolved_swap_paths().empty()) {
    // The engine would refuse it at creation; say so at the same point as every other check.
    return invalid_argument(
        "config key 'tier.budgets.nvme' is set but there is no NVMe directory: set tier.swap_paths or an "
        "offload nvme_path, or drop the NVMe budget");
  }
  if (fp16.enabled && bf16) {
    return invalid_argument("config keys 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one");
  }
  if (zero_stage < 0 || zero_stage > 3) {
    return invalid_argument(
        str("config key 'zero_optimization.stage': ", zero_stage, " is not allowed; allowed: 0 to 3"));
  }
  if (aio.block_size < 4096 || aio.block_size % 4096 != 0) {
    return invalid_argument(
        str("config key 'aio.block_size': ", aio.block_size, " is not allowed; allowed: a multiple of 4096"));
  }
  if (aio.queue_depth < 1) return invalid_argument("config key 'aio.queue_depth' must be at least 1");
  if (gradient_accumulation_steps < 1) {
    return invalid_argument("config key 'gradient_accumulation_steps' must be at least 1");
  }
  if (!(gradient_clipping >= 0)) return invalid_argument("config key 'gradient_clipping' must be >= 0");
  if (!(optimizer.lr >= 0) || !(optimizer.eps >= 0) || !(optimizer.beta1 >= 0 && optimizer.beta1 < 1) ||
      !(optimizer.beta2 >= 0 && optimizer.beta2 < 1) || !(optimizer.weight_decay >= 0)) {
    return invalid_argument(
        str("config key 'optimizer.params': lr, eps and weight_decay must be >= 0 and betas in "
            "[0, 1); got lr=",
            optimizer.lr, " betas=[", optimizer.beta1, ", ", optimizer.beta2, "] eps=", optimizer.eps,
            " weight_decay=", optimizer.weight_decay));
  }
  if (!(optimizer.min_coeff >= 0 && optimizer.min_coeff <= optimizer.max_coeff)) {
    return invalid_argument(str("config keys 'optimizer.params.min_coeff' (", optimizer.min_coeff,
                                ") and 'optimizer.params.max_coeff' (", optimizer.max_coeff,
                                ") must satisfy 0 <= min_coeff <= max_coeff"));
  }
  for (const auto& p : tier.swap_paths) {
    if (p.empty()) return invalid_argument("config key 'tier.swap_paths' holds an empty path");
  }
  return Status::Ok();
}

std::string EngineConfig::to_json(int indent) const {
  json out = json::object();
  for (const auto& spec : detail::config_schema()) {
    if (!spec.get || !spec.canonical.empty()) continue;
    json value = spec.get(*this);
    if (value.is_null()) continue;
    json* node = &out;
    std::stringstream ss(spec.path);
    std::string part;
    std::vector<std::string> parts;
    while (std::getline(ss, part, '.')) parts.push_back(part);
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) node = &(*node)[parts[i]];
    (*node)[parts.back()] = std::move(value);
  }
  return out.dump(indent);
}

std::vector<std::string> EngineConfig::resolved_swap_paths() const {
  std::vector<std::string> out = tier.swap_paths;
  auto add = [&](const std::string& p) {
    if (p.empty()) return;
    for (const auto& q : out) {
      if (q == p) return;
    }
    out.push_back(p);
  };
  if (out.empty()) {
    add(offload_param.nvme_path);
    add(offload_optimizer.nvme_path);
  }
  return out;
}

}  // namespace tier
