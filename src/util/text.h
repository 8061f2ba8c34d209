// Text shared by the parsers (internal): a list split into its fields.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace remat {

// `text` cut at every `sep`, empty fields kept so that a caller can refuse them: "a,,b" gives
// {"a", "", "b"}, "a," gives {"a", ""}, "" gives {""}.
inline std::vector<std::string> split_fields(std::string_view text, char sep) {
  std::vector<std::string> fields;
  for (size_t at = 0;;) {
    const size_t end = text.find(sep, at);
    fields.emplace_back(text.substr(at, end == std::string_view::npos ? std::string_view::npos : end - at));
    if (end == std::string_view::npos) return fields;
    at = end + 1;
  }
}

}  // namespace remat
