// linear: y = x W^T + b. Backward reads x and W.
#include <ATen/ATen.h>

#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  const at::Tensor y = b.defined() ? at::addmm(b, x2, w.t()) : at::mm(x2, w.t());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return y.view(sizes);
}

LinearGrads linear_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, bool has_bias,
                            bool need_dx) {
  const at::Tensor dy2 = dy.reshape({-1, w.size(0)});
  LinearGrads g;
  if (need_dx) {  // a tensor of its own, not a view of mm's result: a later op may write over it
    g.dx = at::empty(x.sizes(), dy.options());
    at::Tensor dx2 = g.dx.view({-1, w.size(1)});
    at::mm_out(dx2, dy2, w);
  }
  g.dw = at::mm(dy2.t(), x.reshape({-1, w.size(1)}));
  if (has_bias) g.db = dy2.sum(0);
  return g;
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void forward(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::linear_forward(e.in(op, 0), e.param(op, 0), e.has_param(op, 1) ? e.param(op, 1) : at::Tensor()));
}

void backward(OpEnv& e, const OpNode& op) {
  ops::LinearGrads g = ops::linear_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.param(op, 0), e.has_param(op, 1),
                                            e.needs_grad(op, 0));
  if (g.dx.defined()) e.add_grad(op, 0, std::move(g.dx));
  e.add_param_grad(op, 0, std::move(g.dw));
  if (g.db.defined()) e.add_param_grad(op, 1, std::move(g.db));
}

}  // namespace
extern const OpImpl kLinearImpl{forward, backward};
}  // namespace remat::detail
