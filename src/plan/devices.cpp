// Devices for planning: vendor figures of the common training GPUs, this machine's CPU, and any
// other as custom:... or a JSON file.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/layout.h"
#include "remat/policy.h"
#include "remat/runtime.h"
#include "remat/units.h"
#include "util/paths.h"
#include "util/text.h"

namespace remat {

namespace {

constexpr int64_t MiB = int64_t{1} << 20;
constexpr int64_t kMaxDeviceFile = MiB;  // a device's JSON is a few hundred bytes

// Memory is the total the driver reports (nvidia-smi, MiB); rates are the dense peaks of the SXM
// parts' data sheets; links are NVLink per direction and one InfiniBand port per GPU (DGX).
const Device kPresets[] = {
    {"h100-80gb", 81559 * MiB, 989, 67, 3350, 450, 50, 8, 0.7, 0.8, 0.7,
     "NVIDIA H100 SXM5 data sheet: 989 TFLOPS bf16 dense, 67 fp32, 3.35 TB/s HBM3, NVLink 900 GB/s (450 each way); "
     "NDR 400 Gb/s per GPU (DGX H100); 81559 MiB as nvidia-smi reports",
     false, 90},
    {"h100-96gb", 97320 * MiB, 989, 67, 3350, 450, 50, 8, 0.7, 0.8, 0.7,
     "NVIDIA H100 96GB (Grand Teton): H100 SXM5 rates, 989 TFLOPS bf16 dense, 67 fp32, 3.35 TB/s, NVLink 900 GB/s "
     "(450 each way); 400 Gb/s RDMA per GPU; 97320 MiB as PyTorch reports (torchtitan's logs: 95.04 GiB)",
     false, 90},
    {"h200-141gb", 143771 * MiB, 989, 67, 4800, 450, 50, 8, 0.7, 0.8, 0.7,
     "NVIDIA H200 SXM data sheet: 989 TFLOPS bf16 dense, 67 fp32, 4.8 TB/s HBM3e, NVLink 900 GB/s (450 each way); "
     "NDR 400 Gb/s per GPU; 143771 MiB as nvidia-smi reports",
     false, 90},
    {"a100-80gb", 81920 * MiB, 312, 19.5, 2039, 300, 25, 8, 0.7, 0.8, 0.7,
     "NVIDIA A100 SXM4 80GB data sheet: 312 TFLOPS bf16 dense, 19.5 fp32, 2.04 TB/s HBM2e, NVLink 600 GB/s (300 each "
     "way); HDR 200 Gb/s per GPU (DGX A100); 81920 MiB as nvidia-smi reports",
     false, 80},
    {"a100-40gb", 40960 * MiB, 312, 19.5, 1555, 300, 25, 8, 0.7, 0.8, 0.7,
     "NVIDIA A100 SXM4 40GB data sheet: 312 TFLOPS bf16 dense, 19.5 fp32, 1.56 TB/s HBM2, NVLink 600 GB/s (300 each "
     "way); HDR 200 Gb/s per GPU (DGX A100); 40960 MiB as nvidia-smi reports",
     false, 80},
};

Device this_cpu() {
  const ThreadConfig threads = default_threads();
  const MachineRates r = calibrated_rates(threads);
  Device d;
  d.name = "cpu";
  // The machine's memory, not what is free this moment (remat train's usable_memory): a plan sizes
  // the machine's runs, and layout.h's kCpuReserve leaves the system its share.
  d.memory = physical_memory();
  d.fp32_tflops = r.matmul_gflops / 1e3;
  d.bf16_tflops = 0;  // the engine runs fp32 only
  d.hbm_gbps = r.memory_gbps;
  d.gpus_per_node = 1;
  d.matmul_efficiency = d.memory_efficiency = d.link_efficiency = 1.0;  // measured rates, not peaks
  d.engine = true;
  d.sm = 0;
  d.source = fmt::format(
      "this machine, measured once and saved (calibrated_rates): fp32 GEMM {:.0f} GFLOP/s, memory "
      "{:.1f} GB/s, threads {}; memory from /proc/meminfo",
      r.matmul_gflops, r.memory_gbps, to_string(threads));
  return d;
}

double positive(const std::string& text, const std::string& what, std::string_view whole) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !(v > 0) || !std::isfinite(v))
    fail("bad --device '{}': {} must be a positive number, got '{}'", whole, what, text);
  return v;
}

// A count in 1..kMostGpus written as a whole number ("8", not "8.5" or "1e30").
int64_t gpu_count(const std::string& text, const std::string& what, std::string_view whole) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || v < 1 || v > kMostGpus)
    fail("bad --device '{}': {} must be a whole number in 1..{}, got '{}'", whole, what, kMostGpus, text);
  return v;
}

// A rate beyond this (TFLOPS or GB/s) is a thousand times any GPU's: an exponent typed by mistake,
// which would plan every step as free.
constexpr double kMostRate = 1e6;

void check(const Device& d, std::string_view whole) {
  if (d.memory <= 0) fail("bad --device '{}': memory must be a positive number of bytes, got {}", whole, d.memory);
  for (const auto& [rate, name] : {std::pair{d.bf16_tflops, "bf16_tflops"}, std::pair{d.fp32_tflops, "fp32_tflops"},
                                   std::pair{d.hbm_gbps, "hbm_gbps"}, std::pair{d.intra_gbps, "intra_gbps"},
                                   std::pair{d.inter_gbps, "inter_gbps"}})
    if (rate > kMostRate)
      fail("bad --device '{}': {} must be at most {:g} (a thousand times any GPU's), got {:g}", whole, name, kMostRate,
           rate);
  if (!(d.bf16_tflops > 0) && !(d.fp32_tflops > 0))
    fail("bad --device '{}': give bf16_tflops or fp32_tflops > 0, got {:g} and {:g}", whole, d.bf16_tflops,
         d.fp32_tflops);
  if (!(d.hbm_gbps > 0)) fail("bad --device '{}': hbm_gbps must be positive, got {:g}", whole, d.hbm_gbps);
  if (d.gpus_per_node < 1 || d.gpus_per_node > kMostGpus)
    fail("bad --device '{}': gpus_per_node must be in 1..{}, got {}", whole, kMostGpus, d.gpus_per_node);
  for (const auto& [e, name] :
       {std::pair{d.matmul_efficiency, "matmul_efficiency"}, std::pair{d.memory_efficiency, "memory_efficiency"},
        std::pair{d.link_efficiency, "link_efficiency"}})
    if (!(e > 0 && e <= 1)) fail("bad --device '{}': {} must be in (0, 1], got {:g}", whole, name, e);
}

Device custom(std::string_view text) {
  const std::vector<std::string> parts = split_fields(text.substr(7), ',');  // "custom:80GiB,900,3000," has 4
  const bool empty_field = std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); });
  if (parts.size() < 3 || parts.size() > 6 || empty_field)
    fail(
        "bad --device '{}'; write custom:MEM,TFLOPS,GBPS[,INTRA_GBPS[,INTER_GBPS[,GPUS_PER_NODE]]], e.g. "
        "custom:96GiB,700,3000,400,50,8",
        text);
  Device d;
  d.name = std::string(text);
  Budget mem;
  try {
    mem = parse_budget(parts[0]);
  } catch (const Error&) {  // refused below as a device's memory, not as a budget
    mem.bytes = 0;
  }
  if (mem.bytes <= 0) fail("bad --device '{}': memory must be a size such as 96GiB, got '{}'", text, parts[0]);
  d.memory = mem.bytes;
  d.bf16_tflops = positive(parts[1], "TFLOPS (dense bf16)", text);
  d.fp32_tflops = d.bf16_tflops / 16;  // an assumption, printed: the fp32 rate of the presets' kind
  d.hbm_gbps = positive(parts[2], "GBPS (memory bandwidth)", text);
  d.intra_gbps = parts.size() > 3 ? positive(parts[3], "INTRA_GBPS", text) : d.hbm_gbps / 8;
  d.inter_gbps = parts.size() > 4 ? positive(parts[4], "INTER_GBPS", text) : d.intra_gbps / 8;
  d.gpus_per_node = parts.size() > 5 ? gpu_count(parts[5], "GPUS_PER_NODE", text) : 8;
  d.source = fmt::format("given on the command line{}; fp32 assumed at 1/16 of bf16",
                         parts.size() < 5 ? ", link rates assumed (NVLink = HBM / 8, network = NVLink / 8)" : "");
  check(d, text);
  return d;
}

Device from_file(std::string_view path) {
  struct stat st;
  if (::stat(std::string(path).c_str(), &st) != 0)
    fail("--device '{}' is neither a preset ({}), custom:..., nor a readable JSON file", path, [] {
      std::string s;
      for (const std::string& n : device_names()) s += (s.empty() ? "" : ", ") + n;
      return s;
    }());
  const std::string text = read_regular_file("--device", std::string(path), kMaxDeviceFile);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("--device file '{}' is not JSON: {}", path, e.what());
  }
  if (!j.is_object()) fail("--device file '{}' must hold one JSON object with Device's fields", path);
  Device d;
  d.name = std::string(path);
  d.source = fmt::format("from {}", path);
  static const char* known[] = {
      "name",       "memory",        "bf16_tflops",       "fp32_tflops",       "hbm_gbps",        "intra_gbps",
      "inter_gbps", "gpus_per_node", "matmul_efficiency", "memory_efficiency", "link_efficiency", "source",
      "sm"};
  try {
    for (const auto& [key, value] : j.items()) {
      bool ok = false;
      for (const char* k : known) ok = ok || key == k;
      if (!ok)
        fail(
            "--device file '{}': unknown field '{}'; allowed: name, memory (bytes or \"80GiB\"), bf16_tflops, "
            "fp32_tflops, hbm_gbps, intra_gbps, inter_gbps, gpus_per_node, matmul_efficiency, memory_efficiency, "
            "link_efficiency, source, sm",
            path, key);
    }
    if (j.contains("name")) d.name = j.at("name").get<std::string>();
    if (!j.contains("memory")) fail("--device file '{}' has no \"memory\"", path);
    // Whole numbers only: a float's conversion to an integer past its range is undefined.
    auto integer = [&](const char* k) {
      const nlohmann::json& v = j.at(k);
      if (!v.is_number_integer()) fail("--device file '{}': \"{}\" must be a whole number, got {}", path, k, v.dump());
      return v.get<int64_t>();
    };
    d.memory = j.at("memory").is_string() ? parse_budget(j.at("memory").get<std::string>()).bytes : integer("memory");
    auto num = [&](const char* k, double& v) {
      if (j.contains(k)) v = j.at(k).get<double>();
    };
    num("bf16_tflops", d.bf16_tflops);
    num("fp32_tflops", d.fp32_tflops);
    num("hbm_gbps", d.hbm_gbps);
    num("intra_gbps", d.intra_gbps);
    num("inter_gbps", d.inter_gbps);
    num("matmul_efficiency", d.matmul_efficiency);
    num("memory_efficiency", d.memory_efficiency);
    num("link_efficiency", d.link_efficiency);
    if (j.contains("gpus_per_node")) d.gpus_per_node = integer("gpus_per_node");
    if (j.contains("sm")) {
      const int64_t sm = integer("sm");
      if (sm < 0 || sm > 1000) fail("--device file '{}': \"sm\" is a compute capability such as 90, got {}", path, sm);
      d.sm = static_cast<int>(sm);
    }
    if (j.contains("source")) d.source = j.at("source").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    fail("--device file '{}': a field has the wrong type ({})", path, e.what());
  }
  // Rates left out get the assumptions custom: states, named in the plan's header.
  std::vector<std::string> assumed;
  if (!(d.fp32_tflops > 0) && d.bf16_tflops > 0)
    d.fp32_tflops = d.bf16_tflops / 16, assumed.push_back("fp32 = bf16 / 16");
  if (!(d.intra_gbps > 0) && d.hbm_gbps > 0)
    d.intra_gbps = d.hbm_gbps / 8, assumed.push_back("intra_gbps = hbm_gbps / 8");
  if (!(d.inter_gbps > 0) && d.intra_gbps > 0)
    d.inter_gbps = d.intra_gbps / 8, assumed.push_back("inter_gbps = intra_gbps / 8");
  if (!assumed.empty()) d.source += fmt::format(" (not in the file, assumed: {})", fmt::join(assumed, ", "));
  check(d, path);
  return d;
}

}  // namespace

double Device::matmul_gflops(DType dtype) const {
  const double peak = dtype == DType::F32 ? fp32_tflops : bf16_tflops;
  if (!(peak > 0))
    fail("device '{}' has no {} matmul rate; plan another --dtype or give the rate", name, to_string(dtype));
  return peak * 1e3 * matmul_efficiency;
}

std::vector<std::string> device_names() {
  std::vector<std::string> v;
  for (const Device& d : kPresets) v.push_back(d.name);
  v.emplace_back("cpu");
  return v;
}

Device parse_device(std::string_view text) {
  for (const Device& d : kPresets)
    if (text == d.name) return d;
  if (text == "cpu") return this_cpu();
  if (text.rfind("custom:", 0) == 0) return custom(text);
  return from_file(text);
}

}  // namespace remat
