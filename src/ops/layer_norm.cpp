// layer_norm over the last dimension. Forward returns (y, mean, rstd); backward reads x, mean, rstd.
#include <ATen/ATen.h>

#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

LayerNormOut layer_norm_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  auto [y, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, w, b, eps);
  return {y, mean, rstd};
}

LayerNormGrads layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                   const at::Tensor& rstd, const at::Tensor& w, const at::Tensor& b, bool need_dx) {
  auto [dx, dw, db] = at::native_layer_norm_backward(dy, x, {x.size(-1)}, mean, rstd, w, b, {need_dx, true, true});
  return {dx, dw, db};
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void forward(OpEnv& e, const OpNode& op) {
  ops::LayerNormOut r = ops::layer_norm_forward(e.in(op, 0), e.param(op, 0), e.param(op, 1));
  e.set_out(op, 0, std::move(r.y));
  e.set_out(op, 1, std::move(r.mean));
  e.set_out(op, 2, std::move(r.rstd));
}

void backward(OpEnv& e, const OpNode& op) {
  ops::LayerNormGrads g = ops::layer_norm_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.saved_out(op, 1),
                                                   e.saved_out(op, 2), e.param(op, 0), e.param(op, 1),
                                                   e.needs_grad(op, 0));
  if (g.dx.defined()) e.add_grad(op, 0, std::move(g.dx));
  e.add_param_grad(op, 0, std::move(g.dw));
  e.add_param_grad(op, 1, std::move(g.db));
}

}  // namespace
extern const OpImpl kLayerNormImpl{forward, backward};
}  // namespace remat::detail
