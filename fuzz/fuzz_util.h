// Shared pieces of the libFuzzer targets (fuzz/*.cpp; `make fuzz`). A target may throw only
// remat::Error, the library's refusal of bad input: anything else (another exception, a crash, a
// sanitizer report, a hang) is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "remat/error.h"

namespace remat::fuzz {

// Runs `f`, swallowing remat::Error (a refusal is the right answer to bad input).
template <typename F>
void refuses_or_runs(F f) {
  try {
    f();
  } catch (const Error&) {}
}

inline std::string text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace remat::fuzz
