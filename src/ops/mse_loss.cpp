// mse_loss: mean of (y - target)^2 (the seed experiment's training loss).
//   in: y, target   out: loss (scalar)   backward reads y and target; dy is a fresh tensor.
#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"

namespace remat::ops {
namespace {

// LibTorch 1.13's at::mse_loss(..., Mean) returns a 0-dim view of the whole unreduced buffer, so a
// 4-byte loss would keep B*T*C floats alive until backward. Reduce into a fresh scalar.
void forward(detail::OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, at::mse_loss(e.in(op, 0), e.in(op, 1), at::Reduction::None).mean());
}

void backward(detail::OpEnv& e, const OpNode& op) {
  if (!e.needs_grad(op, 0)) return;
  e.set_grad(op, 0,
             at::mse_loss_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.saved_in(op, 1), at::Reduction::Mean));
}

// The unreduced loss.
int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  return b.tensors[n.in[0]].numel() * 4;
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.mse_loss");
  const int y = b.input("y", {3, 4}, DType::F32, "prediction");
  const int t = b.input("target", {3, 4}, DType::F32, "target");
  return b.finish(b.op(OpKind::MseLoss, "loss", {y, t}, {{"loss", {}, DType::F32}})[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  return {(in[0] - in[1]).pow(2).mean()};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kMseLoss = [] {
  OpDef d;
  d.name = "mse_loss";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b11;
  d.grad_in[0] = GradKind::Fresh;
  d.forward_scratch = forward_scratch;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
