// gelu, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
//   in: x   out: y   backward reads x; dx may be written over dy.
// Float32 CPU runs remat's own loop (kernels.h): LibTorch 1.13's tanh GELU is ~7x slower.
#include <cmath>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  if (!kernels::fits(x)) return e.set_out(op, 0, at::gelu(x, "tanh"));
  at::Tensor y = at::empty_like(x);
  kernels::gelu_forward(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.saved_in(op, 0);
  at::Tensor dx = e.grad_buffer(op, 0);  // dy itself when the plan writes over it
  const at::Tensor dy = dx.defined() ? dx : e.grad_out(op, 0);
  if (!dx.defined()) dx = at::empty_like(x);
  if (kernels::fits(x) && kernels::fits(dy) && kernels::fits(dx))
    kernels::gelu_backward(dy.data_ptr<float>(), x.data_ptr<float>(), dx.data_ptr<float>(), x.numel());
  else
    at::gelu_backward_out(dx, dy, x, "tanh");
  e.set_grad(op, 0, std::move(dx));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.gelu");
  const int x = b.input("x", {4, 7}, DType::F32, "input");
  return b.finish(b.op(OpKind::Gelu, "y", {x}, {{"y", {4, 7}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor& x = in[0];
  return {0.5 * x * (1 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))))};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kGelu = [] {
  OpDef d;
  d.name = "gelu";
  d.n_in = 1, d.n_out = 1;
  d.bwd_reads_in = 0b1;
  d.grad_in[0] = GradKind::OverDy;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
