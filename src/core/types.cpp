#include "tier/types.hpp"

#include <algorithm>
#include <cctype>
#include <limits>

#include "core/text.hpp"

namespace tier {

const char* tier_name(Tier t) noexcept {
  switch (t) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

Result<Tier> parse_tier(std::string_view text) {
  const std::string s = detail::lower(text);
  if (s == "device" || s == "gpu" || s == "cuda") return Tier::kDevice;
  if (s == "host" || s == "cpu") return Tier::kHost;
  if (s == "nvme" || s == "disk") return Tier::kNvme;
  return invalid_argument(str("tier '", text, "' is not one of: device, host, nvme"));
}

const char* link_name(Link l) noexcept {
  switch (l) {
    case Link::kNvmeToHost: return "nvme_to_host";
    case Link::kHostToNvme: return "host_to_nvme";
    case Link::kHostToDevice: return "host_to_device";
    case Link::kDeviceToHost: return "device_to_host";
  }
  return "unknown";
}

std::size_t dtype_size(DType d) noexcept {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF64: return 8;
    case DType::kI8: return 1;
    case DType::kU8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

const char* dtype_name(DType d) noexcept {
  switch (d) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF64: return "fp64";
    case DType::kI8: return "int8";
    case DType::kU8: return "uint8";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
  }
  return "unknown";
}

Result<DType> parse_dtype(std::string_view text) {
  const std::string s = detail::lower(text);
  if (s == "fp32" || s == "float32" || s == "f32" || s == "float") return DType::kF32;
  if (s == "fp16" || s == "float16" || s == "f16" || s == "half") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp64" || s == "float64" || s == "f64" || s == "double") return DType::kF64;
  if (s == "int8" || s == "i8") return DType::kI8;
  if (s == "uint8" || s == "u8") return DType::kU8;
  if (s == "int32" || s == "i32") return DType::kI32;
  if (s == "int64" || s == "i64") return DType::kI64;
  return invalid_argument(str("dtype '", text, "' is not one of: fp32, fp16, bf16, fp64, int8, uint8, int32, int64"));
}

const char* role_name(Role r) noexcept {
  switch (r) {
    case Role::kParam: return "param";
    case Role::kGrad: return "grad";
    case Role::kMaster: return "master";
    case Role::kExpAvg: return "exp_avg";
    case Role::kExpAvgSq: return "exp_avg_sq";
    case Role::kUser: return "user";
    case Role::kActivation: return "activation";
  }
  return "unknown";
}

Result<Role> parse_role(std::string_view text) {
  const std::string s = detail::lower(text);
  if (s == "param" || s == "parameter") return Role::kParam;
  if (s == "grad" || s == "gradient") return Role::kGrad;
  if (s == "master" || s == "fp32_master") return Role::kMaster;
  if (s == "exp_avg") return Role::kExpAvg;
  if (s == "exp_avg_sq") return Role::kExpAvgSq;
  if (s == "user") return Role::kUser;
  if (s == "activation") return Role::kActivation;
  return invalid_argument(
      str("role '", text, "' is not one of: param, grad, master, exp_avg, exp_avg_sq, user, activation"));
}

Status TensorDesc::validate() const {
  if (name.empty()) return invalid_argument("tensor descriptor: name is empty");
  if (std::any_of(name.begin(), name.end(), [](unsigned char c) { return std::iscntrl(c) != 0; })) {
    return invalid_argument(str("tensor '", detail::printable(name), "': name contains control characters"));
  }
  if (numel == 0) return invalid_argument(str("tensor '", name, "': numel is 0; register at least one element"));
  if (numel > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / dtype_size(dtype)) {
    return invalid_argument(
        str("tensor '", name, "': numel ", numel, " of ", dtype_name(dtype), " overflows a 63-bit byte count"));
  }
  return Status::Ok();
}

}  // namespace tier
