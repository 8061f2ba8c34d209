// Budgets: "300MiB", "2GB", "1.5GiB", "123456", "60%".
#include <cmath>
#include <cstdlib>
#include <utility>

#include "remat/error.h"
#include "remat/policy.h"
#include "remat/units.h"

namespace remat {

Budget parse_budget(std::string_view text) {
  Budget b;
  if (text.empty()) fail("empty budget; write e.g. 300MiB, 2GB, 1.5GiB or 60%");
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  const std::string_view unit = text.substr(i);
  char* end = nullptr;
  const double v = number.empty() || number.size() > 24 ? -1 : std::strtod(number.c_str(), &end);
  if (number.empty() || end != number.c_str() + number.size() || !(v > 0) || !std::isfinite(v))
    fail("bad budget '{}'; write a positive size such as 300MiB, 2GB, 1.5GiB or 60%", text);
  if (unit == "%") {
    if (v > 1000) fail("budget '{}' is over 1000% of none's memory; write at most 1000%", text);
    b.percent = v;
    return b;
  }
  static const std::pair<const char*, double> units[] = {
      {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      const double bytes = v * scale;
      if (bytes >= 0x1p62) fail("budget '{}' is too large; the most is {}", text, bytes_str(int64_t{1} << 62));
      b.bytes = static_cast<int64_t>(std::llround(bytes));
      if (b.bytes < 1) fail("budget '{}' rounds to 0 bytes; give at least 1 byte", text);
      return b;
    }
  fail("bad budget unit '{}' in '{}'; allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, %", unit, text);
}

std::string to_string(const Budget& b) {
  if (b.bytes > 0) return bytes_str(b.bytes);
  return fmt::format("{:g}% of none's activations and gradients (above weights, optimizer and data)", b.percent);
}

}  // namespace remat
