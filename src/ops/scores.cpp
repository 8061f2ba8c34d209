// scores: s = q k^T / sqrt(D), stored as the AttentionLayout says (block.h); causal entries above
// the diagonal hold the lowest finite value (probability exactly 0).
//   in: src (B, T, W) holding q and k (columns q_col, k_col)   out: scores
//   backward reads src; dq and dk are added into src's gradient (a slot shared with other readers).
// Each causal row block is one batched GEMM over (batch, head) on strided views (ops/gemm.h).
#include <limits>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/attention_common.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/gemm.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor& src = e.in(op, 0);
  at::Tensor scores = at::empty(l.shape(), src.options());
  const at::Tensor q = attention::q_view(src, l), k = attention::kv_view(src, l.k_col, l);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor s = attention::block_view(scores, l, r);
    detail::batched_gemm(q.narrow(3, l.first_row(r), l.rows(r)), false, k.narrow(3, 0, l.cols(r)), true, s,
                         attention::scale(l), 0.0);
    if (l.causal) attention::mask_block(s, l, r);
  }
  e.set_out(op, 0, std::move(scores));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor& src = e.saved_in(op, 0);
  const at::Tensor& dscores = e.grad_out(op, 0);
  at::Tensor& dsrc = e.grad_slot(op, 0);
  const at::Tensor q = attention::q_view(src, l), k = attention::kv_view(src, l.k_col, l);
  at::Tensor dq = attention::q_view(dsrc, l), dk = attention::kv_view(dsrc, l.k_col, l);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    const at::Tensor ds = attention::block_view(dscores, l, r);
    at::Tensor dq_rows = dq.narrow(3, l.first_row(r), l.rows(r));
    at::Tensor dk_cols = dk.narrow(3, 0, l.cols(r));
    detail::batched_gemm(ds, false, k.narrow(3, 0, l.cols(r)), false, dq_rows, attention::scale(l), 1.0);  // dS K
    detail::batched_gemm(ds, true, q.narrow(3, l.first_row(r), l.rows(r)), false, dk_cols, attention::scale(l),
                         1.0);  // dS^T Q, summed over the heads that share k
  }
}

// Grouped-query heads (4 query heads, 2 key heads) in causal row blocks of 2, 2 and 1 rows.
AttentionLayout example_layout() {
  AttentionLayout l;
  l.batch = 2, l.heads = 4, l.kv_heads = 2, l.head_dim = 3, l.seq = 5, l.block = 2, l.causal = true;
  l.q_col = 0, l.k_col = 4 * 3;
  return l;
}

BlockSpec example() {
  ModelConfig cfg;
  const AttentionLayout l = example_layout();
  detail::Builder b(cfg, "test.scores");
  const int src = b.input("qk", {2, 5, (4 + 2) * 3}, DType::F32, "q and k");
  const int s = b.op(OpKind::Scores, "scores", {src}, {{"scores", l.shape()}})[0];
  b.last().attn = l;
  return b.finish(s);
}

// Per row block: q k^T / sqrt(D). The masked entries take the kernel's value but pass gradients
// through as the kernel's backward does (it never reads the mask).
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const AttentionLayout& l = n.attn;
  const at::Tensor q = attention::heads_of(in[0], l.q_col, l.heads, l);
  const at::Tensor k = attention::heads_of(in[0], l.k_col, l.kv(), l).repeat_interleave(l.group(), 1);
  std::vector<at::Tensor> blocks;
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor s = at::matmul(q.narrow(2, l.first_row(r), l.rows(r)), k.narrow(2, 0, l.cols(r)).transpose(-1, -2)) *
                   attention::scale(l);
    if (l.causal) {
      const at::Tensor mask = at::ones({l.rows(r), l.cols(r)}, at::kBool).triu(l.first_row(r) + 1);
      const double lowest = s.scalar_type() == at::kDouble ? std::numeric_limits<double>::lowest()
                                                           : std::numeric_limits<float>::lowest();
      s = s + (at::where(mask, at::full({}, lowest, s.options()), s) - s).detach();
    }
    blocks.push_back(s);
  }
  return {attention::pack_blocks(blocks, l)};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kScores = [] {
  OpDef d;
  d.name = "scores";
  d.n_in = 1, d.n_out = 1;
  d.bwd_reads_in = 0b1;
  d.grad_in[0] = GradKind::Slot;
  d.flops = attention::flops;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
