// attn_values: out = probs v, heads merged back: (B, T, H D).
//   in: probs, src (B, T, W) holding v (columns v_col)   out: atty
//   backward reads probs and src; dprobs may be written over probs (when this backward is the last
//   to read it: block by block, once each block's dv is done), and dv is added into src's gradient.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/attention_common.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/gemm.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

// CPU float32: one task per (batch, key/value head), v copied into the task's buffer once for
// all row blocks (NOTE [The engine's GEMMs], 5).
void forward_by_head(const at::Tensor& probs, const at::Tensor& src, at::Tensor& atty, const AttentionLayout& l) {
  const int64_t T = l.seq, D = l.head_dim, G = l.group(), sb = src.stride(0), st = src.stride(1);
  const int64_t ob = atty.stride(0), ot = atty.stride(1);
  const float* p = probs.data_ptr<float>();
  const float* x = src.data_ptr<float>();
  float* o = atty.data_ptr<float>();
  attention::for_each_kv_head(l, [&](int64_t b, int64_t kv) {
    float* v = detail::thread_scratch(detail::Scratch::Operand0, T * D);
    attention::pack_rows(x + b * sb + l.v_col + kv * D, st, T, D, v);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < l.blocks(); ++r) {
        const float* pr = p + attention::matrix_offset(l, r, b, kv * G + g);
        detail::sgemm(false, false, l.rows(r), D, l.cols(r), 1.0f, pr, l.cols(r), v, D, 0.0f,
                      o + b * ob + l.first_row(r) * ot + (kv * G + g) * D, ot);
      }
  });
}

// The backward's products in the same tasks, for each row block and head: P^T dO added into dv
// (shared by the group's heads, in the batched path's order: row block, then head), then dO V^T,
// which may overwrite that block of P (no later product reads it).
void backward_by_head(const at::Tensor& probs, at::Tensor& dprobs, const at::Tensor& src, const at::Tensor& dout,
                      at::Tensor& dsrc, const AttentionLayout& l) {
  const int64_t T = l.seq, D = l.head_dim, G = l.group(), sb = src.stride(0), st = src.stride(1);
  const int64_t gb = dout.stride(0), gt = dout.stride(1), db = dsrc.stride(0), dt = dsrc.stride(1);
  const float* p = probs.data_ptr<float>();
  float* dp = dprobs.data_ptr<float>();
  const float* x = src.data_ptr<float>();
  const float* dy = dout.data_ptr<float>();
  float* dx = dsrc.data_ptr<float>();
  attention::for_each_kv_head(l, [&](int64_t b, int64_t kv) {
    float* v = detail::thread_scratch(detail::Scratch::Operand0, T * D);
    float* go = detail::thread_scratch(detail::Scratch::Operand1, G * T * D);
    attention::pack_rows(x + b * sb + l.v_col + kv * D, st, T, D, v);
    for (int64_t g = 0; g < G; ++g) attention::pack_rows(dy + b * gb + (kv * G + g) * D, gt, T, D, go + g * T * D);
    float* dv = dx + b * db + l.v_col + kv * D;
    for (int64_t r = 0; r < l.blocks(); ++r) {
      const int64_t rows = l.rows(r), cols = l.cols(r);
      for (int64_t g = 0; g < G; ++g) {
        const float* dor = go + (g * T + l.first_row(r)) * D;
        const int64_t off = attention::matrix_offset(l, r, b, kv * G + g);  // P's and dP's matrix
        detail::sgemm(true, false, cols, D, rows, 1.0f, p + off, cols, dor, D, 1.0f, dv, dt);
        detail::sgemm(false, true, rows, cols, D, 1.0f, dor, D, v, D, 0.0f, dp + off, cols);
      }
    }
  });
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor& probs = e.in(op, 0);
  const at::Tensor& src = e.in(op, 1);
  at::Tensor atty = at::empty({src.size(0), src.size(1), l.heads * l.head_dim}, src.options());
  if (attention::head_products({&probs, &src, &atty}) && probs.is_contiguous()) {
    forward_by_head(probs, src, atty, l);
    return e.set_out(op, 0, std::move(atty));
  }
  const at::Tensor v = attention::kv_view(src, l.v_col, l);
  at::Tensor out = attention::heads_view(atty, l);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor out_rows = out.narrow(3, l.first_row(r), l.rows(r));
    detail::batched_gemm(attention::block_view(probs, l, r), false, v.narrow(3, 0, l.cols(r)), false, out_rows, 1.0,
                         0.0);
  }
  e.set_out(op, 0, std::move(atty));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  at::Tensor dprobs = e.grad_buffer(op, 0);  // probs itself when this is its last reader
  const at::Tensor probs = dprobs.defined() ? dprobs : e.saved_in(op, 0);
  const at::Tensor& src = e.saved_in(op, 1);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  const at::Tensor dout = attention::heads_view(dy, l);
  const at::Tensor v = attention::kv_view(src, l.v_col, l);
  if (!dprobs.defined()) dprobs = at::empty_like(probs);
  at::Tensor& dsrc = e.grad_slot(op, 1);
  if (attention::head_products({&probs, &dprobs, &src, &dy, &dsrc}) && probs.is_contiguous() &&
      dprobs.is_contiguous()) {
    backward_by_head(probs, dprobs, src, dy, dsrc, l);
    return e.set_grad(op, 0, std::move(dprobs));
  }
  at::Tensor dv = attention::kv_view(dsrc, l.v_col, l);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    const at::Tensor dout_rows = dout.narrow(3, l.first_row(r), l.rows(r));
    at::Tensor dv_cols = dv.narrow(3, 0, l.cols(r));
    // P^T dO first (summed over the heads that share v): this block of P is not read again...
    detail::batched_gemm(attention::block_view(probs, l, r), true, dout_rows, false, dv_cols, 1.0, 1.0);
    at::Tensor dp = attention::block_view(dprobs, l, r);
    // ...so dO V^T may overwrite it.
    detail::batched_gemm(dout_rows, false, v.narrow(3, 0, l.cols(r)), true, dp, 1.0, 0.0);
  }
  e.set_grad(op, 0, std::move(dprobs));
}

BlockSpec example() {
  ModelConfig cfg;
  AttentionLayout l;
  l.batch = 2, l.heads = 4, l.kv_heads = 2, l.head_dim = 3, l.seq = 5, l.block = 2, l.causal = true;
  l.v_col = 3;  // v after some other columns
  detail::Builder b(cfg, "test.attn_values");
  const int p = b.input("probs", l.shape(), DType::F32, "probabilities");
  const int v = b.input("v", {2, 5, 3 + 2 * 3}, DType::F32, "values");
  const int y = b.op(OpKind::AttnValues, "atty", {p, v}, {{"atty", {2, 5, 4 * 3}}})[0];
  b.last().attn = l;
  return b.finish(y);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const AttentionLayout& l = n.attn;
  const at::Tensor v = attention::heads_of(in[n.in[1]], l.v_col, l.kv(), l).repeat_interleave(l.group(), 1);
  std::vector<at::Tensor> rows;
  const std::vector<at::Tensor> p = attention::blocks_of(in[n.in[0]], l);
  for (int64_t r = 0; r < l.blocks(); ++r) rows.push_back(at::matmul(p[r], v.narrow(2, 0, l.cols(r))));
  return {at::cat(rows, 2).permute({0, 2, 1, 3}).reshape({l.batch, l.seq, l.heads * l.head_dim})};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kAttnValues = [] {
  OpDef d;
  d.name = "attn_values";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b11;
  d.grad_in[0] = GradKind::OverInput;
  d.grad_in[1] = GradKind::Slot;
  d.flops = attention::flops;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
