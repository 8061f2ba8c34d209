#include "util/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace remat::detail {

namespace {

// Spins one iteration of a wait loop, telling the CPU (and a hypervisor) that it is a wait.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

thread_local bool t_inside = false;  // set while this thread runs chunks of a job
thread_local int t_worker = 0;       // this thread's number in the pool: 0 for callers

class Pool {
 public:
  ~Pool() { resize(1); }

  // NOTE [Kernel threads awake]: while awake() > 0, idle workers poll for the next job and the
  // caller polls for the end of its job instead of both sleeping on a condition variable.
  std::atomic<int>& awake() { return awake_; }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      posted_.store(++generation_, std::memory_order_release);
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
    workers_.clear();
    stop_ = false;
    for (int i = 1; i < std::max(1, threads); ++i)
      workers_.emplace_back([this, i] {
        // A process's asynchronous signals (Ctrl-C, kill) are handled on the application's
        // threads, never here: a worker runs oneDNN's JIT GEMMs, which move the stack pointer into
        // a heap buffer, and the frame a handler gets would be written below it, into the heap.
        sigset_t async;
        sigfillset(&async);
        for (int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) sigdelset(&async, fault);
        pthread_sigmask(SIG_BLOCK, &async, nullptr);
        t_worker = i;
        work();
      });
  }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    const int64_t chunks = (n + grain - 1) / grain;
    if (!busy.owns_lock() || workers_.empty() || chunks <= 1 || t_inside) {
      for (int64_t c = 0; c < chunks; ++c) fn(c * grain, std::min(n, (c + 1) * grain));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      grain_ = grain;
      chunks_ = chunks;
      next_.store(0);
      done_ = 0;
      failed_.store(false);
      error_ = nullptr;
      posted_.store(++generation_, std::memory_order_release);
    }
    wake_.notify_all();
    const int64_t mine = chunks_run();
    while (awake_.load(std::memory_order_relaxed) > 0 && !(done_.load() + mine == chunks_ && active_.load() == 0))
      relax();
    std::unique_lock<std::mutex> lock(mutex_);
    done_ += mine;
    // Every chunk done and every worker that joined gone: none can touch this job after we return.
    finished_.wait(lock, [&] { return done_ == chunks_ && active_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // Takes chunks until none is left; returns how many this thread took. Once a chunk has thrown,
  // the chunks taken after that is seen are counted but not run; of the chunks that threw, the
  // lowest one's exception is kept for run(), so which one the caller gets does not depend on timing.
  int64_t chunks_run() {
    t_inside = true;
    int64_t ran = 0;
    for (int64_t c = next_.fetch_add(1); c < chunks_; c = next_.fetch_add(1), ++ran) {
      if (failed_.load(std::memory_order_relaxed)) continue;
      try {
        (*fn_)(c * grain_, std::min(n_, (c + 1) * grain_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_ || c < error_chunk_) error_ = std::current_exception(), error_chunk_ = c;
        failed_.store(true, std::memory_order_relaxed);
      }
    }
    t_inside = false;
    return ran;
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      while (awake_.load(std::memory_order_relaxed) > 0 && posted_.load(std::memory_order_acquire) == seen) relax();
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
        if (fn_ == nullptr) continue;  // woke after the job ended
        ++active_;
      }
      const int64_t ran = chunks_run();
      std::lock_guard<std::mutex> lock(mutex_);
      done_ += ran;
      --active_;
      if (done_ == chunks_ && active_ == 0) finished_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time; a second caller runs its job inline
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> posted_{0};  // generation_, readable without the mutex
  std::atomic<int> awake_{0};
  bool stop_ = false;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, grain_ = 1, chunks_ = 0;
  std::atomic<int64_t> done_{0};  // written under mutex_; read without it while polling
  std::atomic<int> active_{0};    // workers inside the current job
  std::atomic<int64_t> next_{0};
  std::atomic<bool> failed_{false};  // a chunk of the current job has thrown
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the lowest throwing chunk's exception, rethrown by run()
  int64_t error_chunk_ = 0;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void set_kernel_threads(int threads) {
  if (threads != pool().threads()) pool().resize(threads);
}

int kernel_threads() { return pool().threads(); }

KernelThreadsAwake::KernelThreadsAwake(bool on) : on_(on) {
  if (on_) pool().awake().fetch_add(1);
}

KernelThreadsAwake::~KernelThreadsAwake() {
  if (on_) pool().awake().fetch_sub(1);
}

void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  pool().run(n, std::max<int64_t>(grain, 1), fn);
}

void parallel_chunks_indexed(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t, int)>& fn) {
  parallel_chunks(n, grain, [&](int64_t b, int64_t e) { fn(b, e, t_worker); });
}

float* thread_scratch(Scratch slot, int64_t n) {
  thread_local std::array<std::vector<float>, static_cast<size_t>(Scratch::Count)> buffers;
  std::vector<float>& b = buffers.at(static_cast<size_t>(slot));
  if (b.size() < static_cast<size_t>(n)) b.resize(static_cast<size_t>(n));
  return b.data();
}

}  // namespace remat::detail
