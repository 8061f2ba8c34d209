#include "remat/units.h"

#include <fmt/format.h>

namespace remat {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

namespace {

// `bytes` in its binary unit with `digits` decimals (-1: the unit's usual number).
std::string bytes_with(int64_t bytes, int digits) {
  const double b = static_cast<double>(bytes);
  const double a = b < 0 ? -b : b;
  if (a < 1024) return fmt::format("{} B", bytes);
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double scale = 1024;
  int u = 0;
  while (u < 3 && a >= scale * 1024) scale *= 1024, ++u;
  const int d = digits >= 0 ? digits : u < 2 ? 1 : 2;
  return fmt::format("{:.{}f} {}", b / scale, d, units[u]);
}

}  // namespace

std::string bytes_str(int64_t bytes) { return bytes_with(bytes, -1); }

std::pair<std::string, std::string> bytes_pair_str(int64_t a, int64_t b) {
  for (int d = -1; d <= 4; ++d) {
    std::string x = bytes_with(a, d), y = bytes_with(b, d);
    if (x != y || a == b) return {x, y};
    if (d == -1) d = 1;  // then 2, 3, 4 decimals
  }
  return {fmt::format("{} B", a), fmt::format("{} B", b)};
}

std::string seconds_str(double s) {
  if (s < 1) return fmt::format("{:.0f} ms", s * 1e3);
  if (s < 60) return fmt::format("{:.1f} s", s);
  if (s < 3600) return fmt::format("{:.1f} min", s / 60);
  if (s < 86400) return fmt::format("{:.1f} h", s / 3600);
  return fmt::format("{:.1f} days", s / 86400);
}

}  // namespace remat
