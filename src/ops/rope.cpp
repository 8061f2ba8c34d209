// rope: rotary position embedding (RoFormer; LLaMA's interleaved pairs) of every head of q and k.
//   in: x (B, T, n D), n heads of D columns   out: y, the same shape
//   Pair (2i, 2i + 1) of the head at position t turns by t * theta^(-2i / D). The backward turns
//   back by the same angle: it reads nothing, and may write dx over dy.
// The angle table (T, D / 2) of cosines and sines is built for each call (scratch).
#include <cmath>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

// (T, D / 2, 2): cos, sin of t * theta^(-2i / D), computed in double.
at::Tensor angles(int64_t seq, int64_t head_dim, double theta, const at::TensorOptions& options) {
  at::Tensor table = at::empty({seq, head_dim / 2, 2}, options.dtype(at::kDouble).device(at::kCPU));
  double* p = table.data_ptr<double>();
  for (int64_t t = 0; t < seq; ++t)
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const double a = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      p[(t * (head_dim / 2) + i) * 2] = std::cos(a);
      p[(t * (head_dim / 2) + i) * 2 + 1] = std::sin(a);
    }
  return table.to(options.dtype().toScalarType() == at::kDouble ? at::kDouble : at::kFloat).to(options.device());
}

// y = R(t) x (sign = 1) or x = R(t)^T y (sign = -1), pair by pair; `out` may be `in`.
template <typename T>
void rotate(const T* in, T* out, const T* table, int64_t batch, int64_t seq, int64_t width, int64_t head_dim, T sign) {
  const int64_t half = head_dim / 2;
  detail::parallel_chunks(batch * seq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* cs = table + (row % seq) * half * 2;
      const T* x = in + row * width;
      T* y = out + row * width;
      for (int64_t h = 0; h < width / head_dim; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const T c = cs[2 * i], s = sign * cs[2 * i + 1];
          const T x0 = x[h * head_dim + 2 * i], x1 = x[h * head_dim + 2 * i + 1];
          y[h * head_dim + 2 * i] = x0 * c - x1 * s;
          y[h * head_dim + 2 * i + 1] = x0 * s + x1 * c;
        }
    }
  });
}

// Rotates `in` into `out` (same shape; `out` may be `in`).
void apply(const at::Tensor& in, at::Tensor& out, const OpNode& op, double sign) {
  const int64_t B = in.size(0), T = in.size(1), W = in.size(2), D = op.attn.head_dim;
  const at::Tensor table = angles(T, D, op.theta, in.options());
  if (in.device().is_cpu() && in.is_contiguous() && out.is_contiguous() && in.scalar_type() == at::kFloat) {
    rotate<float>(in.data_ptr<float>(), out.data_ptr<float>(), table.data_ptr<float>(), B, T, W, D,
                  static_cast<float>(sign));
  } else if (in.device().is_cpu() && in.is_contiguous() && out.is_contiguous() && in.scalar_type() == at::kDouble) {
    rotate<double>(in.data_ptr<double>(), out.data_ptr<double>(), table.data_ptr<double>(), B, T, W, D, sign);
  } else {  // the same math as ATen ops
    const at::Tensor x = in.view({B, T, W / D, D / 2, 2});
    const at::Tensor c = table.select(2, 0).view({1, T, 1, D / 2}), s = table.select(2, 1).view({1, T, 1, D / 2}) * sign;
    const at::Tensor x0 = x.select(4, 0), x1 = x.select(4, 1);
    out.copy_(at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, 4).view({B, T, W}));
  }
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  at::Tensor y = at::empty_like(x);
  apply(x, y, op, 1.0);
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.grad_buffer(op, 0);  // dy itself when the plan writes over it
  const at::Tensor dy = dx.defined() ? dx : e.grad_out(op, 0);
  if (!dx.defined()) dx = at::empty_like(dy);
  apply(dy, dx, op, -1.0);
  e.set_grad(op, 0, std::move(dx));
}

// The angle table: built in double, kept in the activations' type.
int64_t scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const int64_t entries = b.tensors[n.in[0]].shape[1] * n.attn.head_dim;
  return entries * 8 + (b.dtype == DType::F32 ? entries * 4 : 0);
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.rope");
  const int x = b.input("qk", {2, 5, 3 * 4}, DType::F32, "three heads of 4");
  const int y = b.op(OpKind::Rope, "qk_rot", {x}, {{"qk_rot", {2, 5, 12}}})[0];
  b.last().theta = 10000;
  b.last().attn.head_dim = 4;
  return b.finish(y);
}

// Complex multiplication by e^(i t f): LLaMA's reference formulation.
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor& x = in[0];
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), D = n.attn.head_dim;
  const at::Tensor i = at::arange(D / 2, at::kDouble);
  const at::Tensor f = at::pow(n.theta, -2.0 * i / static_cast<double>(D));
  const at::Tensor a = at::arange(T, at::kDouble).unsqueeze(1) * f.unsqueeze(0);  // (T, D/2)
  const at::Tensor c = a.cos().to(x.scalar_type()).view({1, T, 1, D / 2}), s = a.sin().to(x.scalar_type()).view({1, T, 1, D / 2});
  const at::Tensor p = x.view({B, T, W / D, D / 2, 2});
  const at::Tensor x0 = p.select(4, 0), x1 = p.select(4, 1);
  return {at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, 4).view({B, T, W})};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kRope = [] {
  OpDef d;
  d.name = "rope";
  d.n_in = 1, d.n_out = 1;
  d.grad_in[0] = GradKind::OverDy;
  d.forward_scratch = scratch;
  d.backward_scratch = scratch;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
