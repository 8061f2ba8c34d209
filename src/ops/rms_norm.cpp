// rms_norm over groups of the last dimension: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps)
// (LLaMA), each group of G values (G = the weight's size: the whole C, or one head for Qwen3's q
// and k norms).
//   in: x (..., C)   out: y (..., C), rstd (..., C / G) float32   params: weight (G)
//   backward reads x and rstd; dx is a fresh tensor.
// CPU float32 runs one loop per row on remat's kernel threads (kernels.h). The weight's gradient is
// summed in fixed chunks of rows, then over the chunks by ATen's sum on one thread (a fixed order
// for a given shape): the same bits on any thread count. Elsewhere (float64, CUDA) the same math
// runs as ATen ops.

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  const at::Tensor& w = e.param(op, 0);
  const int64_t c = w.size(0), rows = x.numel() / c;
  const std::vector<int64_t>& stat = e.out_shape(op, 1);
  if (!kernels::fits(x) || !kernels::fits(w)) {
    const at::Tensor g = x.reshape({-1, c});
    at::Tensor rstd = g.pow(2).mean(-1, true).add(op.eps).rsqrt();  // in x's type (float64 in the tests)
    e.set_out(op, 0, (g * rstd * w).view(x.sizes()));
    e.set_out(op, 1, rstd.view(stat));
    return;
  }
  at::Tensor y = at::empty_like(x), rstd = at::empty(stat, x.options().dtype(at::kFloat));
  kernels::rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(op.eps), y.data_ptr<float>(),
                         rstd.data_ptr<float>(), rows, c);
  e.set_out(op, 0, std::move(y));
  e.set_out(op, 1, std::move(rstd));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.saved_in(op, 0);
  const at::Tensor& rstd = e.saved_out(op, 1);
  const at::Tensor& dy = e.grad_out(op, 0);
  const at::Tensor& w = e.param(op, 0);
  const int64_t c = w.size(0), rows = x.numel() / c;
  const bool need_dx = e.needs_grad(op, 0);
  if (!kernels::fits(x) || !kernels::fits(dy) || !kernels::fits(w)) {
    const at::Tensor s = rstd.to(x.scalar_type()).reshape({-1, 1});
    const at::Tensor xhat = x.reshape({-1, c}) * s, dy2 = dy.reshape({-1, c});
    at::Tensor dw = (dy2 * xhat).sum(0);
    if (need_dx) {
      const at::Tensor g = dy2 * w;
      e.set_grad(op, 0, (s * (g - xhat * (g * xhat).mean(-1, true))).view(x.sizes()));
    }
    e.add_param_grad(op, 0, std::move(dw));
    return;
  }
  at::Tensor dx = need_dx ? at::empty_like(x) : at::Tensor();
  at::Tensor partial = at::empty({kernels::norm_chunks(rows), c}, x.options());
  kernels::rms_norm_rows_backward(dy.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(),
                                  w.data_ptr<float>(), need_dx ? dx.data_ptr<float>() : nullptr,
                                  partial.data_ptr<float>(), rows, c);
  at::Tensor dw = partial.sum(0);
  if (need_dx) e.set_grad(op, 0, std::move(dx));
  e.add_param_grad(op, 0, std::move(dw));
}

// The weight gradient's partial sums, one row of C per chunk of 64 rows (the float32 CPU path's;
// the ATen ops elsewhere make temporaries of their own, which this does not model).
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const TensorSpec& x = b.tensors[n.in[0]];
  const int64_t c = b.params[n.params[0]].numel();
  return kernels::norm_chunks(x.numel() / c) * c * dtype_size(x.dtype);
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.rms_norm");
  const int x = b.input("x", {2, 70, 8}, DType::F32, "input");  // 140 rows: three chunks
  const std::vector<int> y = b.op(OpKind::RmsNorm, "y", {x}, {{"y", {2, 70, 8}}, {"y_rstd", {2, 70, 1}}},
                                  {{"y.weight", {8}, Init::Ones, 0.0, false}});
  b.last().eps = 1e-5;
  return b.finish(y[0]);
}

// Per head (Qwen3's q and k norms): 3 heads of 4, 72 rows of a head.
BlockSpec heads_example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.rms_norm_heads");
  const int x = b.input("q", {2, 12, 3 * 4}, DType::F32, "input");
  const std::vector<int> y =
      b.op(OpKind::RmsNorm, "q_norm", {x}, {{"q_norm", {2, 12, 12}}, {"q_norm_rstd", {2, 12, 3}}},
           {{"q_norm.weight", {4}, Init::Ones, 0.0, false}});
  b.last().eps = 1e-6;
  return b.finish(y[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in,
                                  const std::vector<at::Tensor>& p) {
  const int64_t g = p[0].size(0);
  std::vector<int64_t> groups = in[0].sizes().vec();
  groups.back() /= g;
  groups.push_back(g);
  const at::Tensor x = in[0].reshape(groups);
  const at::Tensor rstd = x.pow(2).mean(-1, true).add(n.eps).rsqrt();
  std::vector<int64_t> stat = in[0].sizes().vec();
  stat.back() /= g;
  return {(x * rstd * p[0]).reshape(in[0].sizes()), rstd.reshape(stat)};
}

const detail::OpTestCase kTest{example, reference, 0, true, heads_example};

// Eager PyTorch's RMSNorm (torchtitan's, Hugging Face's): x.float() (4 bytes an element, x itself
// in fp32) is saved by the square and the product with rstd, and the normalised value in the model's
// dtype by the product with the weight; x itself is not. Against this op's saved x: 4 bytes an
// element more, in any dtype.
int64_t eager_saved(const BlockSpec& b, const OpNode& n) { return b.tensors[n.in[0]].numel() * 4; }

}  // namespace

extern const OpDef kRmsNorm = [] {
  OpDef d;
  d.name = "rms_norm";
  d.n_in = 1, d.n_out = 2, d.max_params = 1;
  d.bwd_reads_in = 0b1;
  d.bwd_reads_out = 0b10;
  d.grad_in[0] = GradKind::Fresh;
  d.backward_scratch = backward_scratch;
  d.forward = forward;
  d.backward = backward;
  d.eager_saved = eager_saved;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
