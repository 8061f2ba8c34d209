#include "app/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "remat/error.h"

namespace remat {

namespace {

// A port that nothing listens on now (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail_runtime("cannot open a socket to find a free port: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t n = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) {
    const int err = errno;
    ::close(fd);
    fail_runtime("cannot find a free port on 127.0.0.1: {}", std::strerror(err));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string how_it_ended(int status) {
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& args, std::chrono::seconds grace,
                 const std::function<void(const std::string&)>& say) {
  const int port = free_port();
  std::vector<pid_t> pids(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
      fail_runtime("cannot start rank {}: {}", r, std::strerror(errno));
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      ::_exit(127);
    }
    pids[r] = pid;
  }
  int code = 0;
  for (int left = nproc; left > 0;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    int r = 0;
    while (r < nproc && pids[r] != pid) ++r;
    if (r == nproc) continue;
    pids[r] = -1;
    --left;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (ok || code != 0) continue;
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (left == 0) break;
    say(fmt::format("rank {} (pid {}) {}; stopping the other {} rank(s)", r, pid, how_it_ended(status), left));
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGTERM);
    // Give them `grace` to go, then make sure.
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (left > 0 && std::chrono::steady_clock::now() < deadline) {
      const pid_t done = ::waitpid(-1, &status, WNOHANG);
      if (done > 0) {
        for (pid_t& p : pids)
          if (p == done) p = -1;
        --left;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGKILL);
  }
  return code;
}

}  // namespace remat
