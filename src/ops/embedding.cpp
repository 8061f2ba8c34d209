// embedding: x = wte[tokens] + wpe[0:T]. Backward reads tokens.
#include <ATen/ATen.h>

#include "ops/op_env.h"
#include "remat/ops.h"

namespace remat::ops {

at::Tensor embedding_forward(const at::Tensor& tokens, const at::Tensor& wte, const at::Tensor& wpe) {
  at::Tensor x = at::embedding(wte, tokens);
  x.add_(wpe.narrow(0, 0, tokens.size(1)));
  return x;
}

EmbeddingGrads embedding_backward(const at::Tensor& dx, const at::Tensor& tokens, const at::Tensor& wte,
                                  const at::Tensor& wpe) {
  const int64_t c = wte.size(1);
  EmbeddingGrads g;
  g.dwte = at::zeros_like(wte);
  const at::Tensor rows = dx.reshape({-1, c}).contiguous();
  const at::Tensor ids = tokens.reshape({-1}).contiguous();
  if (g.dwte.device().is_cpu() && g.dwte.scalar_type() == at::kFloat) {
    // A plain loop in token order: deterministic, and one pass instead of a select per token.
    float* out = g.dwte.data_ptr<float>();
    const float* in = rows.data_ptr<float>();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
      float* dst = out + id[i] * c;
      const float* src = in + i * c;
      for (int64_t j = 0; j < c; ++j) dst[j] += src[j];
    }
  } else {
    g.dwte.index_add_(0, ids, rows);
  }
  g.dwpe = at::zeros_like(wpe);
  g.dwpe.narrow(0, 0, tokens.size(1)).copy_(dx.sum(0));
  return g;
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void forward(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::embedding_forward(e.in(op, 0), e.param(op, 0), e.param(op, 1)));
}

void backward(OpEnv& e, const OpNode& op) {
  ops::EmbeddingGrads g = ops::embedding_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.param(op, 0), e.param(op, 1));
  e.add_param_grad(op, 0, std::move(g.dwte));
  e.add_param_grad(op, 1, std::move(g.dwpe));
}

}  // namespace
extern const OpImpl kEmbeddingImpl{forward, backward};
}  // namespace remat::detail
