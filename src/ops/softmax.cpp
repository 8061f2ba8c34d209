// softmax over each stored row of an AttentionLayout (masked entries hold the lowest finite value,
// so they get probability exactly 0).
//   in: scores   out: probs   backward reads probs; dscores may be written over dprobs.
// Float32 CPU runs remat's own kernel (kernels.h); elsewhere ATen's.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/attention_common.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor& scores = e.in(op, 0);
  if (l.blocks() == 1 && !kernels::fits(scores)) return e.set_out(op, 0, at::_softmax(scores, -1, false));
  at::Tensor probs = at::empty_like(scores);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor p = attention::block_view(probs, l, r);
    const at::Tensor s = attention::block_view(scores, l, r);
    if (kernels::fits(scores))
      kernels::softmax_rows(s.data_ptr<float>(), p.data_ptr<float>(), l.batch * l.heads * l.rows(r), l.cols(r));
    else
      at::_softmax_out(p, s, -1, false);
  }
  e.set_out(op, 0, std::move(probs));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor& probs = e.saved_out(op, 0);
  at::Tensor ds_all = e.grad_buffer(op, 0);  // dprobs itself when the plan writes over it
  const at::Tensor dprobs = ds_all.defined() ? ds_all : e.grad_out(op, 0);
  const bool use_kernel = kernels::fits(probs) && kernels::fits(dprobs);
  if (!ds_all.defined()) ds_all = at::empty_like(probs);
  for (int64_t r = 0; r < l.blocks(); ++r) {
    at::Tensor ds = attention::block_view(ds_all, l, r);
    const at::Tensor dp = attention::block_view(dprobs, l, r), p = attention::block_view(probs, l, r);
    if (use_kernel)  // may run in place (ds == dp): each row is read whole before it is written
      kernels::softmax_rows_backward(p.data_ptr<float>(), dp.data_ptr<float>(), ds.data_ptr<float>(),
                                     l.batch * l.heads * l.rows(r), l.cols(r));
    else  // a temporary, then the copy: ATen does not promise an in-place softmax backward
      ds.copy_(at::_softmax_backward_data(dp, p, -1, probs.scalar_type()));
  }
  e.set_grad(op, 0, std::move(ds_all));
}

BlockSpec example() {
  ModelConfig cfg;
  AttentionLayout l;
  l.batch = 2, l.heads = 3, l.head_dim = 2, l.seq = 5, l.block = 2, l.causal = true;
  detail::Builder b(cfg, "test.softmax");
  const int s = b.input("scores", l.shape(), DType::F32, "scores");
  const int p = b.op(OpKind::Softmax, "probs", {s}, {{"probs", l.shape()}})[0];
  b.last().attn = l;
  return b.finish(p);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  std::vector<at::Tensor> blocks;
  for (const at::Tensor& s : attention::blocks_of(in[0], n.attn)) blocks.push_back(at::softmax(s, -1));
  return {attention::pack_blocks(blocks, n.attn)};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kSoftmax = [] {
  OpDef d;
  d.name = "softmax";
  d.n_in = 1, d.n_out = 1;
  d.bwd_reads_out = 0b1;
  d.grad_in[0] = GradKind::OverDy;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
