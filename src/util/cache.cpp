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

std::string cpu_model() {
  if (std::ifstream info("/proc/cpuinfo"); info)
    for (std::string line; std::getline(info, line);)
      if (line.rfind("model name", 0) == 0) {
        const size_t colon = line.find(':');
        const size_t start = line.find_first_not_of(' ', colon + 1);
        return start == std::string::npos ? "unknown cpu" : line.substr(start);
      }
  return "unknown cpu";
}

}  // namespace remat::detail
