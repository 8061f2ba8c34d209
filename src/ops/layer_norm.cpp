// layer_norm over the last dimension: y = (x - mean) * rstd * w + b.
//   in: x (..., C)   out: y (..., C), mean (..., 1), rstd (..., 1) float32   params: weight, bias (C)
//   backward reads x, mean and rstd; dx is a fresh tensor.
// CPU float32 runs one loop per row on remat's kernel threads (kernels.h). The weight's and bias's
// gradients are summed in fixed chunks of rows, then over the chunks by ATen's sum on one thread (a
// fixed order for a given shape): the same bits on any thread count. Elsewhere (float64, CUDA)
// ATen's native_layer_norm runs.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  const at::Tensor &w = e.param(op, 0), &b = e.param(op, 1);
  if (!kernels::fits(x) || !kernels::fits(w) || !kernels::fits(b)) {
    auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, w, b, op.eps);
    e.set_out(op, 0, std::move(y));
    e.set_out(op, 1, std::move(mean));
    e.set_out(op, 2, std::move(rstd));
    return;
  }
  const int64_t c = x.size(-1), rows = x.numel() / c;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty(e.out_shape(op, 1), x.options()), rstd = at::empty(e.out_shape(op, 2), x.options());
  kernels::layer_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), static_cast<float>(op.eps),
                           y.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, c);
  e.set_out(op, 0, std::move(y));
  e.set_out(op, 1, std::move(mean));
  e.set_out(op, 2, std::move(rstd));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.saved_in(op, 0);
  const at::Tensor &mean = e.saved_out(op, 1), &rstd = e.saved_out(op, 2);
  const at::Tensor& dy = e.grad_out(op, 0);
  const at::Tensor &w = e.param(op, 0), &b = e.param(op, 1);
  const bool need_dx = e.needs_grad(op, 0);
  if (!kernels::fits(x) || !kernels::fits(dy) || !kernels::fits(w)) {
    auto [dx, dw, db] = at::native_layer_norm_backward(dy, x, {x.size(-1)}, mean, rstd, w, b, {need_dx, true, true});
    if (dx.defined()) e.set_grad(op, 0, std::move(dx));
    e.add_param_grad(op, 0, std::move(dw));
    e.add_param_grad(op, 1, std::move(db));
    return;
  }
  const int64_t c = x.size(-1), rows = x.numel() / c;
  at::Tensor dx = need_dx ? at::empty_like(x) : at::Tensor();
  const int64_t chunks = kernels::norm_chunks(rows);
  at::Tensor partial = at::empty({2, chunks, c}, x.options());  // the weight's, then the bias's
  float* pp = partial.data_ptr<float>();
  kernels::layer_norm_rows_backward(dy.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(),
                                    rstd.data_ptr<float>(), w.data_ptr<float>(),
                                    need_dx ? dx.data_ptr<float>() : nullptr, pp, pp + chunks * c, rows, c);
  at::Tensor dw = partial[0].sum(0), db = partial[1].sum(0);
  if (need_dx) e.set_grad(op, 0, std::move(dx));
  e.add_param_grad(op, 0, std::move(dw));
  e.add_param_grad(op, 1, std::move(db));
}

// The weight's and bias's gradient partial sums: (2, chunks of 64 rows, C). ATen's kernels, where
// they run (float64, CUDA), keep buffers of their own, which this does not model.
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const TensorSpec& x = b.tensors[n.in[0]];
  const int64_t c = x.shape.back();
  return 2 * kernels::norm_chunks(x.numel() / c) * c * dtype_size(x.dtype);
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.layer_norm");
  const int x = b.input("x", {2, 70, 8}, DType::F32, "input");  // 140 rows: three chunks
  const std::vector<int> y =
      b.op(OpKind::LayerNorm, "y", {x}, {{"y", {2, 70, 8}}, {"y_mean", {2, 70, 1}}, {"y_rstd", {2, 70, 1}}},
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
