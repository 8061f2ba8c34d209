// Losses. cross_entropy: backward reads logp and targets. mse: backward reads y and target.
#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

CrossEntropyOut cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t v = logits.size(-1);
  at::Tensor logp = at::_log_softmax(logits, -1, false);
  at::Tensor loss = at::nll_loss(logp.view({-1, v}), targets.reshape({-1}));
  return {loss, logp};
}

at::Tensor cross_entropy_backward(const at::Tensor& dloss, const at::Tensor& logp, const at::Tensor& targets) {
  const int64_t v = logp.size(-1);
  const int64_t n = logp.numel() / v;
  at::Tensor dlogits = at::exp(logp);  // softmax
  dlogits.view({-1, v}).scatter_add_(1, targets.reshape({-1, 1}), at::full({n, 1}, -1.0, dlogits.options()));
  return dlogits.mul_(dloss / static_cast<double>(n));
}

at::Tensor mse_forward(const at::Tensor& y, const at::Tensor& target) {
  // LibTorch 1.13's at::mse_loss(..., Mean) returns a 0-dim view of the whole unreduced buffer, so
  // a 4-byte loss would keep B*T*C floats alive until backward. Reduce into a fresh scalar.
  return at::mse_loss(y, target, at::Reduction::None).mean();
}

at::Tensor mse_backward(const at::Tensor& dloss, const at::Tensor& y, const at::Tensor& target) {
  return at::mse_loss_backward(dloss, y, target, at::Reduction::Mean);
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void ce_fwd(OpEnv& e, const OpNode& op) {
  ops::CrossEntropyOut r = ops::cross_entropy_forward(e.in(op, 0), e.in(op, 1));
  e.set_out(op, 0, std::move(r.loss));
  e.set_out(op, 1, std::move(r.logp));
}
void ce_bwd(OpEnv& e, const OpNode& op) {
  e.add_grad(op, 0, ops::cross_entropy_backward(e.grad_out(op, 0), e.saved_out(op, 1), e.saved_in(op, 1)));
}

void mse_fwd(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::mse_forward(e.in(op, 0), e.in(op, 1))); }
void mse_bwd(OpEnv& e, const OpNode& op) {
  if (e.needs_grad(op, 0)) e.add_grad(op, 0, ops::mse_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.saved_in(op, 1)));
}

}  // namespace
extern const OpImpl kCrossEntropyImpl{ce_fwd, ce_bwd};
extern const OpImpl kMseImpl{mse_fwd, mse_bwd};
}  // namespace remat::detail
