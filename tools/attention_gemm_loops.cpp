// The engine's attention products in standalone loops, on one thread: how fast oneDNN's sgemm runs
// a scores product (128 query rows x T keys x head dim 64) when its operands stay in cache, when
// every call moves to the next (batch, head) as the engine's loops do, and when each (batch, head)
// runs through all its causal row blocks before the next. Also the 1024^3 rate of one core and
// the rate at which one thread writes memory. docs/performance.md quotes its output.
//
// It links no LibTorch, only oneDNN; CMake builds it where Debian's libdnnl.so.2 is found:
//   OMP_NUM_THREADS=1 build/attention_gemm_loops
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// oneDNN's row-major sgemm (dnnl.h), the call the engine makes for every product.
extern "C" int dnnl_sgemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// n floats, 64-byte aligned, filled (so that every page is touched before timing).
float* filled(size_t n) {
  auto* p = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(i % 97) * 0.01f;
  return p;
}

// GFLOP/s of f(): one untimed call, then the median of 5 timed ones.
template <typename F>
double gflops(double flops, F f) {
  f();
  std::vector<double> rates;
  for (int i = 0; i < 5; ++i) {
    const double t = now();
    f();
    rates.push_back(flops / (now() - t) / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[2];
}

}  // namespace

int main() {
  // GPT-2 at T = 1024 as `make gpt2` runs it: batch 8, 8 heads of 64, q, k and v in one (B, T, 3 W)
  // tensor; causal row blocks of 128 queries, block r seeing (r + 1) * 128 keys, stored packed.
  const int64_t B = 8, H = 8, T = 1024, D = 64, W = H * D, R = T / 128, rows = 128;
  float* qkv = filled(B * T * 3 * W);
  std::vector<int64_t> offset(R);
  int64_t packed = 0;
  double flops = 0;
  for (int64_t r = 0; r < R; ++r) {
    offset[r] = packed;
    packed += B * H * rows * (r + 1) * rows;
    flops += 2.0 * B * H * rows * (r + 1) * rows * D;
  }
  float* scores = filled(packed);
  auto product = [&](int64_t r, int64_t b, int64_t h) {  // s = q k^T / sqrt(D) for one block
    const int64_t keys = (r + 1) * rows;
    const float* q = qkv + b * T * 3 * W + r * rows * 3 * W + h * D;
    const float* k = qkv + b * T * 3 * W + W + h * D;
    dnnl_sgemm('N', 'T', rows, keys, D, 0.125f, q, 3 * W, k, 3 * W, 0.0f,
               scores + offset[r] + (b * H + h) * rows * keys, keys);
  };
  float* a = filled(1 << 20);
  float* b = filled(1 << 20);
  float* c = filled(1 << 20);
  std::printf("one thread, GFLOP/s (median of 5) | memory written, GB/s\n");
  for (int run = 0; run < 3; ++run) {
    const double square =
        gflops(2.0 * (1 << 30), [&] { dnnl_sgemm('N', 'N', 1024, 1024, 1024, 1, a, 1024, b, 1024, 0, c, 1024); });
    const double same = gflops(2.0 * rows * T * D * B * H, [&] {
      for (int64_t i = 0; i < B * H; ++i) product(R - 1, 0, 0);
    });
    const double blocks_outer = gflops(flops, [&] {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t bi = 0; bi < B; ++bi)
          for (int64_t h = 0; h < H; ++h) product(r, bi, h);
    });
    const double heads_outer = gflops(flops, [&] {
      for (int64_t bi = 0; bi < B; ++bi)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t r = 0; r < R; ++r) product(r, bi, h);
    });
    const double t = now();
    std::memset(scores, run + 1, packed * sizeof(float));
    const double written = packed * sizeof(float) / (now() - t) / 1e9;
    std::printf(
        "1024^3 %.1f | 128 x 1024 x 64 on the same operands %.1f | the layer's scores, row block outer "
        "(the engine's order) %.1f | (batch, head) outer %.1f | memset %.1f\n",
        square, same, blocks_outer, heads_outer, written);
  }
  return 0;
}
