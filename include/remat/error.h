// remat::Error: every failure the library reports.
//
// The message is one line that names the bad value, as the API spells it, and what is allowed:
//   ModelConfig.layers must be a positive integer, got 0
//   unknown policy term 'atn' in 'atn'; allowed: none, full, attn, mlp-act, ...
// Library code only throws. The CLI's main catches, rewrites API names into its flags
// (ModelConfig.layers -> --layers) and picks the exit code from kind().
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace remat {

class Error : public std::runtime_error {
 public:
  enum class Kind {
    Usage,     // bad input from the user (an option, a policy string, a config, a file): exit code 2
    Runtime,   // a valid request that failed while running (I/O, a NaN loss, ...): exit code 1
    Internal,  // a broken invariant of remat's own (a bug to report), with its file and line: exit code 1
  };
  explicit Error(const std::string& message, Kind kind = Kind::Usage) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Throws a Usage error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...), Error::Kind::Usage);
}

// Throws a Runtime error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail_runtime(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...), Error::Kind::Runtime);
}

// Throws an Internal error: "internal error at src/x.cpp:42: MESSAGE". Use REMAT_INTERNAL.
template <typename... Args>
[[noreturn]] void fail_internal(const char* file, int line, fmt::format_string<Args...> format, Args&&... args) {
  const char* src = std::strstr(file, "/src/");  // the path from the source tree's root
  throw Error(fmt::format("internal error at {}:{}: {}", src != nullptr ? src + 1 : file, line,
                          fmt::format(format, std::forward<Args>(args)...)),
              Error::Kind::Internal);
}

}  // namespace remat

// A broken invariant of remat's own, named with the file and line that found it.
#define REMAT_INTERNAL(...) ::remat::fail_internal(__FILE__, __LINE__, __VA_ARGS__)
