// swiglu: act = silu(g) * u, with g and u the two halves of one linear's output (LLaMA's MLP).
//   in: gate_up (..., 2F): g = [..., :F], u = [..., F:]   out: act (..., F)
//   backward reads gate_up; dgate_up is a fresh tensor. silu(g) = g * sigmoid(g) is cheap to rerun,
//   so act is the tensor mlp-act drops and gate_up the one it keeps.
// CPU float32 and float64 run one loop on remat's kernel threads; elsewhere ATen ops.
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRows = 16;

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-std::max(x, T(-80))));
}

template <typename T>
void forward_rows(const T* gu, T* act, int64_t rows, int64_t f) {
  detail::parallel_chunks(rows, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *g = gu + r * 2 * f, *u = g + f;
      T* y = act + r * f;
      for (int64_t j = 0; j < f; ++j) y[j] = g[j] * sigmoid(g[j]) * u[j];
    }
  });
}

template <typename T>
void backward_rows(const T* dy, const T* gu, T* dgu, int64_t rows, int64_t f) {
  detail::parallel_chunks(rows, kRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *g = gu + r * 2 * f, *u = g + f, *d = dy + r * f;
      T *dg = dgu + r * 2 * f, *du = dg + f;
      for (int64_t j = 0; j < f; ++j) {
        const T s = sigmoid(g[j]);
        du[j] = d[j] * g[j] * s;
        dg[j] = d[j] * u[j] * s * (T(1) + g[j] * (T(1) - s));
      }
    }
  });
}

bool cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& gu = e.in(op, 0);
  const int64_t f = gu.size(-1) / 2;
  if (!cpu(gu)) {
    const at::Tensor g = gu.narrow(-1, 0, f), u = gu.narrow(-1, f, f);
    return e.set_out(op, 0, at::silu(g) * u);
  }
  std::vector<int64_t> shape = gu.sizes().vec();
  shape.back() = f;
  at::Tensor act = at::empty(shape, gu.options());
  const int64_t rows = gu.numel() / (2 * f);
  if (gu.scalar_type() == at::kFloat) forward_rows(gu.data_ptr<float>(), act.data_ptr<float>(), rows, f);
  else forward_rows(gu.data_ptr<double>(), act.data_ptr<double>(), rows, f);
  e.set_out(op, 0, std::move(act));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& gu = e.saved_in(op, 0);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  const int64_t f = gu.size(-1) / 2;
  if (!cpu(gu) || !cpu(dy)) {
    const at::Tensor g = gu.narrow(-1, 0, f), u = gu.narrow(-1, f, f), s = at::sigmoid(g);
    return e.set_grad(op, 0, at::cat({dy * u * s * (1 + g * (1 - s)), dy * g * s}, -1));
  }
  at::Tensor dgu = at::empty_like(gu);
  const int64_t rows = gu.numel() / (2 * f);
  if (gu.scalar_type() == at::kFloat)
    backward_rows(dy.data_ptr<float>(), gu.data_ptr<float>(), dgu.data_ptr<float>(), rows, f);
  else
    backward_rows(dy.data_ptr<double>(), gu.data_ptr<double>(), dgu.data_ptr<double>(), rows, f);
  e.set_grad(op, 0, std::move(dgu));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.swiglu");
  const int gu = b.input("gate_up", {2, 20, 2 * 6}, DType::F32, "gate and up");
  return b.finish(b.op(OpKind::Swiglu, "act", {gu}, {{"act", {2, 20, 6}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const int64_t f = in[0].size(-1) / 2;
  const at::Tensor g = in[0].narrow(-1, 0, f), u = in[0].narrow(-1, f, f);
  return {g * at::sigmoid(g) * u};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kSwiglu = [] {
  OpDef d;
  d.name = "swiglu";
  d.n_in = 1, d.n_out = 1;
  d.bwd_reads_in = 0b1;
  d.grad_in[0] = GradKind::Fresh;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
