// Float32 CPU loops for the pointwise ops where LibTorch 1.13 is slow (internal).
//
// Measured on a (8, 1024, 2048) tensor with remat's allocator: at::gelu(x, "tanh") 46.6 ms
// (its tanh is not vectorised in this build) against 6.4 ms here. The softmax runs at ~1.1 ns per
// element on one thread (rows of 128 to 1024), its row max vectorised too. Each function is compiled for
// AVX-512, AVX2 and plain x86-64 and picked at run time, and splits its work over remat's kernel threads in fixed
// chunks (parallel.h). Results are deterministic on a given CPU, and so are recomputes.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace remat::ops::kernels {

// Whether these loops take t: a contiguous float32 CPU tensor. Ops run ATen's own for anything else.
inline bool fits(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const float* x, float* y, int64_t n);
// dx = dy * d gelu(x) / dx. dx may be dy (in place); the bits are the same either way: every loop
// here runs as `omp simd`, one vector path whatever the pointers.
void gelu_backward(const float* dy, const float* x, float* dx, int64_t n);

// y = max(x, 0). y is not x.
void relu_forward(const float* x, float* y, int64_t n);
// dx = y > 0 ? dy : 0, from the forward's output y. dx may be dy.
void relu_backward(const float* dy, const float* y, float* dx, int64_t n);

// act = silu(g) * u = g * sigmoid(g) * u (LLaMA's SwiGLU). act is neither g nor u.
void swiglu_forward(const float* g, const float* u, float* act, int64_t n);
// dg = dy * u * s * (1 + g * (1 - s)) and du = dy * g * s, s = sigmoid(g): fresh outputs, each
// neither an input nor the other.
void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n);

// y = a + b, into a tensor of its own (y is neither a nor b).
void add(const float* a, const float* b, float* y, int64_t n);

// Every one of `rows` rows of y (each `cols` floats, contiguous) set to `row`: a linear's bias,
// before its GEMM adds x W^T into it.
void fill_rows(const float* row, float* y, int64_t rows, int64_t cols);

// A new tensor of zeros, written on the kernel threads where it is on the CPU: at::zeros fills on
// ATen's one thread while the other cores wait (an attention backward's gradient slot, 6 MiB a
// layer in the seed). The same bytes as at::zeros, whatever the thread count.
at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options);

// y = x * mask * scale, without converting the bool mask to a float tensor first (at::mul does,
// which allocates a copy the size of x). y may be x.
void dropout_apply(const float* x, const bool* mask, float scale, float* y, int64_t n);

// keep[i] = hash(seed, i) >= p * 2^32: a dropout keep-mask that is a pure function of (seed, i).
void dropout_mask(bool* keep, int64_t n, double p, uint64_t seed);

// Softmax of each of `rows` contiguous rows of `cols` floats. REQUIRES: every entry finite; masked
// scores hold the lowest finite float (their exp underflows to exactly 0), never -inf.
void softmax_rows(const float* s, float* p, int64_t rows, int64_t cols);

// ds = p * (dp - sum(dp * p)) per row: the softmax backward from its output p. ds may be dp.
void softmax_rows_backward(const float* p, const float* dp, float* ds, int64_t rows, int64_t cols);

// lse[r] = log(sum_j exp(x[r, j])) of each of `rows` contiguous rows of `cols` floats (a
// cross-entropy's log-sum-exp over the vocabulary): the row's maximum taken out first, the
// exponentials summed in float lanes over blocks of 1024 columns and the blocks in double. A row
// holding a NaN or an infinity (logits of a diverged run; even -inf, which ATen would take) gets a
// NaN.
void log_sum_exp_rows(const float* x, float* lse, int64_t rows, int64_t cols);

// log-probabilities: logp[r, j] = x[r, j] - lse[r], lse as log_sum_exp_rows computes it (a
// cross-entropy's log-softmax; a row not all finite is all NaN). logp is not x.
void log_softmax_rows(const float* x, float* logp, int64_t rows, int64_t cols);

// y[r, j] = exp(x[r, j] - lse[r]) * scale: each row's softmax from its log-sum-exp, scaled (a
// cross-entropy's gradient before the target's scale is taken off). lse null: x holds
// log-probabilities (every row's log-sum-exp is 0). y may be x.
void softmax_from_lse_rows(const float* x, const float* lse, float scale, float* y, int64_t rows, int64_t cols);

// --- normalisation rows ------------------------------------------------------------------------

// Rows per chunk of the norms' weight-gradient partial sums. The chunks are fixed, so the sums are
// the same bits on any thread count.
constexpr int64_t kNormRows = 64;
// Chunks of partial sums a backward over `rows` rows writes: rows of dw_part (and db_part).
inline int64_t norm_chunks(int64_t rows) { return (rows + kNormRows - 1) / kNormRows; }

// LayerNorm of each of `rows` contiguous rows of `cols` floats: mean[r], rstd[r] = 1 / sqrt(var +
// eps) (the biased variance, taken about the mean in a second pass), y = (x - mean) * rstd * w + b.
// y is not x.
void layer_norm_rows(const float* x, const float* w, const float* b, float eps, float* y, float* mean, float* rstd,
                     int64_t rows, int64_t cols);

// LayerNorm's backward from x, mean and rstd: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
// g = dy * w, xhat = (x - mean) * rstd (dx null: not computed). Chunk k of kNormRows rows writes the
// sums of its rows' dy * xhat and dy into row k of dw_part and db_part (norm_chunks(rows) x cols
// each); the caller sums those rows.
void layer_norm_rows_backward(const float* dy, const float* x, const float* mean, const float* rstd, const float* w,
                              float* dx, float* dw_part, float* db_part, int64_t rows, int64_t cols);

// RMSNorm of each row: rstd[r] = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w. y is not x.
void rms_norm_rows(const float* x, const float* w, float eps, float* y, float* rstd, int64_t rows, int64_t cols);

// RMSNorm's backward from x and rstd: dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x *
// rstd (dx null: not computed); the sums of dy * xhat per chunk into dw_part, as LayerNorm's.
void rms_norm_rows_backward(const float* dy, const float* x, const float* rstd, const float* w, float* dx,
                            float* dw_part, int64_t rows, int64_t cols);

// --- flash attention's tile rows (one thread each; the caller spreads tiles over the pool) -----

// One query row of an online softmax over a tile of keys. s holds the row's n scaled scores (the
// ones the causal mask leaves, n >= 1). Sets p[0, n) = exp(s - m'), m' = max(m, max s); updates
// m = m' and l = l * alpha + sum p; returns alpha = exp(m_old - m'), the factor for what the row
// accumulated before. p may be s. Start a row with m = the lowest float, l = 0.
float online_softmax_row(const float* s, float* p, int64_t n, float& m, float& l);

// p[j] = exp(s[j] - shift) for j < n (the backward's probabilities from the log-sum-exp). p may be s.
void exp_shifted(const float* s, float* p, int64_t n, float shift);

// keep[j] = the keep bit of element first + j of a mask that dropout_mask(.., p, seed) would give:
// masks are addressed by element, so any tile of one is reproduced exactly.
void dropout_keep(uint8_t* keep, int64_t first, int64_t n, double p, uint64_t seed);

// y[j] = x[j] * keep[j] * scale. y may be x.
void mask_scale(const float* x, const uint8_t* keep, float scale, float* y, int64_t n);

// ds[j] = p[j] * (dp[j] * keep[j] * scale - d), or p[j] * (dp[j] - d) when keep is null: the
// softmax backward of one row, through dropout. ds may be dp.
void softmax_grad_row(const float* p, const float* dp, const uint8_t* keep, float scale, float d, float* ds, int64_t n);

}  // namespace remat::ops::kernels
