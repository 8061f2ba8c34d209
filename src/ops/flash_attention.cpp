// flash_attention: fused core attention that keeps only its output and a (B, H, T) log-sum-exp;
// the backward reruns the scores tile by tile. No T x T tensor is ever stored.
//   in: src_qk (q and k), src_v (v; may be the same tensor)   out: atty (B, T, H D), lse (B, H, T)
//   backward reads both inputs and both outputs; dq, dk, dv are added into the inputs' gradients.
// Planned only on this build: the engine refuses --attention flash before running (model.cpp).
#include "ops/op_env.h"
#include "remat/error.h"

namespace remat::ops {
namespace {

void unavailable(detail::OpEnv&, const OpNode&) {
  fail("ModelConfig.attention flash is planned, not run, by this build; the engine runs math attention");
}

// Two matmuls forward (q k^T, p v) over the causal half; the backward reruns q k^T and does four
// more: 2.5 times the forward.
OpFlops flops(const BlockSpec&, const OpNode& n) {
  const AttentionLayout& l = n.attn;
  const int64_t scores = l.causal ? l.batch * l.heads * l.seq * (l.seq + 1) / 2 : l.batch * l.heads * l.seq * l.seq;
  const int64_t f = 2 * 2 * scores * l.head_dim;
  return {f, f * 5 / 2};
}

}  // namespace

extern const OpDef kFlashAttention = [] {
  OpDef d;
  d.name = "flash_attention";
  d.n_in = 2, d.n_out = 2;
  d.bwd_reads_in = 0b11;
  d.bwd_reads_out = 0b11;
  d.grad_in[0] = GradKind::Slot;
  d.grad_in[1] = GradKind::Slot;
  d.flops = flops;
  d.forward = unavailable;
  d.backward = unavailable;
  return d;
}();

}  // namespace remat::ops
