// swiglu: act = silu(g) * u, with g and u the gate and up projections (LLaMA's MLP).
//   in: gate (..., F), up (..., F)   out: act (..., F)
//   backward reads both; dgate and dup are fresh tensors. silu(g) = g * sigmoid(g) is cheap to
//   rerun, so act is the tensor mlp-act drops and gate and up the ones it keeps.
// CPU float32 runs kernels.h's vector loop, float64 a plain loop, both on remat's kernel threads;
// elsewhere ATen ops.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kChunk = 16384;  // elements per task on the kernel threads

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-std::max(x, -80.0))); }

void forward_rows(const double* gate, const double* up, double* act, int64_t n) {
  detail::parallel_chunks(n, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) act[j] = gate[j] * sigmoid(gate[j]) * up[j];
  });
}

void backward_rows(const double* dy, const double* gate, const double* up, double* dgate, double* dup, int64_t n) {
  detail::parallel_chunks(n, kChunk, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const double g = gate[j], s = sigmoid(g);
      dup[j] = dy[j] * g * s;
      dgate[j] = dy[j] * up[j] * s * (1.0 + g * (1.0 - s));
    }
  });
}

bool cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &g = e.in(op, 0), &u = e.in(op, 1);
  if (!cpu(g) || !cpu(u)) return e.set_out(op, 0, at::silu(g) * u);
  at::Tensor act = at::empty_like(g);
  if (g.scalar_type() == at::kFloat)
    kernels::swiglu_forward(g.data_ptr<float>(), u.data_ptr<float>(), act.data_ptr<float>(), g.numel());
  else
    forward_rows(g.data_ptr<double>(), u.data_ptr<double>(), act.data_ptr<double>(), g.numel());
  e.set_out(op, 0, std::move(act));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &g = e.saved_in(op, 0), &u = e.saved_in(op, 1);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  if (!cpu(g) || !cpu(u) || !cpu(dy)) {
    const at::Tensor s = at::sigmoid(g);
    at::Tensor dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s;
    e.set_grad(op, 0, std::move(dg));
    return e.set_grad(op, 1, std::move(du));
  }
  at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
  if (g.scalar_type() == at::kFloat)
    kernels::swiglu_backward(dy.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(), dg.data_ptr<float>(),
                             du.data_ptr<float>(), g.numel());
  else
    backward_rows(dy.data_ptr<double>(), g.data_ptr<double>(), u.data_ptr<double>(), dg.data_ptr<double>(),
                  du.data_ptr<double>(), g.numel());
  e.set_grad(op, 0, std::move(dg));
  e.set_grad(op, 1, std::move(du));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.swiglu");
  const int g = b.input("gate", {2, 20, 6}, DType::F32, "gate");
  const int u = b.input("up", {2, 20, 6}, DType::F32, "up");
  return b.finish(b.op(OpKind::Swiglu, "act", {g, u}, {{"act", {2, 20, 6}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor &g = in[n.in[0]], &u = in[n.in[1]];
  return {g * at::sigmoid(g) * u};
}

const detail::OpTestCase kTest{example, reference};

// Eager PyTorch's SwiGLU, silu(gate) * up (torchtitan's, Hugging Face's): the product saves
// silu(gate), a tensor of gate's size this op does not keep.
int64_t eager_saved(const BlockSpec& b, const OpNode& n) { return b.tensors[n.in[0]].bytes(); }

}  // namespace

extern const OpDef kSwiglu = [] {
  OpDef d;
  d.name = "swiglu";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b11;
  d.grad_in[0] = GradKind::Fresh;
  d.grad_in[1] = GradKind::Fresh;
  d.forward = forward;
  d.backward = backward;
  d.eager_saved = eager_saved;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
