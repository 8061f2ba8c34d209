// The CPU's float32 peak, measured (runtime.h, peak_gflops): independent chains of fused
// multiply-adds on every thread at once. A GEMM's rate over this is the share of the machine it uses.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "remat/blas_kernel.h"
#include "remat/runtime.h"

namespace remat {

namespace {

constexpr int kChains = 12;  // more than an FMA's latency (4-5 cycles) times its units (2)

// `iters` rounds of kChains FMAs of 16 lanes; returns a value that depends on all of them.
__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t r = 0; r < iters; ++r)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, sum);
  return out[0] + out[15];
}

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t r = 0; r < iters; ++r)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, sum);
  return out[0] + out[7];
}

}  // namespace

PeakRate peak_gflops(int threads) {
  const blas::CpuFeatures cpu = blas::cpu_features();
  if (!cpu.avx512 && !(cpu.avx2 && cpu.fma)) return {0, "no AVX2 FMA on this CPU: not measured"};
  const int lanes = cpu.avx512 ? 16 : 8;
  const int64_t iters = cpu.avx512 ? 2'000'000 : 4'000'000;
  auto body = [&] { return cpu.avx512 ? fma_avx512(iters) : fma_avx2(iters); };
  body();  // warm-up: the clock settles, the vector units wake
  threads = std::max(1, threads);
  // The fastest of three timed rounds: a round the VM's other tenants slowed is not the peak.
  double s = 0;
  for (int round = 0; round < 3; ++round) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<float> sink(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        sink[static_cast<size_t>(t)] = body();
      });
    while (ready.load() < threads) std::this_thread::yield();
    const auto t0 = std::chrono::steady_clock::now();
    go.store(true);
    for (std::thread& th : pool) th.join();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s = round == 0 ? took : std::min(s, took);
    volatile float keep = 0;
    for (float v : sink) keep = keep + v;
  }
  const double flops = 2.0 * lanes * kChains * static_cast<double>(iters) * threads;
  return {flops / s / 1e9,
          fmt::format("{} FMA, {} lanes, {} chains, on {} thread{} at once, the fastest of 3 rounds",
                      cpu.avx512 ? "AVX-512" : "AVX2", lanes, kChains, threads, threads == 1 ? "" : "s")};
}

}  // namespace remat
