// Compiled with -O3 -ffast-math -fopenmp-simd (CMakeLists.txt): vector exp from glibc's libmvec.
// Under -ffast-math no code here may meet an infinity or a NaN: GELU clamps the tanh argument, and
// masked attention scores are the lowest finite float rather than -inf (ops/scores.cpp), and the
// cross-entropy's log-sum-exp looks for them in a row's bits before its float loops run. The norms
// are the exception: they meet a NaN or an infinity only in arithmetic (no compare, clamp or
// select), so one in a row spreads to its outputs; 1 / sqrt(v) compiles to a reciprocal square
// root and a Newton step, which gives NaN where v is infinite, so a row whose sum of squares
// overflows comes out NaN too (IEEE arithmetic would give rstd 0).
#include "ops/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <ATen/ATen.h>

#include "util/parallel.h"

namespace remat::ops::kernels {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

__attribute__((target_clones("avx512f", "avx2", "default"))) void gelu_forward_range(const float* __restrict x,
                                                                                     float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = std::clamp(kSqrt2OverPi * (v + kCubic * v * v * v), -15.0f, 15.0f);
    const float t = 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f);  // tanh(u)
    y[i] = 0.5f * v * (1.0f + t);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void gelu_backward_range(const float* dy,
                                                                                      const float* __restrict x,
                                                                                      float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = std::clamp(kSqrt2OverPi * (v + kCubic * v * v * v), -15.0f, 15.0f);
    const float t = 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

// sigmoid(g) = 1 / (1 + exp(-g)), exp's argument held in [-87, 80]: below -87 libmvec would send
// the whole vector to its scalar path, and sigmoid is 1.0f there anyway (1 + exp(-87) rounds to 1);
// above 80 (g < -80) exp could overflow to infinity, which -ffast-math must never meet, so sigmoid
// stays at 1.8e-35 there, as the float64 loop's max(g, -80) does (ops/swiglu.cpp).
inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(std::clamp(-g, -87.0f, 80.0f))); }

__attribute__((target_clones("avx512f", "avx2", "default"))) void swiglu_forward_range(const float* __restrict g,
                                                                                       const float* __restrict u,
                                                                                       float* __restrict act,
                                                                                       int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) act[i] = g[i] * sigmoid(g[i]) * u[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void swiglu_backward_range(
    const float* __restrict dy, const float* __restrict g, const float* __restrict u, float* __restrict dg,
    float* __restrict du, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], s = sigmoid(x);
    du[i] = dy[i] * x * s;
    dg[i] = dy[i] * u[i] * s * (1.0f + x * (1.0f - s));
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void relu_forward_range(const float* __restrict x,
                                                                                     float* __restrict y, int64_t n) {
  // A NaN passes (as at::relu keeps it), told by its bits: -ffast-math may fold a NaN test away.
  const auto* bits = reinterpret_cast<const uint32_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = v > 0.0f || (bits[i] & 0x7fffffffu) > 0x7f800000u ? v : 0.0f;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void relu_backward_range(const float* dy,
                                                                                      const float* __restrict y,
                                                                                      float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void add_range(const float* __restrict a,
                                                                            const float* __restrict b,
                                                                            float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void dropout_apply_range(const float* x,
                                                                                      const bool* __restrict mask,
                                                                                      float scale, float* y,
                                                                                      int64_t n) {
  const auto* m = reinterpret_cast<const uint8_t*>(mask);  // bool is one byte, 0 or 1
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * (scale * static_cast<float>(m[i]));
}

// A 32-bit integer hash with full avalanche (lowbias32, C. Wellons).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Keys of the mask hash from the whole 64-bit seed (splitmix64's finaliser), so nearby seeds give
// unrelated masks rather than permutations of one another.
struct MaskKeys {
  uint32_t k0, k1, threshold;
};

MaskKeys mask_keys(double p, uint64_t seed) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return {static_cast<uint32_t>(z), static_cast<uint32_t>(z >> 32),
          static_cast<uint32_t>(std::min(p * 4294967296.0, 4294967295.0))};
}

// Elements [begin, end) of the mask, written from out[0]. The high bits of the element index re-key
// each run of 2^32 elements; callers split ranges at those boundaries (dropout_keep_range).
__attribute__((target_clones("avx512f", "avx2", "default"))) void dropout_mask_run(uint8_t* __restrict out,
                                                                                   int64_t begin, int64_t end,
                                                                                   MaskKeys keys) {
  const uint32_t k = keys.k1 + static_cast<uint32_t>(static_cast<uint64_t>(begin) >> 32) * 0x9e3779b9U;
  // The low 32 bits of the index, counted in 32 bits (a run never wraps them): a 64-bit counter
  // made the vector loop narrow every lane to 32 bits first, half its instructions.
  const auto first = static_cast<uint32_t>(begin);
  const auto n = static_cast<uint32_t>(end - begin);
#pragma omp simd
  for (uint32_t j = 0; j < n; ++j) out[j] = mix32(mix32((first + j) ^ keys.k0) ^ k) >= keys.threshold;
}

void dropout_keep_range(uint8_t* out, int64_t begin, int64_t end, MaskKeys keys) {
  while (begin < end) {
    const int64_t run_end = std::min(end, (begin | int64_t{0xffffffff}) + 1);
    dropout_mask_run(out, begin, run_end, keys);
    out += run_end - begin;
    begin = run_end;
  }
}

// The largest of n floats and mx. Written as a select, not std::max: GCC 12 keeps
// `reduction(max : mx)` over std::max a scalar chain of dependent maxss (1.3 ns per element, half
// the softmax's time), and vectorises the select (0.15 ns). The maximum is exact, in any order.
__attribute__((always_inline)) inline float max_of(const float* __restrict s, int64_t n, float mx) {
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) float online_softmax_range(const float* s, float* p,
                                                                                        int64_t n, float& m, float& l) {
  const float mx = max_of(s, n, m);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(std::max(s[j] - mx, -87.0f));  // see softmax_rows_range
    p[j] = e;
    sum += e;
  }
  const float a = std::max(m - mx, -87.0f);
  const float alpha = a > -87.0f ? std::exp(a) : 0.0f;
  m = mx;
  l = l * alpha + sum;
  return alpha;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void exp_shifted_range(const float* s, float* p, int64_t n,
                                                                                    float shift) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::max(s[j] - shift, -87.0f);
    p[j] = a > -87.0f ? std::exp(a) : 0.0f;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void mask_scale_range(const float* x,
                                                                                   const uint8_t* __restrict keep,
                                                                                   float scale, float* y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] * (scale * static_cast<float>(keep[j]));
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void softmax_grad_range(const float* __restrict p,
                                                                                     const float* dp,
                                                                                     const uint8_t* __restrict keep,
                                                                                     float scale, float d, float* ds,
                                                                                     int64_t n) {
  if (keep == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (dp[j] - d);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (dp[j] * (scale * static_cast<float>(keep[j])) - d);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void softmax_rows_range(const float* __restrict s,
                                                                                     float* __restrict p, int64_t rows,
                                                                                     int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = s + i * cols;
    float* out = p + i * cols;
    const float mx = max_of(in, cols, in[0]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) {
      // exp only ever sees arguments >= -87: libmvec sends a whole vector to its scalar slow path
      // when one lane is out of range, which the masked lanes of causal blocks always are (5x
      // slower on the first row block). At -87 and below the result is 0 (exp would give at most
      // 1.6e-38). The select tests the clamped value, so the compiler cannot fold the clamp away.
      const float a = std::max(in[j] - mx, -87.0f);
      const float e = a > -87.0f ? std::exp(a) : 0.0f;
      out[j] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] *= inv;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void softmax_rows_backward_range(const float* __restrict p,
                                                                                              const float* dp,
                                                                                              float* ds, int64_t rows,
                                                                                              int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* y = p + i * cols;
    const float* dy = dp + i * cols;
    float* dx = ds + i * cols;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < cols; ++j) dot += dy[j] * y[j];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) dx[j] = y[j] * (dy[j] - dot);
  }
}

// Columns whose exponentials one float lane sum adds before the row's double total takes them: a
// vocabulary's 50257 columns would otherwise put some 3000 terms in each lane.
constexpr int64_t kLseBlock = 1024;

// Whether any of n floats is an infinity or a NaN (every exponent bit set), tested on the bits:
// -ffast-math lets the compiler assume no float comparison ever meets one.
__attribute__((always_inline)) inline bool any_not_finite(const float* __restrict s, int64_t n) {
  const auto* bits = reinterpret_cast<const uint32_t*>(s);
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) bad |= static_cast<uint32_t>((bits[j] & 0x7f800000u) == 0x7f800000u);
  return bad != 0;
}

// A quiet NaN written from its bits (-ffast-math may fold a NaN constant away).
inline float quiet_nan() {
  const uint32_t bits = 0x7fc00000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void log_sum_exp_rows_range(const float* __restrict x,
                                                                                         float* __restrict lse,
                                                                                         int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = x + i * cols;
    // A row that is not all finite (logits of a diverged run) has a NaN lse, as ATen's would:
    // the loops below would drop a NaN (the clamp) and give a finite loss.
    if (any_not_finite(in, cols)) {
      lse[i] = quiet_nan();
      continue;
    }
    const float mx = max_of(in, cols, in[0]);
    double total = 0;
    for (int64_t j0 = 0; j0 < cols; j0 += kLseBlock) {
      const int64_t n = std::min(kLseBlock, cols - j0);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = j0; j < j0 + n; ++j) {
        const float a = std::max(in[j] - mx, -87.0f);  // see softmax_rows_range
        sum += a > -87.0f ? std::exp(a) : 0.0f;
      }
      total += sum;
    }
    lse[i] = static_cast<float>(static_cast<double>(mx) + std::log(total));
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void softmax_from_lse_range(const float* x,
                                                                                         const float* __restrict lse,
                                                                                         float scale, float* y,
                                                                                         int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = x + i * cols;
    float* out = y + i * cols;
    const float shift = lse != nullptr ? lse[i] : 0.0f;
    if (lse != nullptr && any_not_finite(&shift, 1)) {  // a row whose loss is NaN: so is its gradient
      std::fill(out, out + cols, quiet_nan());
      continue;
    }
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const float a = std::max(in[j] - shift, -87.0f);
      out[j] = (a > -87.0f ? std::exp(a) : 0.0f) * scale;
    }
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void subtract_range(const float* __restrict x, float shift,
                                                                                 float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = x[j] - shift;
}

// LayerNorm rows [0, rows): each row's mean, then its variance about the mean (a second pass: no
// cancellation for rows far from zero), then y.
__attribute__((target_clones("avx512f", "avx2", "default"))) void layer_norm_range(
    const float* __restrict x, const float* __restrict w, const float* __restrict b, float eps, float* __restrict y,
    float* __restrict mean, float* __restrict rstd, int64_t rows, int64_t cols) {
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = x + i * cols;
    float* out = y + i * cols;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) sum += in[j];
    const float m = sum * inv_cols;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < cols; ++j) ss += (in[j] - m) * (in[j] - m);
    const float r = 1.0f / std::sqrt(ss * inv_cols + eps);
    mean[i] = m;
    rstd[i] = r;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] = (in[j] - m) * r * w[j] + b[j];
  }
}

// LayerNorm's backward over rows [0, rows), adding each row's dy * xhat and dy into dw and db.
__attribute__((target_clones("avx512f", "avx2", "default"))) void layer_norm_backward_range(
    const float* __restrict dy, const float* __restrict x, const float* __restrict mean, const float* __restrict rstd,
    const float* __restrict w, float* __restrict dx, float* __restrict dw, float* __restrict db, int64_t rows,
    int64_t cols) {
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float *in = x + i * cols, *g = dy + i * cols;
    const float m = mean[i], r = rstd[i];
    float sum_g = 0.0f, sum_gx = 0.0f;  // sums of dy * w and of dy * w * xhat over the row
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int64_t j = 0; j < cols; ++j) {
      const float xh = (in[j] - m) * r;
      dw[j] += g[j] * xh;
      db[j] += g[j];
      sum_g += g[j] * w[j];
      sum_gx += g[j] * w[j] * xh;
    }
    if (dx == nullptr) continue;
    const float mean_g = sum_g * inv_cols, mean_gx = sum_gx * inv_cols;
    float* out = dx + i * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] = r * (g[j] * w[j] - mean_g - (in[j] - m) * r * mean_gx);
  }
}

// RMSNorm rows [0, rows).
__attribute__((target_clones("avx512f", "avx2", "default"))) void rms_norm_range(const float* __restrict x,
                                                                                 const float* __restrict w, float eps,
                                                                                 float* __restrict y,
                                                                                 float* __restrict rstd, int64_t rows,
                                                                                 int64_t cols) {
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = x + i * cols;
    float* out = y + i * cols;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < cols; ++j) ss += in[j] * in[j];
    const float r = 1.0f / std::sqrt(ss * inv_cols + eps);
    rstd[i] = r;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] = in[j] * r * w[j];
  }
}

// RMSNorm's backward over rows [0, rows), adding each row's dy * xhat into dw.
__attribute__((target_clones("avx512f", "avx2", "default"))) void rms_norm_backward_range(
    const float* __restrict dy, const float* __restrict x, const float* __restrict rstd, const float* __restrict w,
    float* __restrict dx, float* __restrict dw, int64_t rows, int64_t cols) {
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float *in = x + i * cols, *g = dy + i * cols;
    const float r = rstd[i];
    float sum_gx = 0.0f;  // sum of dy * w * xhat over the row
#pragma omp simd reduction(+ : sum_gx)
    for (int64_t j = 0; j < cols; ++j) {
      const float xh = in[j] * r;
      dw[j] += g[j] * xh;
      sum_gx += g[j] * w[j] * xh;
    }
    if (dx == nullptr) continue;
    const float mean_gx = sum_gx * inv_cols;
    float* out = dx + i * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) out[j] = r * (g[j] * w[j] - in[j] * r * mean_gx);
  }
}

// Chunks for the pool (parallel.h): fixed sizes, so that a call splits the same way on any number of
// threads. 2^16 elements divide 2^32 (dropout_mask's re-keying runs).
constexpr int64_t kGrain = int64_t{1} << 16;

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)); }

}  // namespace

void gelu_forward(const float* x, float* y, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { gelu_forward_range(x + b, y + b, e - b); });
}

void gelu_backward(const float* dy, const float* x, float* dx, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { gelu_backward_range(dy + b, x + b, dx + b, e - b); });
}

void relu_forward(const float* x, float* y, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { relu_forward_range(x + b, y + b, e - b); });
}

void relu_backward(const float* dy, const float* y, float* dx, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { relu_backward_range(dy + b, y + b, dx + b, e - b); });
}

void swiglu_forward(const float* g, const float* u, float* act, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { swiglu_forward_range(g + b, u + b, act + b, e - b); });
}

void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
  detail::parallel_chunks(
      n, kGrain, [&](int64_t b, int64_t e) { swiglu_backward_range(dy + b, g + b, u + b, dg + b, du + b, e - b); });
}

void add(const float* a, const float* b, float* y, int64_t n) {
  detail::parallel_chunks(n, kGrain, [&](int64_t s, int64_t e) { add_range(a + s, b + s, y + s, e - s); });
}

void fill_rows(const float* row, float* y, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::copy_n(row, cols, y + i * cols);
  });
}

at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (!t.device().is_cpu()) return t.zero_();
  char* base = static_cast<char*>(t.data_ptr());
  // kGrain floats' bytes a chunk: the pointwise loops' chunk, whatever the dtype.
  detail::parallel_chunks(static_cast<int64_t>(t.nbytes()), kGrain * static_cast<int64_t>(sizeof(float)),
                          [&](int64_t b, int64_t e) { std::memset(base + b, 0, static_cast<size_t>(e - b)); });
  return t;
}

void dropout_apply(const float* x, const bool* mask, float scale, float* y, int64_t n) {
  detail::parallel_chunks(n, kGrain,
                          [&](int64_t b, int64_t e) { dropout_apply_range(x + b, mask + b, scale, y + b, e - b); });
}

void dropout_mask(bool* keep, int64_t n, double p, uint64_t seed) {
  const MaskKeys keys = mask_keys(p, seed);
  auto* out = reinterpret_cast<uint8_t*>(keep);  // bool is one byte, 0 or 1
  detail::parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { dropout_keep_range(out + b, b, e, keys); });
}

float online_softmax_row(const float* s, float* p, int64_t n, float& m, float& l) {
  return online_softmax_range(s, p, n, m, l);
}

void exp_shifted(const float* s, float* p, int64_t n, float shift) { exp_shifted_range(s, p, n, shift); }

void dropout_keep(uint8_t* keep, int64_t first, int64_t n, double p, uint64_t seed) {
  dropout_keep_range(keep, first, first + n, mask_keys(p, seed));
}

void mask_scale(const float* x, const uint8_t* keep, float scale, float* y, int64_t n) {
  mask_scale_range(x, keep, scale, y, n);
}

void softmax_grad_row(const float* p, const float* dp, const uint8_t* keep, float scale, float d, float* ds,
                      int64_t n) {
  softmax_grad_range(p, dp, keep, scale, d, ds, n);
}

void softmax_rows(const float* s, float* p, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols),
                          [&](int64_t b, int64_t e) { softmax_rows_range(s + b * cols, p + b * cols, e - b, cols); });
}

void softmax_rows_backward(const float* p, const float* dp, float* ds, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    softmax_rows_backward_range(p + b * cols, dp + b * cols, ds + b * cols, e - b, cols);
  });
}

void log_sum_exp_rows(const float* x, float* lse, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols),
                          [&](int64_t b, int64_t e) { log_sum_exp_rows_range(x + b * cols, lse + b, e - b, cols); });
}

void log_softmax_rows(const float* x, float* logp, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float lse = 0;
      log_sum_exp_rows_range(x + i * cols, &lse, 1, cols);
      subtract_range(x + i * cols, lse, logp + i * cols, cols);
    }
  });
}

void softmax_from_lse_rows(const float* x, const float* lse, float scale, float* y, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t b, int64_t e) {
    softmax_from_lse_range(x + b * cols, lse != nullptr ? lse + b : nullptr, scale, y + b * cols, e - b, cols);
  });
}

void layer_norm_rows(const float* x, const float* w, const float* b, float eps, float* y, float* mean, float* rstd,
                     int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t s, int64_t e) {
    layer_norm_range(x + s * cols, w, b, eps, y + s * cols, mean + s, rstd + s, e - s, cols);
  });
}

void layer_norm_rows_backward(const float* dy, const float* x, const float* mean, const float* rstd, const float* w,
                              float* dx, float* dw_part, float* db_part, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, kNormRows, [&](int64_t s, int64_t e) {
    float* dw = dw_part + (s / kNormRows) * cols;
    float* db = db_part + (s / kNormRows) * cols;
    std::fill_n(dw, cols, 0.0f);
    std::fill_n(db, cols, 0.0f);
    layer_norm_backward_range(dy + s * cols, x + s * cols, mean + s, rstd + s, w,
                              dx != nullptr ? dx + s * cols : nullptr, dw, db, e - s, cols);
  });
}

void rms_norm_rows(const float* x, const float* w, float eps, float* y, float* rstd, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, row_grain(cols), [&](int64_t s, int64_t e) {
    rms_norm_range(x + s * cols, w, eps, y + s * cols, rstd + s, e - s, cols);
  });
}

void rms_norm_rows_backward(const float* dy, const float* x, const float* rstd, const float* w, float* dx,
                            float* dw_part, int64_t rows, int64_t cols) {
  detail::parallel_chunks(rows, kNormRows, [&](int64_t s, int64_t e) {
    float* dw = dw_part + (s / kNormRows) * cols;
    std::fill_n(dw, cols, 0.0f);
    rms_norm_backward_range(dy + s * cols, x + s * cols, rstd + s, w, dx != nullptr ? dx + s * cols : nullptr, dw,
                            e - s, cols);
  });
}

}  // namespace remat::ops::kernels
