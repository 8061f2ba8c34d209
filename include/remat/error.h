// remat::Error: every failure the library reports.
//
// The message is one line that names the bad value and what is allowed, e.g.
//   unknown policy 'atn'; allowed: none, full, attn, mlp-act, norm, mlp, save:, keep:, drop:, ...
// Library code only throws; the CLI's main catches and picks the exit code from kind().
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace remat {

class Error : public std::runtime_error {
 public:
  enum class Kind {
    Usage,    // bad input from the user (flag, policy string, config, file): exit code 2
    Runtime,  // a valid request that failed while running (I/O, NaN loss, ...): exit code 1
  };
  explicit Error(const std::string& message, Kind kind = Kind::Usage)
      : std::runtime_error(message), kind_(kind) {}
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

}  // namespace remat
