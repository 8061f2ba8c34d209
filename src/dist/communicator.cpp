// Communicator: a c10d ProcessGroupGloo over a c10d TCPStore rendezvous (NOTE [Data parallelism]).
#include <atomic>
#include <cstdlib>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "remat/data_parallel.h"
#include "remat/error.h"

namespace remat {

namespace {

using Clock = std::chrono::steady_clock;

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi)
    fail("environment variable {}='{}' must be an integer in [{}, {}]", name, v, lo, hi);
  return static_cast<int>(x);
}

// "Connection reset by peer" and the like, first line only, for one-line errors.
std::string first_line(const std::exception& e) {
  std::string s = e.what();
  return s.substr(0, s.find('\n'));
}

}  // namespace

DistConfig dist_config_from_env() {
  DistConfig d;
  d.world = env_int("WORLD_SIZE", 1, 1, 1 << 16);
  d.rank = env_int("RANK", 0, 0, d.world - 1);
  d.local_rank = env_int("LOCAL_RANK", d.rank, 0, 1 << 16);
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') d.master_addr = a;
  d.master_port = env_int("MASTER_PORT", d.master_port, 1, 65535);
  return d;
}

void validate(const DistConfig& d) {
  if (d.world < 1) fail("DistConfig.world must be >= 1, got {}", d.world);
  if (d.rank < 0 || d.rank >= d.world)
    fail("DistConfig.rank {} must be in [0, {}) for world size {}", d.rank, d.world, d.world);
  if (d.master_port <= 0 || d.master_port > 65535)
    fail("DistConfig.master_port must be in 1..65535, got {}", d.master_port);
  if (d.timeout.count() <= 0) fail("DistConfig.timeout must be positive, got {} s", d.timeout.count());
  if (d.master_addr.empty()) fail("DistConfig.master_addr is empty; give the address rank 0 listens on");
}

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  Clock::time_point start = Clock::now();
};

struct Communicator::Pending::State {
  c10::intrusive_ptr<c10d::Work> work;
  std::string what;
  Clock::time_point start;  // the communicator's, copied: a Pending may outlive it
  std::atomic<double> finished{-1};
  double since_start() const { return std::chrono::duration<double>(Clock::now() - start).count(); }
};

Communicator::Communicator(const DistConfig& config) : impl_(std::make_unique<Impl>()), config_(config) {
  validate(config_);
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(config_.timeout);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(config_.master_port);
    so.isServer = config_.rank == 0;
    so.numWorkers = config_.world;
    so.waitWorkers = true;
    so.timeout = timeout;
    impl_->store = c10::make_intrusive<c10d::TCPStore>(config_.master_addr, so);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    const bool local = config_.master_addr == "127.0.0.1" || config_.master_addr == "localhost";
    options->devices.push_back(local ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                     : c10d::ProcessGroupGloo::createDefaultDevice());
    impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, config_.rank, config_.world, options);
  } catch (const std::exception& e) {
    fail_runtime("rank {} of {}: no rendezvous with rank 0 at {}:{} within {} s ({})", config_.rank, config_.world,
                 config_.master_addr, config_.master_port, config_.timeout.count(), first_line(e));
  }
}

Communicator::~Communicator() = default;

double Communicator::now() const { return std::chrono::duration<double>(Clock::now() - impl_->start).count(); }

void Communicator::Pending::wait() {
  if (!state_) return;
  try {
    state_->work->wait();
  } catch (const std::exception& e) {
    fail_runtime("{} failed: a rank is gone or did not answer within the timeout ({})", state_->what, first_line(e));
  }
  if (state_->finished.load() < 0) state_->finished = state_->since_start();  // the callback has not run yet
  finished_at = state_->finished.load();
}

bool Communicator::Pending::done() const { return !state_ || state_->work->isCompleted(); }

namespace {

// A rank a collective names (a root, a peer): one of the group's.
void check_rank(int r, int world, const char* role, const std::string& what) {
  if (r < 0 || r >= world) fail("{}: {} rank {} is not one of the group's 0..{}", what, role, r, world - 1);
}

// A tensor a collective moves: defined, contiguous, on the CPU (Gloo's).
void check_tensor(const at::Tensor& t, const std::string& what) {
  if (!t.defined()) fail("{}: a collective takes a defined tensor", what);
  if (!t.device().is_cpu() || !t.is_contiguous())
    fail("{}: Gloo's collectives here take a contiguous CPU tensor; this one is on {} (contiguous={})", what,
         t.device().str(), t.is_contiguous());
}

}  // namespace

Communicator::Pending Communicator::all_reduce(at::Tensor& t, const std::string& what) {
  check_tensor(t, what);
  Pending p;
  p.state_ = std::make_shared<Pending::State>();
  p.state_->what = what;
  p.state_->start = impl_->start;
  p.launched_at = now();
  std::vector<at::Tensor> tensors = {t};
  p.state_->work = impl_->group->allreduce(tensors);
  std::weak_ptr<Pending::State> weak = p.state_;
  p.state_->work->getFuture()->addCallback([weak](c10::ivalue::Future&) {
    if (auto s = weak.lock()) s->finished = s->since_start();
  });
  return p;
}

void Communicator::broadcast(at::Tensor& t, int root, const std::string& what) {
  check_tensor(t, what);
  check_rank(root, world(), "root", what);
  std::vector<at::Tensor> tensors = {t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  try {
    impl_->group->broadcast(tensors, o)->wait();
  } catch (const std::exception& e) {
    fail_runtime("{} failed: a rank is gone or did not answer within the timeout ({})", what, first_line(e));
  }
}

void Communicator::send(at::Tensor& t, int to, int tag, const std::string& what) {
  check_tensor(t, what);
  check_rank(to, world(), "destination", what);
  std::vector<at::Tensor> tensors = {t};
  try {
    impl_->group->send(tensors, to, tag)->wait();
  } catch (const std::exception& e) {
    fail_runtime("{} failed: a rank is gone or did not answer within the timeout ({})", what, first_line(e));
  }
}

void Communicator::recv(at::Tensor& t, int from, int tag, const std::string& what) {
  check_tensor(t, what);
  check_rank(from, world(), "source", what);
  std::vector<at::Tensor> tensors = {t};
  try {
    impl_->group->recv(tensors, from, tag)->wait();
  } catch (const std::exception& e) {
    fail_runtime("{} failed: a rank is gone or did not answer within the timeout ({})", what, first_line(e));
  }
}

void Communicator::barrier(const std::string& what) {
  try {
    impl_->group->barrier()->wait();
  } catch (const std::exception& e) {
    fail_runtime("{} failed: a rank is gone or did not answer within the timeout ({})", what, first_line(e));
  }
}

}  // namespace remat
