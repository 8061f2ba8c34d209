// Sizes and times as people read them.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace remat {

// "512 B", "2.0 MiB", "1.50 GiB", "2.54 TiB" (binary units).
std::string bytes_str(int64_t bytes);
// The two sizes with as many digits as it takes to tell them apart: "882.30 MiB" and "882.31 MiB",
// or exact bytes ("925163520 B") when a few decimals do not.
std::pair<std::string, std::string> bytes_pair_str(int64_t a, int64_t b);
// "850 ms", "12.4 s", "3.2 min", "4.5 h", "17.8 days".
std::string seconds_str(double seconds);
// "(8, 128, 512)".
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace remat
