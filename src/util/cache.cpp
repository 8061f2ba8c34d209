#include "util/cache.h"

#include <sys/utsname.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "remat/error.h"
#include "remat/runtime.h"
#include "util/paths.h"

namespace remat::detail {

std::string cache_folder(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* c = std::getenv("REMAT_CACHE")) return c;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return std::string(x) + "/remat";
  if (const char* h = std::getenv("HOME")) return std::string(h) + "/.cache/remat";
  return ".remat-cache";
}

namespace {
std::atomic<bool> g_remeasure{false};
}  // namespace

std::optional<nlohmann::json> read_cached_json(const std::string& path, std::string* why) {
  if (remeasuring()) return std::nullopt;                 // measured again, then replaced
  constexpr int64_t kMostCacheBytes = int64_t{16} << 20;  // a calibration is a few KiB
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(path, ec))) return std::nullopt;
  try {
    return nlohmann::json::parse(read_regular_file("cache", path, kMostCacheBytes, "a cache is a regular file"));
  } catch (const std::exception& e) {
    if (why != nullptr) *why = e.what();
    return std::nullopt;
  }
}

std::string build_identity() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown-build";
  const auto size = std::filesystem::file_size(exe, ec);
  const auto time = std::filesystem::last_write_time(exe, ec).time_since_epoch().count();
  return fmt::format("{}:{}:{}", exe.string(), size, time);
}

namespace {

// The first processor's lines of a /proc/cpuinfo, by key ("model name", "cpu family", ...), values
// without their leading blanks ("" for none); the first processor speaks for the machine. A key
// given twice keeps its last value. `readable` is false when the file cannot be opened.
struct FirstProcessor {
  bool readable = false;
  std::map<std::string, std::string> fields;
  bool has(const std::string& key) const { return fields.count(key) > 0; }
  std::string get(const std::string& key) const {
    const auto it = fields.find(key);
    return it == fields.end() ? std::string() : it->second;
  }
};

FirstProcessor first_processor(const std::string& cpuinfo) {
  FirstProcessor p;
  std::ifstream info(cpuinfo);
  if (!info) return p;
  p.readable = true;
  for (std::string line; std::getline(info, line) && !line.empty();) {
    const size_t colon = line.find(':');
    const std::string key = line.substr(0, colon);
    const size_t key_end = key.find_last_not_of(" \t");
    const size_t start = colon == std::string::npos ? std::string::npos : line.find_first_not_of(" \t", colon + 1);
    p.fields.insert_or_assign(key.substr(0, key_end == std::string::npos ? 0 : key_end + 1),
                              start == std::string::npos ? std::string() : line.substr(start));
  }
  return p;
}

// Letters and digits kept, anything else '_'; "x" for nothing.
std::string folder_safe(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s.empty() ? "x" : s;
}

}  // namespace

std::string cpu_model(const std::string& cpuinfo, const blas::CpuFeatures& cpu) {
  const FirstProcessor p = first_processor(cpuinfo);
  if (!p.readable) return "unknown cpu";
  auto shown = [&](const std::string& key) { return p.get(key).empty() ? std::string("?") : p.get(key); };
  // A VM's model name is often only the vendor's line ("AMD EPYC"), shared by CPUs that run a GEMM
  // at different rates, and may hide vector units it has: family, model, stepping and the units.
  const std::string name = p.has("model name") ? shown("model name") : "unknown cpu";
  if (!p.has("cpu family")) {  // not x86: an Arm core names itself by implementer, part and revision
    if (!p.has("CPU implementer") && !p.has("CPU part")) return name;
    return fmt::format("{} (implementer {}, part {}, variant {}, revision {})", name, shown("CPU implementer"),
                       shown("CPU part"), shown("CPU variant"), shown("CPU revision"));
  }
  std::string vectors;
  for (const auto& [has, unit] : {std::pair{cpu.avx2, "avx2"}, std::pair{cpu.fma, "fma"},
                                  std::pair{cpu.avx512, "avx512"}, std::pair{cpu.avx512_bf16, "avx512_bf16"}})
    if (has) vectors += (vectors.empty() ? "" : " ") + std::string(unit);
  return fmt::format("{} (family {}, model {}, stepping {}; {})", name, shown("cpu family"), shown("model"),
                     shown("stepping"), vectors.empty() ? "no avx2" : vectors);
}

std::string cpu_kind(const std::string& cpuinfo, const blas::CpuFeatures& cpu, const std::string& arch) {
  const FirstProcessor p = first_processor(cpuinfo);
  if (!p.readable) fail_runtime("cannot read {}: the kind of CPU is named from its first processor", cpuinfo);
  if (!p.has("cpu family"))
    return fmt::format("{}-{}-{}", folder_safe(arch), folder_safe(p.get("CPU implementer")),
                       folder_safe(p.get("CPU part")));
  const std::string vendor = p.get("vendor_id");
  const std::string maker = vendor == "GenuineIntel"   ? "intel"
                            : vendor == "AuthenticAMD" ? "amd"
                                                       : "x86_" + folder_safe(vendor);
  return fmt::format("{}-{}-{}-{}", maker, folder_safe(p.get("cpu family")), folder_safe(p.get("model")),
                     cpu.avx512 ? "avx512"
                     : cpu.avx2 ? "avx2"
                                : "sse");
}

std::string machine_architecture() {
  struct utsname u {};
  return uname(&u) == 0 ? std::string(u.machine) : std::string("unknown");
}

}  // namespace remat::detail

namespace remat {
void set_remeasure(bool on) { detail::g_remeasure.store(on, std::memory_order_relaxed); }
bool remeasuring() { return detail::g_remeasure.load(std::memory_order_relaxed); }
}  // namespace remat
