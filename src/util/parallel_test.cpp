#include "util/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ops/kernels.h"
#include "remat/error.h"
#include "util/parallel_testing.h"

namespace remat::detail {
namespace {

TEST(Parallel, EveryIndexOnceInFixedChunks) {
  const KernelThreads two(2);
  std::vector<std::atomic<int>> hits(1000);
  std::mutex m;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  parallel_chunks(1000, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
    std::lock_guard<std::mutex> lock(m);
    chunks.emplace_back(b, e);
  });
  for (const auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_EQ(chunks.size(), 16u);  // 15 of 64 and one of 40
  for (const auto& [b, e] : chunks) {
    EXPECT_EQ(b % 64, 0);
    EXPECT_EQ(e, std::min<int64_t>(b + 64, 1000));
  }
}

TEST(Parallel, NestedCallsRunInline) {
  const KernelThreads two(2);
  std::atomic<int64_t> total{0};
  parallel_chunks(8, 1,
                  [&](int64_t, int64_t) { parallel_chunks(100, 10, [&](int64_t b, int64_t e) { total += e - b; }); });
  EXPECT_EQ(total.load(), 800);
}

// Until `flag` is set, or a minute (far beyond any scheduling delay, short of ctest's timeout) has
// passed: a chunk that waits for the other thread to take one, so that both run chunks of the job
// however the two are scheduled.
void wait_for(const std::atomic<bool>& flag) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!flag.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

// A chunk that throws on the caller (worker 0) or on the pool's worker (1), asleep and polling:
// the caller gets the exception, after every started chunk has ended, and the next job runs every
// chunk with the worker taking part (the pool is not left in its inline mode).
TEST(Parallel, AThrowingChunkReachesTheCaller) {
  const KernelThreads two(2);
  for (const bool polling : {false, true}) {
    const KernelThreadsAwake awake(polling);
    for (const int thrower : {0, 1}) {
      std::atomic<int> running{0};
      std::atomic<bool> caller_in{false}, worker_in{false}, thrown{false};
      int after = -1;  // chunks still running when the call returned
      try {
        parallel_chunks_indexed(64, 1, [&](int64_t, int64_t, int worker) {
          ++running;
          (worker == 0 ? caller_in : worker_in) = true;
          wait_for(worker == 0 ? worker_in : caller_in);
          if (worker == thrower && !thrown.exchange(true)) {
            --running;
            throw Error("worker " + std::to_string(worker));
          }
          --running;
        });
        ADD_FAILURE() << "no exception from worker " << thrower;
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "worker " + std::to_string(thrower));
        after = running.load();
      }
      EXPECT_EQ(after, 0);
      std::vector<std::atomic<int>> hits(64);
      std::atomic<bool> worker_ran{false};
      parallel_chunks_indexed(64, 1, [&](int64_t b, int64_t, int worker) {
        if (worker == 1) worker_ran = true;
        if (worker == 0) wait_for(worker_ran);
        hits[b]++;
      });
      for (const auto& h : hits) EXPECT_EQ(h.load(), 1);
      EXPECT_TRUE(worker_ran.load());
    }
  }
}

// Of several chunks that throw, the caller gets the lowest one's exception, even when it throws
// last (on two threads chunk 5 waits for chunk 40 to have thrown); with one thread the chunks after
// it do not run.
TEST(Parallel, TheLowestThrowingChunksExceptionWins) {
  for (const int threads : {1, 2}) {
    const KernelThreads pool(threads);
    std::atomic<int> ran_after{0};
    std::atomic<bool> forty{false};
    try {
      parallel_chunks(64, 1, [&](int64_t b, int64_t) {
        if (b > 5) ++ran_after;
        if (b == 5 && threads == 2) wait_for(forty);
        if (b == 40) forty = true;
        if (b == 5 || b == 40 || b == 63) throw Error("chunk " + std::to_string(b));
      });
      ADD_FAILURE() << "no exception on " << threads << " threads";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), "chunk 5") << threads << " threads";
    }
    if (threads == 1) {
      EXPECT_EQ(ran_after.load(), 0);
    }
  }
}

// With the threads kept awake, the caller polls for the end of its job instead of waiting on the
// condition variable: it must still return only after every chunk has run, job after job.
TEST(Parallel, AwakeJobsReturnOnlyWhenEveryChunkHasRun) {
  const KernelThreads three(3);
  const KernelThreadsAwake awake(true);
  std::vector<std::atomic<int>> hits(8);
  for (int job = 1; job <= 2000; ++job) {
    parallel_chunks(8, 1, [&](int64_t b, int64_t) {
      volatile int spin = 0;
      for (int i = 0; i < 2000; ++i) spin = spin + 1;
      hits[b]++;
    });
    for (const auto& h : hits) ASSERT_EQ(h.load(), job);
  }
}

// The kernels split work into fixed chunks: one thread or two give the same bits.
TEST(Parallel, KernelsGiveTheSameBitsOnOneThreadOrTwo) {
  const int64_t rows = 300, cols = 1100, n = rows * cols;  // several chunks, a partial one; rows of 2 lse blocks
  std::vector<float> x(n), dy(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < n; ++i) x[i] = normal(rng), dy[i] = normal(rng);
  auto run = [&](int threads) {
    const KernelThreads pool(threads);
    std::vector<float> out(10 * n + rows + 3 * cols);
    std::unique_ptr<bool[]> keep(new bool[n]);
    ops::kernels::gelu_forward(x.data(), out.data(), n);
    ops::kernels::gelu_backward(dy.data(), x.data(), out.data() + n, n);
    ops::kernels::softmax_rows(x.data(), out.data() + 2 * n, rows, cols);
    ops::kernels::dropout_mask(keep.get(), n, 0.1, 42);
    ops::kernels::dropout_apply(x.data(), keep.get(), 1.0f / 0.9f, out.data() + 3 * n, n);
    ops::kernels::log_softmax_rows(x.data(), out.data() + 4 * n, rows, cols);
    ops::kernels::log_sum_exp_rows(x.data(), out.data() + 6 * n, rows, cols);
    ops::kernels::softmax_from_lse_rows(x.data(), out.data() + 6 * n, 0.5f, out.data() + 5 * n, rows, cols);
    // The norms over rows of 1100 (chunks of 64 rows, their partial sums added here in order).
    float* norms = out.data() + 6 * n + rows;
    std::vector<float> w(x.begin(), x.begin() + cols), b(dy.begin(), dy.begin() + cols), mean(rows), rstd(rows);
    const int64_t chunks = ops::kernels::norm_chunks(rows);
    std::vector<float> part(2 * chunks * cols);
    auto add_chunks = [&](int64_t sets, float* sums) {
      for (int64_t k = 0; k < sets * chunks; ++k)
        for (int64_t j = 0; j < cols; ++j) sums[(k / chunks) * cols + j] += part[k * cols + j];
    };
    ops::kernels::layer_norm_rows(x.data(), w.data(), b.data(), 1e-5f, norms, mean.data(), rstd.data(), rows, cols);
    ops::kernels::layer_norm_rows_backward(dy.data(), x.data(), mean.data(), rstd.data(), w.data(), norms + n,
                                           part.data(), part.data() + chunks * cols, rows, cols);
    add_chunks(2, norms + 4 * n);
    ops::kernels::rms_norm_rows(x.data(), w.data(), 1e-5f, norms + 2 * n, rstd.data(), rows, cols);
    ops::kernels::rms_norm_rows_backward(dy.data(), x.data(), rstd.data(), w.data(), norms + 3 * n, part.data(), rows,
                                         cols);
    add_chunks(1, norms + 4 * n + 2 * cols);
    return out;
  };
  const std::vector<float> one = run(1), two = run(2);
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace remat::detail
