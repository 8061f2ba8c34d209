// cross_entropy over the last dimension, mean over tokens.
//   in: logits (..., V), targets (...) int64   out: loss (scalar float32), logp (log-probabilities)
//   backward reads logp and targets; dlogits is a fresh tensor.
// Tensor parallel (planning): the logits hold vocab / tp columns (Split::Vocab); per token, the
// maximum, the sum of exponentials and the target's logit are all-reduced in float32.
#include <algorithm>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "ops/tensor_parallel.h"

namespace remat::ops {
namespace {

// Contiguous float32 on the CPU runs remat's vector loops on its kernel threads (ops/kernels.h).
// In a microbenchmark on a 2-core AMD EPYC Zen 4, 1024 tokens over GPT-2's 50257 logits, outputs
// already touched: ATen's log-softmax on its one thread took 59 ms and its exp, scatter and scale
// 37; the kernels on 2 threads 24 and 13 (the scatter of 1024 entries aside). Both paths make the
// same allocations in the same order, but the ATen backward's 4-byte scaled loss gradient, made
// after the column is freed: the same peak (scratch_tensors).
void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& logits = e.in(op, 0);
  const int64_t v = logits.size(-1);
  at::Tensor logp;
  if (kernels::fits(logits)) {
    logp = at::empty_like(logits);
    kernels::log_softmax_rows(logits.data_ptr<float>(), logp.data_ptr<float>(), logits.numel() / v, v);
  } else {
    logp = at::_log_softmax(logits, -1, false);
  }
  at::Tensor loss = at::nll_loss(logp.view({-1, v}), e.in(op, 1).reshape({-1}));
  e.set_out(op, 0, std::move(loss));
  e.set_out(op, 1, std::move(logp));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& logp = e.saved_out(op, 1);
  const at::Tensor& targets = e.saved_in(op, 1);
  const int64_t v = logp.size(-1);
  const int64_t n = logp.numel() / v;
  if (kernels::fits(logp)) {  // softmax * scale, then the targets' entries less scale
    const double scale = e.grad_out(op, 0).item<double>() / static_cast<double>(n);
    at::Tensor dlogits = at::empty_like(logp);
    kernels::softmax_from_lse_rows(logp.data_ptr<float>(), nullptr, static_cast<float>(scale),
                                   dlogits.data_ptr<float>(), n, v);
    dlogits.view({-1, v}).scatter_add_(1, targets.reshape({-1, 1}), at::full({n, 1}, -scale, dlogits.options()));
    return e.set_grad(op, 0, std::move(dlogits));
  }
  at::Tensor dlogits = at::exp(logp);  // softmax
  dlogits.view({-1, v}).scatter_add_(1, targets.reshape({-1, 1}), at::full({n, 1}, -1.0, dlogits.options()));
  dlogits.mul_(e.grad_out(op, 0) / static_cast<double>(n));
  e.set_grad(op, 0, std::move(dlogits));
}

// Planning bf16/fp16 logits under PyTorch's autograd (OpNode::upcast, Loss::Upcast): the fp32 copy
// log_softmax reads (4 bytes a logit) exists beside its fp32 output in the forward; in the
// backward, nll_loss's fp32 gradient and log_softmax's (8 bytes a logit) exist together with the
// saved log-probabilities (a peak of 12), then the first goes before the cast back that this op
// counts as its gradient (2 bytes).
int64_t upcast_bytes(const BlockSpec& b, const OpNode& n, int64_t per_logit) {
  if (!n.upcast || b.dtype == DType::F32) return 0;
  return b.tensors[n.out[1]].numel() * per_logit;
}

// Megatron-LM's fused cross-entropy (OpNode::compiled, Loss::Fused) runs its in-place steps as
// torch.compile'd functions. Inductor computes a mutated input's new value into a buffer of its own
// and then copies it into the input (torch/_inductor/ir.py, MutationLayoutSHOULDREMOVE.realize_into):
// in the forward exp(x - max) and the division by the sum, each a new fp32 logits tensor beside the
// fp32 copy; in the backward the softmax with the targets' entries lowered, beside the saved
// softmax and the bf16 gradient the same kernel writes. Measured: the peak of Megatron-LM's
// gpt3_mcore_te_tp2_pp2 runs with --cross-entropy-loss-fusion lies one fp32 logits shard above the
// same run's without it (docs/validation.md).
int64_t compiled_bytes(const BlockSpec& b, const OpNode& n) { return n.compiled ? b.tensors[n.out[1]].numel() * 4 : 0; }

// Forward: nll_loss's total_weight scalar, and the fp32 copy of upcast logits (or a compiled
// loss's new value). Backward: a (tokens, 1) column for the targets' entries (ATen's scaled loss
// gradient, 4 bytes, comes after it is freed), and of upcast logits the two fp32 gradients, the
// first freed before this op's gradient is made (of a compiled loss, the new value, alive while its
// gradient is made).
std::vector<int64_t> scratch_tensors(const BlockSpec& b, const OpNode& n, bool backward) {
  if (!backward) return {4, upcast_bytes(b, n, 4) + compiled_bytes(b, n)};
  const TensorSpec& logp = b.tensors[n.out[1]];
  const int64_t column = std::max<int64_t>(logp.numel() / logp.shape.back() * 4, 4), fp32 = upcast_bytes(b, n, 4);
  if (n.compiled) return {column, compiled_bytes(b, n)};
  if (fp32 == 0) return {column};
  return {column, fp32, fp32, -fp32};
}

// The largest running sum of scratch_tensors.
int64_t peak(const std::vector<int64_t>& v) {
  int64_t now = 0, top = 0;
  for (int64_t x : v) top = std::max(top, now += x);
  return top;
}
int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  return peak(scratch_tensors(b, n, false));
}
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  return peak(scratch_tensors(b, n, true));
}

OpComm comm(const BlockSpec& b, const OpNode& n) {
  const TensorSpec& logp = b.tensors[n.out[1]];
  return {3 * tp::all_reduce(logp.numel() / logp.shape.back() * 4, n.tp.ranks), 0};
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.cross_entropy");
  const int logits = b.input("logits", {2, 3, 11}, DType::F32, "logits");
  const int targets = b.input("targets", {2, 3}, DType::I64, "targets");
  const std::vector<int> out =
      b.op(OpKind::CrossEntropy, "loss", {logits, targets}, {{"loss", {}, DType::F32}, {"logp", {2, 3, 11}}});
  return b.finish(out[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor logp = at::log_softmax(in[0], -1);
  return {at::nll_loss(logp.reshape({-1, in[0].size(-1)}), in[1].reshape({-1})), logp};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/11};

}  // namespace

extern const OpDef kCrossEntropy = [] {
  OpDef d;
  d.name = "cross_entropy";
  d.n_in = 2, d.n_out = 2;
  d.bwd_reads_in = 0b10;
  d.bwd_reads_out = 0b10;
  d.grad_in[0] = GradKind::Fresh;
  d.forward_scratch = forward_scratch;
  d.backward_scratch = backward_scratch;
  d.scratch_tensors = scratch_tensors;
  d.comm = comm;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
