// scores: s = q k^T / sqrt(D), stored as the AttentionLayout says (block.h); causal entries above
// the diagonal hold the lowest finite value (probability exactly 0).
//   in: q_src (B, T, Wq) holding q at column q_col, k_src (B, T, Wk) holding k at k_col; one tensor
//       may be both (a fused qkv projection)   out: scores
//   backward reads both; dq and dk are added into their gradients (slots shared with other readers).
// CPU float32: a task per (batch, key/value head) runs all its products (NOTE [The engine's GEMMs],
// 5). Elsewhere each causal row block is one batched GEMM over (batch, head) on strided views
// (util/gemm.h).
#include <limits>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/attention_common.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/gemm.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

// CPU float32: one task per (batch, key/value head), k and the group's q copied into the task's
// buffers once for all row blocks (NOTE [The engine's GEMMs], 5).
void forward_by_head(const at::Tensor& qs, const at::Tensor& ks, at::Tensor& scores, const AttentionLayout& l) {
  const int64_t T = l.seq, D = l.head_dim, G = l.group();
  const float* xq = qs.data_ptr<float>();
  const float* xk = ks.data_ptr<float>();
  float* s = scores.data_ptr<float>();
  const auto scale = static_cast<float>(attention::scale(l));
  attention::for_each_kv_head(l, [&](int64_t b, int64_t kv) {
    float* k = detail::thread_scratch(detail::Scratch::Operand0, T * D);
    float* q = detail::thread_scratch(detail::Scratch::Operand1, T * D);
    attention::pack_rows(xk + b * ks.stride(0) + l.k_col + kv * D, ks.stride(1), T, D, k);
    for (int64_t g = 0; g < G; ++g) {
      attention::pack_rows(xq + b * qs.stride(0) + l.q_col + (kv * G + g) * D, qs.stride(1), T, D, q);
      for (int64_t r = 0; r < l.blocks(); ++r) {
        float* block = s + attention::matrix_offset(l, r, b, kv * G + g);
        detail::sgemm(false, true, l.rows(r), l.cols(r), D, scale, q + l.first_row(r) * D, D, k, D, 0.0f, block,
                      l.cols(r));
        if (l.causal) attention::mask_matrix(block, l, r);
      }
    }
  });
}

// The backward's products in the same tasks: dS K into dq, dS^T Q added into dk (shared by the
// group's heads, in the order the batched path adds them: row block, then head).
void backward_by_head(const at::Tensor& qs, const at::Tensor& ks, const at::Tensor& dscores, at::Tensor& dqs,
                      at::Tensor& dks, const AttentionLayout& l) {
  const int64_t T = l.seq, D = l.head_dim, G = l.group();
  const float* xq = qs.data_ptr<float>();
  const float* xk = ks.data_ptr<float>();
  const float* ds = dscores.data_ptr<float>();
  float* dxq = dqs.data_ptr<float>();
  float* dxk = dks.data_ptr<float>();
  const auto scale = static_cast<float>(attention::scale(l));
  attention::for_each_kv_head(l, [&](int64_t b, int64_t kv) {
    float* k = detail::thread_scratch(detail::Scratch::Operand0, T * D);
    float* q = detail::thread_scratch(detail::Scratch::Operand1, G * T * D);
    attention::pack_rows(xk + b * ks.stride(0) + l.k_col + kv * D, ks.stride(1), T, D, k);
    for (int64_t g = 0; g < G; ++g)
      attention::pack_rows(xq + b * qs.stride(0) + l.q_col + (kv * G + g) * D, qs.stride(1), T, D, q + g * T * D);
    float* dk = dxk + b * dks.stride(0) + l.k_col + kv * D;
    for (int64_t r = 0; r < l.blocks(); ++r) {
      const int64_t rows = l.rows(r), cols = l.cols(r), first = l.first_row(r);
      for (int64_t g = 0; g < G; ++g) {
        const float* d = ds + attention::matrix_offset(l, r, b, kv * G + g);
        float* dq = dxq + b * dqs.stride(0) + first * dqs.stride(1) + l.q_col + (kv * G + g) * D;
        detail::sgemm(false, false, rows, D, cols, scale, d, cols, k, D, 1.0f, dq, dqs.stride(1));  // dS K
        detail::sgemm(true, false, cols, D, rows, scale, d, cols, q + (g * T + first) * D, D, 1.0f, dk,
                      dks.stride(1));  // dS^T Q
      }
    }
  });
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor &qs = e.in(op, 0), &ks = e.in(op, 1);
  at::Tensor scores = at::empty(l.shape(), qs.options());
  if (attention::head_products({&qs, &ks, &scores})) {
    forward_by_head(qs, ks, scores, l);
    return e.set_out(op, 0, std::move(scores));
  }
  const at::Tensor q = attention::q_view(qs, l), k = attention::kv_view(ks, l.k_col, l);
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
  const at::Tensor &qs = e.saved_in(op, 0), &ks = e.saved_in(op, 1);
  const at::Tensor& dscores = e.grad_out(op, 0);
  at::Tensor& dqs = e.grad_slot(op, 0);
  at::Tensor& dks = e.grad_slot(op, 1);  // the same tensor as dqs when q and k share one
  if (attention::head_products({&qs, &ks, &dscores, &dqs, &dks}) && dscores.is_contiguous())
    return backward_by_head(qs, ks, dscores, dqs, dks, l);
  const at::Tensor q = attention::q_view(qs, l), k = attention::kv_view(ks, l.k_col, l);
  at::Tensor dq = attention::q_view(dqs, l), dk = attention::kv_view(dks, l.k_col, l);
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

// q and k in one tensor (a fused projection).
BlockSpec fused_example() {
  ModelConfig cfg;
  const AttentionLayout l = example_layout();
  detail::Builder b(cfg, "test.scores_fused");
  const int src = b.input("qk", {2, 5, (4 + 2) * 3}, DType::F32, "q and k");
  const int s = b.op(OpKind::Scores, "scores", {src, src}, {{"scores", l.shape()}})[0];
  b.last().attn = l;
  return b.finish(s);
}

// q and k in tensors of their own.
BlockSpec example() {
  ModelConfig cfg;
  AttentionLayout l = example_layout();
  l.k_col = 0;
  detail::Builder b(cfg, "test.scores");
  const int q = b.input("q", {2, 5, 4 * 3}, DType::F32, "q");
  const int k = b.input("k", {2, 5, 2 * 3}, DType::F32, "k");
  const int s = b.op(OpKind::Scores, "scores", {q, k}, {{"scores", l.shape()}})[0];
  b.last().attn = l;
  return b.finish(s);
}

// Per row block: q k^T / sqrt(D). The masked entries take the kernel's value but pass gradients
// through as the kernel's backward does (it never reads the mask).
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const AttentionLayout& l = n.attn;
  const at::Tensor q = attention::heads_of(in[n.in[0]], l.q_col, l.heads, l);
  const at::Tensor k = attention::heads_of(in[n.in[1]], l.k_col, l.kv(), l).repeat_interleave(l.group(), 1);
  std::vector<at::Tensor> blocks;
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor s = at::matmul(q.narrow(2, l.first_row(r), l.rows(r)), k.narrow(2, 0, l.cols(r)).transpose(-1, -2)) *
                   attention::scale(l);
    if (l.causal) {
      const at::Tensor mask = at::ones({l.rows(r), l.cols(r)}, at::kBool).triu(l.first_row(r) + 1);
      const double lowest =
          s.scalar_type() == at::kDouble ? std::numeric_limits<double>::lowest() : std::numeric_limits<float>::lowest();
      s = s + (at::where(mask, at::full({}, lowest, s.options()), s) - s).detach();
    }
    blocks.push_back(s);
  }
  return {attention::pack_blocks(blocks, l)};
}

const detail::OpTestCase kTest{example, reference, 0, true, fused_example};

}  // namespace

extern const OpDef kScores = [] {
  OpDef d;
  d.name = "scores";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b11;
  d.grad_in[0] = GradKind::Slot;
  d.grad_in[1] = GradKind::Slot;
  d.flops = attention::flops;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
