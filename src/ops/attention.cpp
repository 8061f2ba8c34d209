// Core attention on a packed qkv (B, T, 3C): scores, softmax, probs x V.
//   scores:      reads qkv (q, k)      -> dq, dk into dqkv
//   softmax:     reads probs           -> dscores
//   attn_values: reads probs, qkv (v)  -> dprobs, and dv into dqkv
// q, k and v of head h are strided views of qkv (row stride 3C); the output is written straight
// into the merged-heads (B, T, C) layout. Scores and probs follow an AttentionLayout: one
// (B, H, T, T) block, or causal row blocks that hold only the columns the mask leaves (block.h).
// Every op loops over the layout's blocks; each block is one batched GEMM over (batch, head).
#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "ops/gemm.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "remat/error.h"
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

// Block r of a scores/probs tensor as (B, H, rows, cols).
at::Tensor block_of(const at::Tensor& packed, const AttentionLayout& l, int64_t r) {
  if (l.blocks() == 1) return packed;
  const int64_t n = l.offset(r + 1) - l.offset(r);
  return packed.narrow(0, l.offset(r), n).view({l.batch, l.heads, l.rows(r), l.cols(r)});
}

double scale_of(const at::Tensor& qkv, const AttentionLayout& l) {
  return 1.0 / std::sqrt(static_cast<double>(qkv.size(2) / 3 / l.heads));
}

at::Tensor& zeros_if_undefined(at::Tensor& t, const at::Tensor& like) {
  if (!t.defined()) t = at::zeros_like(like);
  return t;
}

// Sets entries above the causal diagonal of block r (rows from `first`) to the lowest finite value:
// its exp underflows to exactly 0 like -inf's, and the fast softmax never meets an infinity.
template <typename T>
void mask_rows(T* p, int64_t matrices, int64_t rows, int64_t cols, int64_t first) {
  const T neg_inf = std::numeric_limits<T>::lowest();
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t i = 0; i < rows; ++i) {
      T* row = p + (m * rows + i) * cols;
      std::fill(row + std::min(cols, first + i + 1), row + cols, neg_inf);
    }
}

void mask_block(at::Tensor& s, const AttentionLayout& l, int64_t r) {
  const int64_t rows = l.rows(r), cols = l.cols(r), first = l.first_row(r);
  if (s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == at::kFloat)
    mask_rows(s.data_ptr<float>(), l.batch * l.heads, rows, cols, first);
  else if (s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == at::kDouble)
    mask_rows(s.data_ptr<double>(), l.batch * l.heads, rows, cols, first);
  else
    s.masked_fill_(at::ones({rows, cols}, s.options().dtype(at::kBool)).triu_(first + 1), -INFINITY);
}

}  // namespace

at::Tensor scores_forward(const at::Tensor& qkv, const AttentionLayout& l) {
  at::Tensor scores = at::empty(l.shape(), qkv.options());
  const at::Tensor q = head_view(qkv, 0, l.heads), k = head_view(qkv, 1, l.heads);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor s = block_of(scores, l, r);
    detail::batched_gemm(q.narrow(2, l.first_row(r), l.rows(r)), false, k.narrow(2, 0, l.cols(r)), true, s,
                         scale_of(qkv, l), 0.0);
    if (l.causal) mask_block(s, l, r);
  }
  return scores;
}

void scores_backward(const at::Tensor& dscores, const at::Tensor& qkv, const AttentionLayout& l, at::Tensor& dqkv) {
  zeros_if_undefined(dqkv, qkv);
  const at::Tensor q = head_view(qkv, 0, l.heads), k = head_view(qkv, 1, l.heads);
  at::Tensor dq = head_view(dqkv, 0, l.heads), dk = head_view(dqkv, 1, l.heads);
  const double scale = scale_of(qkv, l);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    const at::Tensor ds = block_of(dscores, l, r);
    at::Tensor dq_rows = dq.narrow(2, l.first_row(r), l.rows(r));
    at::Tensor dk_cols = dk.narrow(2, 0, l.cols(r));
    detail::batched_gemm(ds, false, k.narrow(2, 0, l.cols(r)), false, dq_rows, scale, 1.0);        // dS K
    detail::batched_gemm(ds, true, q.narrow(2, l.first_row(r), l.rows(r)), false, dk_cols, scale, 1.0);  // dS^T Q
  }
}

at::Tensor softmax_forward(const at::Tensor& scores, const AttentionLayout& l) {
  const bool fast = scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.is_contiguous();
  if (l.blocks() == 1 && !fast) return at::_softmax(scores, -1, false);
  at::Tensor probs = at::empty_like(scores);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor p = block_of(probs, l, r);
    const at::Tensor s = block_of(scores, l, r);
    if (fast)  // remat's vectorised loop (ops/kernels.h)
      kernels::softmax_rows(s.data_ptr<float>(), p.data_ptr<float>(), l.batch * l.heads * l.rows(r), l.cols(r));
    else
      at::_softmax_out(p, s, -1, false);
  }
  return probs;
}

at::Tensor softmax_backward(const at::Tensor& dprobs, const at::Tensor& probs, const AttentionLayout& l,
                            at::Tensor dscores) {
  const bool fast = probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.is_contiguous() &&
                    dprobs.is_contiguous() && (!dscores.defined() || dscores.is_contiguous());
  if (!dscores.defined()) dscores = at::empty_like(probs);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor ds = block_of(dscores, l, r);
    const at::Tensor dp = block_of(dprobs, l, r), p = block_of(probs, l, r);
    if (fast)  // may run in place (ds == dp): each row is read whole before it is written
      kernels::softmax_rows_backward(p.data_ptr<float>(), dp.data_ptr<float>(), ds.data_ptr<float>(),
                                     l.batch * l.heads * l.rows(r), l.cols(r));
    else  // a temporary, then the copy: ATen does not promise in-place softmax backward
      ds.copy_(at::_softmax_backward_data(dp, p, -1, probs.scalar_type()));
  }
  return dscores;
}

at::Tensor attn_values_forward(const at::Tensor& probs, const at::Tensor& qkv, const AttentionLayout& l) {
  at::Tensor atty = at::empty({qkv.size(0), qkv.size(1), qkv.size(2) / 3}, qkv.options());
  const at::Tensor v = head_view(qkv, 2, l.heads);
  at::Tensor out = heads_of(atty, l.heads);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor out_rows = out.narrow(2, l.first_row(r), l.rows(r));
    detail::batched_gemm(block_of(probs, l, r), false, v.narrow(2, 0, l.cols(r)), false, out_rows, 1.0, 0.0);
  }
  return atty;
}

at::Tensor attn_values_backward(const at::Tensor& datty, const at::Tensor& probs, const at::Tensor& qkv,
                                const AttentionLayout& l, at::Tensor& dqkv, bool over_probs) {
  const at::Tensor dout = heads_of(datty.contiguous(), l.heads);
  const at::Tensor v = head_view(qkv, 2, l.heads);
  at::Tensor dprobs = over_probs ? probs : at::empty_like(probs);
  zeros_if_undefined(dqkv, qkv);
  at::Tensor dv = head_view(dqkv, 2, l.heads);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    const at::Tensor dout_rows = dout.narrow(2, l.first_row(r), l.rows(r));
    at::Tensor dv_cols = dv.narrow(2, 0, l.cols(r));
    detail::batched_gemm(block_of(probs, l, r), true, dout_rows, false, dv_cols, 1.0, 1.0);  // P^T dO, first:
    at::Tensor dp = block_of(dprobs, l, r);  // this block of P is not read again
    detail::batched_gemm(dout_rows, false, v.narrow(2, 0, l.cols(r)), true, dp, 1.0, 0.0);  // dO V^T
  }
  return dprobs;
}

at::Tensor unpack_attention(const at::Tensor& packed, const AttentionLayout& l, double fill) {
  at::Tensor full = at::full({l.batch, l.heads, l.seq, l.seq}, fill, packed.options());
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor dst = full.narrow(2, l.first_row(r), l.rows(r)).narrow(3, 0, l.cols(r));
    dst.copy_(block_of(packed, l, r));
    if (l.causal)
      dst.masked_fill_(at::ones({l.rows(r), l.cols(r)}, packed.options().dtype(at::kBool)).triu_(l.first_row(r) + 1),
                       fill);
  }
  return full;
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void scores_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::scores_forward(e.in(op, 0), op.attn)); }
void scores_bwd(OpEnv& e, const OpNode& op) {
  ops::scores_backward(e.grad_out(op, 0), e.saved_in(op, 0), op.attn, e.grad_slot(op, 0));
}

void softmax_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::softmax_forward(e.in(op, 0), op.attn)); }
void softmax_bwd(OpEnv& e, const OpNode& op) {
  at::Tensor ds = e.take_grad_out(op);  // undefined unless dy is this op's alone
  e.add_grad(op, 0, ops::softmax_backward(ds.defined() ? ds : e.grad_out(op, 0), e.saved_out(op, 0), op.attn, ds));
}

void values_fwd(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::attn_values_forward(e.in(op, 0), e.in(op, 1), op.attn));
}
void values_bwd(OpEnv& e, const OpNode& op) {
  at::Tensor dprobs;
  {
    const at::Tensor probs = e.take_in(op, 0);  // defined when this backward is probs' last reader
    const bool over = probs.defined();
    dprobs = ops::attn_values_backward(e.grad_out(op, 0), over ? probs : e.saved_in(op, 0), e.saved_in(op, 1),
                                       op.attn, e.grad_slot(op, 1), over);
  }
  e.add_grad(op, 0, std::move(dprobs));
}

// The fused kernel is CUDA + LibTorch 2.x only; GPTImpl refuses --attention flash before any run,
// so these are reached only if that check is bypassed.
void flash_unavailable(OpEnv&, const OpNode&) {
  fail("--attention flash runs on CUDA with LibTorch 2.x; this build runs --attention math (plan takes both)");
}

}  // namespace
extern const OpImpl kFlashAttentionImpl{flash_unavailable, flash_unavailable};
extern const OpImpl kScoresImpl{scores_fwd, scores_bwd};
extern const OpImpl kSoftmaxImpl{softmax_fwd, softmax_bwd};
extern const OpImpl kAttnValuesImpl{values_fwd, values_bwd};
}  // namespace remat::detail
