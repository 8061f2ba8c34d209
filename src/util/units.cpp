#include "remat/units.h"

#include <fmt/format.h>

namespace remat {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

std::string bytes_str(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = b < 0 ? -b : b;
  if (a < 1024) return fmt::format("{} B", bytes);
  if (a < 1024.0 * 1024) return fmt::format("{:.1f} KiB", b / 1024);
  if (a < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (a < 1024.0 * 1024 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  return fmt::format("{:.2f} TiB", b / (1024.0 * 1024 * 1024 * 1024));
}

}  // namespace remat
