// embedding: x = wte[tokens] (+ wpe[0:T] when the op has a position table).
//   in: tokens (B, T) int64   out: x (B, T, C)   params: wte (V, C)[, wpe (T_max, C)]
//   backward reads tokens; the tables' gradients are accumulated in token order (deterministic).
// Tensor parallel (planning): wte holds vocab / tp rows (Split::Vocab); the output is all-reduced
// (sequence parallel: reduce-scattered, the whole sequence a transient).
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "ops/tensor_parallel.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& tokens = e.in(op, 0);
  at::Tensor x = at::embedding(e.param(op, 0), tokens);
  if (e.has_param(op, 1)) x.add_(e.param(op, 1).narrow(0, 0, tokens.size(1)));
  e.set_out(op, 0, std::move(x));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& dx = e.grad_out(op, 0);
  const at::Tensor& tokens = e.saved_in(op, 0);
  const at::Tensor& wte = e.param(op, 0);
  const int64_t c = wte.size(1);
  at::Tensor dwte = at::zeros_like(wte);
  const at::Tensor rows = dx.reshape({-1, c}).contiguous();
  const at::Tensor ids = tokens.reshape({-1}).contiguous();
  if (dwte.device().is_cpu() && dwte.scalar_type() == at::kFloat && rows.scalar_type() == at::kFloat) {
    // A plain loop in token order: deterministic, and one pass instead of a select per token.
    float* out = dwte.data_ptr<float>();
    const float* in = rows.data_ptr<float>();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      float* dst = out + id[i] * c;
      const float* src = in + i * c;
      for (int64_t j = 0; j < c; ++j) dst[j] += src[j];
    }
  } else {
    dwte.index_add_(0, ids, rows);
  }
  at::Tensor dwpe;
  if (e.has_param(op, 1)) {
    const at::Tensor& wpe = e.param(op, 1);
    dwpe = at::zeros_like(wpe);
    dwpe.narrow(0, 0, tokens.size(1)).copy_(dx.sum(0));
  }
  e.add_param_grad(op, 0, std::move(dwte));
  if (dwpe.defined()) e.add_param_grad(op, 1, std::move(dwpe));
}

// Bytes of the output over the whole sequence (sequence parallelism holds seq / tp of it).
int64_t whole_output(const BlockSpec& b, const OpNode& n) {
  return n.tp.active() && n.tp.seq ? tp::gathered(b, n.out[0], n.tp) : b.tensors[n.out[0]].bytes();
}

// Sequence parallel: the unreduced output, before its reduce-scatter.
int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  return n.tp.active() && n.tp.seq ? whole_output(b, n) : 0;
}

// With positions: the batch sum of dx for the position table; sequence parallel: the gathered dx.
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const int64_t whole = whole_output(b, n), gathered = n.tp.active() && n.tp.seq ? whole : 0;
  if (n.params.size() < 2) return gathered;
  return gathered + whole / b.tensors[n.out[0]].shape[0];
}

// Vocabulary split: each rank looks up its rows; the output is summed over the ranks.
OpComm comm(const BlockSpec& b, const OpNode& n) {
  const int64_t t = n.tp.ranks, y = b.tensors[n.out[0]].bytes();
  return n.tp.seq ? OpComm{tp::gather(y * t, t), tp::gather(y * t, t)} : OpComm{tp::all_reduce(y, t), 0};
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.embedding");
  const int tokens = b.input("tokens", {3, 4}, DType::I64, "token ids");
  const int x = b.op(OpKind::Embedding, "x", {tokens}, {{"x", {3, 4, 5}}}, {{"wte", {7, 5}}, {"wpe", {6, 5}}})[0];
  return b.finish(x);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
  at::Tensor x = at::embedding(p[0], in[0]);
  if (p.size() > 1) x = x + p[1].narrow(0, 0, in[0].size(1));
  return {x};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/7};

}  // namespace

extern const OpDef kEmbedding = [] {
  OpDef d;
  d.name = "embedding";
  d.n_in = 1, d.n_out = 1, d.max_params = 2;
  d.bwd_reads_in = 0b1;
  d.forward_scratch = forward_scratch;
  d.backward_scratch = backward_scratch;
  d.comm = comm;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
