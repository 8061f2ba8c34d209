// layer_norm over the last dimension: y = (x - mean) * rstd * w + b.
//   in: x (..., C)   out: y (..., C), mean (..., 1), rstd (..., 1) float32   params: weight, bias (C)
//   backward reads x, mean and rstd; dx is a fresh tensor.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, e.param(op, 0), e.param(op, 1), op.eps);
  e.set_out(op, 0, std::move(y));
  e.set_out(op, 1, std::move(mean));
  e.set_out(op, 2, std::move(rstd));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.saved_in(op, 0);
  auto [dx, dw, db] =
      at::native_layer_norm_backward(e.grad_out(op, 0), x, {x.size(-1)}, e.saved_out(op, 1), e.saved_out(op, 2),
                                     e.param(op, 0), e.param(op, 1), {e.needs_grad(op, 0), true, true});
  if (dx.defined()) e.set_grad(op, 0, std::move(dx));
  e.add_param_grad(op, 0, std::move(dw));
  e.add_param_grad(op, 1, std::move(db));
}

// LibTorch's CPU LayerNorm backward keeps partial dgamma and dbeta per thread: (2, threads, C).
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig& ctx) {
  return 2 * static_cast<int64_t>(ctx.aten) * b.tensors[n.in[0]].shape.back() * dtype_size(b.dtype);
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.layer_norm");
  const int x = b.input("x", {2, 3, 8}, DType::F32, "input");
  const std::vector<int> y =
      b.op(OpKind::LayerNorm, "y", {x}, {{"y", {2, 3, 8}}, {"y_mean", {2, 3, 1}}, {"y_rstd", {2, 3, 1}}},
           {{"y.weight", {8}}, {"y.bias", {8}}});
  b.last().eps = 1e-5;
  return b.finish(y[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in,
                                  const std::vector<at::Tensor>& p) {
  const at::Tensor mean = in[0].mean(-1, true);
  const at::Tensor rstd = (in[0] - mean).pow(2).mean(-1, true).add(n.eps).rsqrt();
  return {(in[0] - mean) * rstd * p[0] + p[1], mean, rstd};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kLayerNorm = [] {
  OpDef d;
  d.name = "layer_norm";
  d.n_in = 1, d.n_out = 3, d.max_params = 2;
  d.bwd_reads_in = 0b1;
  d.bwd_reads_out = 0b110;
  d.grad_in[0] = GradKind::Fresh;
  d.backward_scratch = backward_scratch;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
