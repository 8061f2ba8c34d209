// add: y = a + b (the residual stream).
//   in: a, b   out: y   backward reads nothing and passes dy to both inputs (no new memory).
// Float32 CPU adds on the kernel threads (kernels.h); elsewhere ATen's add.
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &a = e.in(op, 0), &b = e.in(op, 1);
  if (!kernels::fits(a) || !kernels::fits(b) || a.sizes() != b.sizes()) return e.set_out(op, 0, at::add(a, b));
  at::Tensor y = at::empty_like(a);
  kernels::add(a.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), a.numel());
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& dy = e.grad_out(op, 0);
  for (int i = 0; i < 2; ++i)
    if (e.needs_grad(op, i)) e.set_grad(op, i, dy);
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.add");
  const int x = b.input("a", {3, 5}, DType::F32, "input");
  const int y = b.input("b", {3, 5}, DType::F32, "input");
  return b.finish(b.op(OpKind::Add, "y", {x, y}, {{"y", {3, 5}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  return {in[0] + in[1]};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kAdd = [] {
  OpDef d;
  d.name = "add";
  d.n_in = 2, d.n_out = 1;
  d.grad_in[0] = GradKind::Alias;
  d.grad_in[1] = GradKind::Alias;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
