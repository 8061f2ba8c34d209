// Compiled with -O3 -ffast-math -fopenmp-simd (CMakeLists.txt): vector exp from glibc's libmvec.
// Under -ffast-math no code here may meet an infinity or a NaN: GELU clamps the tanh argument, and
// masked attention scores are the lowest finite float rather than -inf (ops/attention.cpp).
#include "ops/kernels.h"

#include <algorithm>
#include <cmath>

namespace remat::ops::kernels {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

}  // namespace

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_forward(const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = std::clamp(kSqrt2OverPi * (v + kCubic * v * v * v), -15.0f, 15.0f);
    const float t = 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f);  // tanh(u)
    y[i] = 0.5f * v * (1.0f + t);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void gelu_backward(const float* __restrict dy, const float* __restrict x, float* __restrict dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = std::clamp(kSqrt2OverPi * (v + kCubic * v * v * v), -15.0f, 15.0f);
    const float t = 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void dropout_apply(const float* __restrict x, const bool* __restrict mask, float scale, float* __restrict y,
                   int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = mask[i] ? x[i] * scale : 0.0f;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void softmax_rows(const float* __restrict s, float* __restrict p, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = s + i * cols;
    float* out = p + i * cols;
    float mx = in[0];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, in[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) {
      const float e = std::exp(in[j] - mx);
      out[j] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] *= inv;
  }
}

}  // namespace remat::ops::kernels
