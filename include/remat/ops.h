// Op pairs on ATen: every forward sits beside its backward, and each backward reads exactly the
// tensors named in its signature (the same ones OpInfo lists in block.h). They work on CPU and
// CUDA tensors of any floating dtype; gradients match LibTorch autograd on the same math (tested
// in float64 to 1e-12).
//
// Layout: activations are (B, T, C) row-major. Attention works on a packed qkv (B, T, 3C) holding
// q, k, v side by side, each split into H heads of D = C / H columns, with no permuted copies.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "remat/block.h"

namespace remat::ops {

// --- linear: y = x W^T + b ------------------------------------------------------------------
// x (..., K), w (N, K), b (N) or undefined -> y (..., N).
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);
struct LinearGrads {
  at::Tensor dx, dw, db;  // dx undefined unless need_dx; db undefined without a bias
};
// Reads x and w.
LinearGrads linear_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, bool has_bias,
                            bool need_dx);

// --- layer_norm over the last dimension -----------------------------------------------------
struct LayerNormOut {
  at::Tensor y;
  at::Tensor mean, rstd;  // (..., 1) float32 statistics, the only thing backward needs besides x
};
LayerNormOut layer_norm_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps = 1e-5);
struct LayerNormGrads {
  at::Tensor dx, dw, db;  // dx undefined unless need_dx
};
// Reads x, mean, rstd (and the weights).
LayerNormGrads layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                   const at::Tensor& rstd, const at::Tensor& w, const at::Tensor& b, bool need_dx);

// The pointwise backwards below take `dx`, where to write the input's gradient: a tensor shaped
// like dy, dy itself included (the engine passes dy when nothing else holds it, and the bits are
// the same either way), or undefined for a new tensor. They return dx.

// --- gelu, tanh approximation (GPT-2) -------------------------------------------------------
at::Tensor gelu_forward(const at::Tensor& x);
// Reads x.
at::Tensor gelu_backward(const at::Tensor& dy, const at::Tensor& x, at::Tensor dx = {});

// --- relu ------------------------------------------------------------------------------------
at::Tensor relu_forward(const at::Tensor& x);
// Reads the output y (y > 0 is the mask), so the input need not be kept.
at::Tensor relu_backward(const at::Tensor& dy, const at::Tensor& y, at::Tensor dx = {});

// --- dropout: y = x * mask / (1 - p) --------------------------------------------------------
// The keep-mask (bool, true = keep) is a pure function of (seed, element index): the same seed gives
// the same mask, so a dropped mask is regenerated exactly without any input. CPU: a counter-based
// hash; CUDA: bernoulli_ on a generator seeded with `seed`.
at::Tensor dropout_mask(at::IntArrayRef shape, double p, uint64_t seed, at::Device device);
at::Tensor dropout_forward(const at::Tensor& x, const at::Tensor& mask, double p);
// Reads mask.
at::Tensor dropout_backward(const at::Tensor& dy, const at::Tensor& mask, double p, at::Tensor dx = {});

// --- attention core --------------------------------------------------------------------------
// Scores and probs are stored as `layout` says (block.h, AttentionLayout): (B, H, T, T), or causal
// row blocks packed in one 1-D tensor.
// scores = q k^T / sqrt(D); with a causal layout, entries above the diagonal are masked: the
// lowest finite value on CPU, -inf elsewhere (both give probability exactly 0).
at::Tensor scores_forward(const at::Tensor& qkv, const AttentionLayout& layout);
// Reads qkv. Adds dq and dk into the q and k columns of dqkv (allocated zeroed when undefined).
void scores_backward(const at::Tensor& dscores, const at::Tensor& qkv, const AttentionLayout& layout,
                     at::Tensor& dqkv);

// Softmax over each stored row.
at::Tensor softmax_forward(const at::Tensor& scores, const AttentionLayout& layout);
// Reads probs (the output). `dscores`: where to write, dprobs itself allowed (see gelu_backward).
at::Tensor softmax_backward(const at::Tensor& dprobs, const at::Tensor& probs, const AttentionLayout& layout,
                            at::Tensor dscores = {});

// atty = probs v with heads merged back: (B, T, C).
at::Tensor attn_values_forward(const at::Tensor& probs, const at::Tensor& qkv, const AttentionLayout& layout);
// Reads probs and qkv. Returns dprobs; adds dv into the v columns of dqkv (zeroed when undefined).
// over_probs: write dprobs over probs itself, block by block once each block's dv is done, so the
// backward needs no second T x T tensor (the caller must be probs' last reader).
at::Tensor attn_values_backward(const at::Tensor& datty, const at::Tensor& probs, const at::Tensor& qkv,
                                const AttentionLayout& layout, at::Tensor& dqkv, bool over_probs = false);

// A scores or probs tensor expanded to (B, H, T, T); positions the layout does not store get `fill`.
at::Tensor unpack_attention(const at::Tensor& packed, const AttentionLayout& layout, double fill);

// --- residual add ------------------------------------------------------------------------------
// y = a + b; the backward passes dy to both inputs and reads nothing.
at::Tensor add_forward(const at::Tensor& a, const at::Tensor& b);

// --- embedding: x = wte[tokens] + wpe[0:T] ------------------------------------------------------
// tokens (B, T) int64, wte (V, C), wpe (T_max, C) -> (B, T, C).
at::Tensor embedding_forward(const at::Tensor& tokens, const at::Tensor& wte, const at::Tensor& wpe);
struct EmbeddingGrads {
  at::Tensor dwte, dwpe;
};
// Reads tokens.
EmbeddingGrads embedding_backward(const at::Tensor& dx, const at::Tensor& tokens, const at::Tensor& wte,
                                  const at::Tensor& wpe);

// --- cross-entropy over the last dimension, mean over tokens ----------------------------------
struct CrossEntropyOut {
  at::Tensor loss;  // scalar float32
  at::Tensor logp;  // log-probabilities, the logits' shape
};
CrossEntropyOut cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets);
// Reads logp and targets. dloss: scalar.
at::Tensor cross_entropy_backward(const at::Tensor& dloss, const at::Tensor& logp, const at::Tensor& targets);

// --- mean squared error ------------------------------------------------------------------------
at::Tensor mse_forward(const at::Tensor& y, const at::Tensor& target);
// Reads y and target.
at::Tensor mse_backward(const at::Tensor& dloss, const at::Tensor& y, const at::Tensor& target);

}  // namespace remat::ops
