#include "util/cache.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

namespace remat::detail {

std::string cache_folder(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* c = std::getenv("REMAT_CACHE")) return c;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return std::string(x) + "/remat";
  if (const char* h = std::getenv("HOME")) return std::string(h) + "/.cache/remat";
  return ".remat-cache";
}

std::string build_identity() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown-build";
  const auto size = std::filesystem::file_size(exe, ec);
  const auto time = std::filesystem::last_write_time(exe, ec).time_since_epoch().count();
  return fmt::format("{}:{}:{}", exe.string(), size, time);
}

std::string cpu_model(const std::string& cpuinfo, const blas::CpuFeatures& cpu) {
  std::ifstream info(cpuinfo);
  if (!info) return "unknown cpu";
  // The first processor's lines: a VM's model name is often only the vendor's line ("AMD EPYC"),
  // shared by CPUs that run a GEMM at different rates, and may hide vector units it has.
  std::string name = "unknown cpu", family, model, stepping;
  auto value = [](const std::string& line) {
    const size_t colon = line.find(':');
    const size_t start = colon == std::string::npos ? std::string::npos : line.find_first_not_of(' ', colon + 1);
    return start == std::string::npos ? std::string("?") : line.substr(start);
  };
  for (std::string line; std::getline(info, line) && !line.empty();) {
    const std::string key = line.substr(0, line.find_first_of("\t:"));
    if (key == "model name") name = value(line);
    if (key == "cpu family") family = value(line);
    if (key == "model") model = value(line);
    if (key == "stepping") stepping = value(line);
  }
  if (family.empty()) return name;
  std::string vectors;
  for (const auto& [has, unit] : {std::pair{cpu.avx2, "avx2"}, std::pair{cpu.fma, "fma"},
                                  std::pair{cpu.avx512, "avx512"}, std::pair{cpu.avx512_bf16, "avx512_bf16"}})
    if (has) vectors += (vectors.empty() ? "" : " ") + std::string(unit);
  return fmt::format("{} (family {}, model {}, stepping {}; {})", name, family, model.empty() ? "?" : model,
                     stepping.empty() ? "?" : stepping, vectors.empty() ? "no avx2" : vectors);
}

}  // namespace remat::detail
