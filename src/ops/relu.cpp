// relu: y = max(x, 0).
//   in: x   out: y   backward reads y (y > 0 is the mask), so x need not be kept; dx may be written
//   over dy. Float32 CPU runs remat's own loops on the kernel threads (kernels.h); elsewhere ATen's.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  if (!kernels::fits(x)) return e.set_out(op, 0, at::relu(x));
  at::Tensor y = at::empty_like(x);
  kernels::relu_forward(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.grad_buffer(op, 0);
  const at::Tensor dy = dx.defined() ? dx : e.grad_out(op, 0);
  const at::Tensor& y = e.saved_out(op, 0);
  if (!dx.defined()) dx = at::empty_like(dy);
  if (kernels::fits(dy) && kernels::fits(y) && kernels::fits(dx))
    kernels::relu_backward(dy.data_ptr<float>(), y.data_ptr<float>(), dx.data_ptr<float>(), dy.numel());
  else
    at::threshold_backward_out(dx, dy, y, 0);
  e.set_grad(op, 0, std::move(dx));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.relu");
  const int x = b.input("x", {5, 6}, DType::F32, "input");
  return b.finish(b.op(OpKind::Relu, "y", {x}, {{"y", {5, 6}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  return {at::clamp_min(in[0], 0)};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kRelu = [] {
  OpDef d;
  d.name = "relu";
  d.n_in = 1, d.n_out = 1;
  d.bwd_reads_out = 0b1;
  d.grad_in[0] = GradKind::OverDy;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
