// Pointwise activations and the residual add.
//   gelu (tanh): backward reads x.      relu: backward reads y.      add: backward reads nothing.
#include <ATen/ATen.h>

#include "ops/kernels.h"
#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

namespace {
bool cpu_float(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }
}  // namespace

// Float32 CPU runs remat's own loop (ops/kernels.h: LibTorch 1.13's tanh GELU is ~7x slower).
at::Tensor gelu_forward(const at::Tensor& x) {
  if (!cpu_float(x)) return at::gelu(x, "tanh");
  at::Tensor y = at::empty_like(x);
  kernels::gelu_forward(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  return y;
}

at::Tensor gelu_backward(const at::Tensor& dy, const at::Tensor& x, at::Tensor dx) {
  if (!dx.defined()) dx = at::empty_like(x);
  if (!cpu_float(x) || !cpu_float(dy) || !cpu_float(dx)) return at::gelu_backward_out(dx, dy, x, "tanh");
  kernels::gelu_backward(dy.data_ptr<float>(), x.data_ptr<float>(), dx.data_ptr<float>(), x.numel());
  return dx;
}

at::Tensor relu_forward(const at::Tensor& x) { return at::relu(x); }
at::Tensor relu_backward(const at::Tensor& dy, const at::Tensor& y, at::Tensor dx) {
  if (!dx.defined()) dx = at::empty_like(dy);
  return at::threshold_backward_out(dx, dy, y, 0);
}

at::Tensor add_forward(const at::Tensor& a, const at::Tensor& b) { return at::add(a, b); }

}  // namespace remat::ops

namespace remat::detail {
namespace {

void gelu_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::gelu_forward(e.in(op, 0))); }
void gelu_bwd(OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.take_grad_out(op);  // undefined unless dy is this op's alone
  e.add_grad(op, 0, ops::gelu_backward(dx.defined() ? dx : e.grad_out(op, 0), e.saved_in(op, 0), dx));
}

void relu_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::relu_forward(e.in(op, 0))); }
void relu_bwd(OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.take_grad_out(op);
  e.add_grad(op, 0, ops::relu_backward(dx.defined() ? dx : e.grad_out(op, 0), e.saved_out(op, 0), dx));
}

void add_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::add_forward(e.in(op, 0), e.in(op, 1))); }
void add_bwd(OpEnv& e, const OpNode& op) {
  const at::Tensor& dy = e.grad_out(op, 0);
  if (e.needs_grad(op, 0)) e.add_grad(op, 0, dy, /*owned=*/false);
  if (e.needs_grad(op, 1)) e.add_grad(op, 1, dy, /*owned=*/false);
}

}  // namespace
extern const OpImpl kGeluImpl{gelu_fwd, gelu_bwd};
extern const OpImpl kReluImpl{relu_fwd, relu_bwd};
extern const OpImpl kAddImpl{add_fwd, add_bwd};
}  // namespace remat::detail
