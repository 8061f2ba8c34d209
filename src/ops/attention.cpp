// Core attention on a packed qkv (B, T, 3C): scores, softmax, probs x V.
//   scores:      reads qkv (q, k)      -> dq, dk into dqkv
//   softmax:     reads probs           -> dscores
//   attn_values: reads probs, qkv (v)  -> dprobs, and dv into dqkv
// q, k and v of head h are strided views of qkv (row stride 3C); the output is written straight
// into the merged-heads (B, T, C) layout. No permuted copies are made.
#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "ops/gemm.h"
#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

namespace {

// Part `which` (0 = q, 1 = k, 2 = v) of qkv as (B, H, T, D).
at::Tensor head_view(const at::Tensor& qkv, int which, int64_t heads) {
  const int64_t c = qkv.size(2) / 3;
  return qkv.narrow(2, which * c, c).view({qkv.size(0), qkv.size(1), heads, c / heads}).transpose(1, 2);
}

// A (B, T, C) tensor as (B, H, T, D).
at::Tensor heads_of(const at::Tensor& btc, int64_t heads) {
  return btc.view({btc.size(0), btc.size(1), heads, btc.size(2) / heads}).transpose(1, 2);
}

at::Tensor& zeros_if_undefined(at::Tensor& t, const at::Tensor& like) {
  if (!t.defined()) t = at::zeros_like(like);
  return t;
}

template <typename T>
void fill_upper(at::Tensor& scores) {
  const int64_t n = scores.size(-1);
  const int64_t rows = scores.numel() / n;
  T* p = scores.data_ptr<T>();
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r % n;  // query position
    std::fill(p + r * n + i + 1, p + (r + 1) * n, neg_inf);
  }
}

}  // namespace

at::Tensor scores_forward(const at::Tensor& qkv, int64_t heads, bool causal) {
  const int64_t b = qkv.size(0), t = qkv.size(1), d = qkv.size(2) / 3 / heads;
  at::Tensor scores = at::empty({b, heads, t, t}, qkv.options());
  detail::batched_gemm(head_view(qkv, 0, heads), false, head_view(qkv, 1, heads), true, scores,
                       1.0 / std::sqrt(static_cast<double>(d)), 0.0);
  if (causal) {
    if (scores.device().is_cpu() && scores.scalar_type() == at::kFloat) fill_upper<float>(scores);
    else if (scores.device().is_cpu() && scores.scalar_type() == at::kDouble) fill_upper<double>(scores);
    else scores.masked_fill_(at::ones({t, t}, qkv.options().dtype(at::kBool)).triu_(1), -INFINITY);
  }
  return scores;
}

void scores_backward(const at::Tensor& dscores, const at::Tensor& qkv, int64_t heads, at::Tensor& dqkv) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(qkv.size(2) / 3 / heads));
  zeros_if_undefined(dqkv, qkv);
  at::Tensor dq = head_view(dqkv, 0, heads), dk = head_view(dqkv, 1, heads);
  detail::batched_gemm(dscores, false, head_view(qkv, 1, heads), false, dq, scale, 1.0);  // dS K
  detail::batched_gemm(dscores, true, head_view(qkv, 0, heads), false, dk, scale, 1.0);   // dS^T Q
}

at::Tensor softmax_forward(const at::Tensor& scores) { return at::_softmax(scores, -1, false); }

at::Tensor softmax_backward(const at::Tensor& dprobs, const at::Tensor& probs) {
  return at::_softmax_backward_data(dprobs, probs, -1, probs.scalar_type());
}

at::Tensor attn_values_forward(const at::Tensor& probs, const at::Tensor& qkv, int64_t heads) {
  at::Tensor atty = at::empty({qkv.size(0), qkv.size(1), qkv.size(2) / 3}, qkv.options());
  at::Tensor out = heads_of(atty, heads);
  detail::batched_gemm(probs, false, head_view(qkv, 2, heads), false, out, 1.0, 0.0);
  return atty;
}

at::Tensor attn_values_backward(const at::Tensor& datty, const at::Tensor& probs, const at::Tensor& qkv,
                                int64_t heads, at::Tensor& dqkv) {
  const at::Tensor dout = heads_of(datty.contiguous(), heads);
  at::Tensor dprobs = at::empty_like(probs);
  detail::batched_gemm(dout, false, head_view(qkv, 2, heads), true, dprobs, 1.0, 0.0);  // dO V^T
  zeros_if_undefined(dqkv, qkv);
  at::Tensor dv = head_view(dqkv, 2, heads);
  detail::batched_gemm(probs, true, dout, false, dv, 1.0, 1.0);  // P^T dO
  return dprobs;
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void scores_fwd(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::scores_forward(e.in(op, 0), op.heads, op.causal));
}
void scores_bwd(OpEnv& e, const OpNode& op) {
  ops::scores_backward(e.grad_out(op, 0), e.saved_in(op, 0), op.heads, e.grad_slot(op, 0));
}

void softmax_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::softmax_forward(e.in(op, 0))); }
void softmax_bwd(OpEnv& e, const OpNode& op) {
  e.add_grad(op, 0, ops::softmax_backward(e.grad_out(op, 0), e.saved_out(op, 0)));
}

void values_fwd(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::attn_values_forward(e.in(op, 0), e.in(op, 1), op.heads));
}
void values_bwd(OpEnv& e, const OpNode& op) {
  at::Tensor dprobs =
      ops::attn_values_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.saved_in(op, 1), op.heads, e.grad_slot(op, 1));
  e.add_grad(op, 0, std::move(dprobs));
}

}  // namespace
extern const OpImpl kScoresImpl{scores_fwd, scores_bwd};
extern const OpImpl kSoftmaxImpl{softmax_fwd, softmax_bwd};
extern const OpImpl kAttnValuesImpl{values_fwd, values_bwd};
}  // namespace remat::detail
