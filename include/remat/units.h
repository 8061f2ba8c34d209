// Sizes and times as people read them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

// "512 B", "2.0 MiB", "1.50 GiB", "2.54 TiB" (binary units).
std::string bytes_str(int64_t bytes);
// "(8, 128, 512)".
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace remat
