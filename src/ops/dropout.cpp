// dropout: y = x * mask / (1 - p), the mask from a dropout_mask op.
//   in: x, mask   out: y   backward reads the mask only; dx may be written over dy.
// CPU float32 runs one loop; elsewhere at::mul, which first converts the mask to x's dtype (a
// temporary the size of x that the scratch accounting does not count: CPU float32 is exact).
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

// y = x * mask / (1 - p), into y (x itself allowed) or a new tensor.
at::Tensor apply_mask(const at::Tensor& x, const at::Tensor& mask, double p, at::Tensor y) {
  const double scale = 1.0 / (1.0 - p);
  if (!y.defined()) y = at::empty_like(x);
  if (x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && mask.is_contiguous() &&
      y.is_contiguous()) {
    kernels::dropout_apply(x.data_ptr<float>(), mask.data_ptr<bool>(), static_cast<float>(scale), y.data_ptr<float>(),
                           x.numel());
    return y;
  }
  return at::mul_out(y, x, mask).mul_(scale);
}

void forward(detail::OpEnv& e, const OpNode& op) { e.set_out(op, 0, apply_mask(e.in(op, 0), e.in(op, 1), op.p, {})); }

void backward(detail::OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.grad_buffer(op, 0);  // dy itself when the plan writes over it
  const at::Tensor dy = dx.defined() ? dx : e.grad_out(op, 0);
  e.set_grad(op, 0, apply_mask(dy, e.saved_in(op, 1), op.p, std::move(dx)));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.dropout");
  const int x = b.input("x", {16, 8}, DType::F32, "input");
  const int mask = b.input("mask", {16, 8}, DType::Bool, "keep-mask");
  const int y = b.op(OpKind::Dropout, "y", {x, mask}, {{"y", {16, 8}}})[0];
  b.last().p = 0.25;
  return b.finish(y);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  return {in[0] * in[1].to(in[0].scalar_type()) / (1.0 - n.p)};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/2};

}  // namespace

extern const OpDef kDropout = [] {
  OpDef d;
  d.name = "dropout";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b10;
  d.grad_in[0] = GradKind::OverDy;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
