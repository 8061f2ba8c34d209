#include "app/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <optional>
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
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

// The signal that asked the launcher to stop (SIGINT, SIGTERM, SIGHUP), or 0, and how many came.
volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_signals = 0;
void on_stop(int sig) {
  g_stop = sig;
  g_signals = g_signals + 1;
}

// One rank as the launcher sees it: its process, its stderr, and how it ended.
struct Rank {
  pid_t pid = -1;
  int err = -1;            // read end of its stderr
  std::string partial;     // a line not yet ended
  std::string last_error;  // its last "remat: error: ..." line, held back until its end is known
  std::optional<int> status;
  bool stopped = false;    // the launcher signalled it: however it then ends, no failure of its own
  bool told_stop = false;  // it wrote where a stop left the run (the leader)
};

constexpr std::string_view kError = "remat: error: ", kStopped = "remat: stopped ";

// Passes a rank's finished lines on; its error lines are kept (the launcher reports one failure).
// The leader's line on a stop (where its state is saved) always passes.
void forward(Rank& r, bool quiet) {
  size_t at;
  while ((at = r.partial.find('\n')) != std::string::npos) {
    std::string line = r.partial.substr(0, at);
    r.partial.erase(0, at + 1);
    if (line.rfind(kError, 0) == 0) {
      r.last_error = line.substr(kError.size());
    } else if (!quiet || line.rfind(kStopped, 0) == 0) {
      fmt::print(stderr, "{}\n", line);
      if (line.rfind(kStopped, 0) == 0) r.told_stop = true;
    }
  }
}

// Reads what the ranks wrote to stderr for up to `ms`.
void drain(std::vector<Rank>& ranks, int ms, bool quiet) {
  std::vector<pollfd> fds;
  for (const Rank& r : ranks)
    if (r.err >= 0) fds.push_back({r.err, POLLIN, 0});
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), ms) <= 0) return;
  for (const pollfd& p : fds) {
    if (!(p.revents & (POLLIN | POLLHUP))) continue;
    for (Rank& r : ranks) {
      if (r.err != p.fd) continue;
      char buf[4096];
      const ssize_t n = ::read(r.err, buf, sizeof buf);
      if (n > 0) {
        r.partial.append(buf, static_cast<size_t>(n));
        forward(r, quiet);
      } else if (n == 0 || errno != EINTR) {
        ::close(r.err);
        r.err = -1;
      }
    }
  }
}

// Collects the ends of ranks that have ended; returns how many are still running.
int reap(std::vector<Rank>& ranks) {
  int running = 0;
  for (Rank& r : ranks) {
    if (r.status) continue;
    int status = 0;
    if (::waitpid(r.pid, &status, WNOHANG) == r.pid)
      r.status = status;
    else
      ++running;
  }
  return running;
}

bool failed(const Rank& r) { return r.status && !(WIFEXITED(*r.status) && WEXITSTATUS(*r.status) == 0); }

// The signal a rank stopped at (it exited with 128 + SIGINT, SIGTERM or SIGHUP after its step and
// the save: the whole run stops so), or 0.
int stopped_at(const Rank& r) {
  if (!r.status || !WIFEXITED(*r.status)) return 0;
  const int sig = WEXITSTATUS(*r.status) - 128;
  return sig == SIGINT || sig == SIGTERM || sig == SIGHUP ? sig : 0;
}

// A rank that ended in failure, not a stop.
bool broke(const Rank& r) { return failed(r) && stopped_at(r) == 0; }

void kill_all(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks)
    if (r.pid > 0 && !r.status) {
      ::kill(r.pid, sig);
      r.stopped = true;
    }
}

// The signals that stop a run.
sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  return set;
}

// SIGKILL to the ranks still running; returns when every rank has ended.
void kill_and_wait(std::vector<Rank>& ranks) {
  kill_all(ranks, SIGKILL);
  for (Rank& r : ranks) {
    if (r.status) continue;
    int status = 0;
    while (::waitpid(r.pid, &status, 0) < 0 && errno == EINTR) {}
    r.status = status;
  }
}

// Forks rank k, its stderr into a pipe, with the environment c10d reads. A rank never outlives
// its launcher, however the launcher ends (kill -9 included). Its arguments and environment are
// made before the fork: the launcher has threads (LibTorch's, the BLAS's), and the child may only
// make async-signal-safe calls until it execs.
void start_rank(std::vector<Rank>& ranks, int k, int port, const std::vector<std::string>& args) {
  const pid_t launcher = ::getpid();
  std::vector<std::string> env_text = {"RANK=" + std::to_string(k),
                                       "LOCAL_RANK=" + std::to_string(k),
                                       "WORLD_SIZE=" + std::to_string(ranks.size()),
                                       "MASTER_ADDR=127.0.0.1",
                                       "MASTER_PORT=" + std::to_string(port),
                                       std::string(kLauncherPidVariable) + "=" + std::to_string(launcher)};
  const size_t own = env_text.size();
  const auto ours = [&](const char* entry) {  // a variable set above, not passed on from this process
    for (size_t i = 0; i < own; ++i)
      if (std::strncmp(entry, env_text[i].c_str(), env_text[i].find('=') + 1) == 0) return true;
    return false;
  };
  for (char** e = environ; *e != nullptr; ++e)
    if (!ours(*e)) env_text.emplace_back(*e);
  std::vector<char*> envp, argv;
  for (std::string& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
    kill_all(ranks, SIGKILL);
    fail_runtime("cannot start rank {}: {}", k, std::strerror(errno));
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    kill_all(ranks, SIGKILL);
    fail_runtime("cannot start rank {}: {}", k, std::strerror(errno));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed outright takes its ranks with it
    if (::getppid() != launcher) ::_exit(1);
    // A stop signal waits (pending) until the rank's handler is in place: unblock_stop_signals.
    const sigset_t stops = stop_signals();
    ::sigprocmask(SIG_BLOCK, &stops, nullptr);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::execve("/proc/self/exe", argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  ranks[k].pid = pid;
  ranks[k].err = pipe_fds[0];
}

// Ctrl-C, kill and a closed terminal stop the ranks too, while this lives.
class StopSignals {
 public:
  StopSignals() {
    g_stop = 0, g_signals = 0;  // a signal that stopped an earlier launch does not stop this one
    struct sigaction sa {};
    sa.sa_handler = on_stop;
    // A signal the launcher was started ignoring (nohup's SIGHUP, a background job's SIGINT) stays
    // ignored, as its ranks (which inherit that) ignore it.
    for (auto [sig, old] : {std::pair{SIGINT, &old_int_}, {SIGTERM, &old_term_}, {SIGHUP, &old_hup_}})
      if (::sigaction(sig, nullptr, old) == 0 && old->sa_handler != SIG_IGN) ::sigaction(sig, &sa, nullptr);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGHUP, &old_hup_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_hup_{};
};

// A failure: stop the others, quietly (their errors are the failure's echo), with SIGTERM, then
// SIGKILL after `grace`. Returns when every rank has ended.
void stop_ranks(std::vector<Rank>& ranks, std::chrono::seconds grace) {
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the failure's cause may end a moment later
  reap(ranks);
  kill_all(ranks, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (reap(ranks) > 0 && std::chrono::steady_clock::now() < deadline) drain(ranks, 20, true);
  kill_and_wait(ranks);
}

// A stop signal: passed on to every rank once; each finishes its step, saves (--save) and exits
// 128 + the signal. A second signal, or a rank that ends in failure (and `grace` after it), ends
// the rest at once (SIGKILL). Returns when every rank has ended.
void stop_ranks_after_step(std::vector<Rank>& ranks, int stop, std::chrono::seconds grace) {
  kill_all(ranks, stop);
  std::optional<std::chrono::steady_clock::time_point> deadline;
  while (reap(ranks) > 0 && g_signals < 2) {
    drain(ranks, 20, true);
    if (!deadline && std::any_of(ranks.begin(), ranks.end(), broke))
      deadline = std::chrono::steady_clock::now() + grace;
    if (deadline && std::chrono::steady_clock::now() > *deadline) break;
  }
  kill_and_wait(ranks);
}

// The cause of a failed run: a rank killed by a signal the launcher did not send (the others'
// errors are its echo), else the first that failed of itself; nullptr when every rank succeeded.
const Rank* failure_cause(const std::vector<Rank>& ranks) {
  for (const Rank& r : ranks)
    if (failed(r) && WIFSIGNALED(*r.status) && !r.stopped) return &r;
  for (const Rank& r : ranks)
    if (failed(r) && !r.stopped) return &r;
  return nullptr;
}

}  // namespace

void unblock_stop_signals() {
  const sigset_t stops = stop_signals();
  ::sigprocmask(SIG_UNBLOCK, &stops, nullptr);
}

pid_t launcher_pid() {
  const char* v = std::getenv(kLauncherPidVariable);
  return v == nullptr ? 0 : static_cast<pid_t>(std::atol(v));
}

int launch_local(int nproc, const std::vector<std::string>& args, std::chrono::seconds grace,
                 const std::function<void(const std::string&)>& say) {
  const int port = free_port();
  std::vector<Rank> ranks(nproc);
  for (int k = 0; k < nproc; ++k) start_rank(ranks, k, port, args);
  int stop = 0;
  {
    const StopSignals signals;
    int running = nproc;
    // A rank that stops (a signal of its own) is followed by the others after the same step.
    while (running > 0 && !g_stop) {
      drain(ranks, 50, false);
      running = reap(ranks);
      if (std::any_of(ranks.begin(), ranks.end(), broke)) break;
    }
    stop = g_stop;
    if (running > 0 && stop != 0)
      stop_ranks_after_step(ranks, stop, grace);
    else if (running > 0)
      stop_ranks(ranks, grace);
    const bool quiet = stop != 0 || std::any_of(ranks.begin(), ranks.end(), failed);
    while (std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.err >= 0; })) drain(ranks, 20, quiet);
  }
  if (std::none_of(ranks.begin(), ranks.end(), failed)) return 0;  // the signal came as they finished
  int ranks_stop = 0;  // the signal the ranks stopped at (they say where), which the exit code gives
  for (const Rank& r : ranks)
    if ((ranks_stop = stopped_at(r)) != 0) break;
  if (stop == 0 && std::none_of(ranks.begin(), ranks.end(), broke)) stop = ranks_stop;  // followed by the rest
  if (stop != 0) {
    for (const Rank& r : ranks)  // a rank that failed while the run stopped (its save, say)
      if (broke(r) && !r.last_error.empty()) {
        say(fmt::format("rank {} (pid {}) {}: {}; the run was stopping on signal {} ({})", &r - ranks.data(), r.pid,
                        how_it_ended(*r.status), r.last_error, stop, strsignal(stop)));
        return WIFEXITED(*r.status) ? WEXITSTATUS(*r.status) : 1;
      }
    if (ranks_stop != 0) stop = ranks_stop;
    if (std::none_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.told_stop; }))
      say(
          fmt::format("stopped by signal {} ({}); the {} ranks ended before the stop's save (the last saved state "
                      "stands)",
                      stop, strsignal(stop), nproc));
    return 128 + stop;
  }
  const Rank* cause = failure_cause(ranks);
  if (cause == nullptr) return 0;
  const int k = static_cast<int>(cause - ranks.data());
  say(fmt::format("rank {} (pid {}) {}{}; the other {} rank(s) were stopped", k, cause->pid,
                  how_it_ended(*cause->status), cause->last_error.empty() ? "" : ": " + cause->last_error, nproc - 1));
  return WIFEXITED(*cause->status) ? WEXITSTATUS(*cause->status) : 1;
}

}  // namespace remat
