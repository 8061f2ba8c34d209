// rope: rotary position embedding (RoFormer; LLaMA's interleaved pairs) of every head of q and k.
//   in: x (B, T, W), of which it turns columns [in_col, in_col + in_width) (all of them when the
//       width is 0): n heads of D columns   out: y (B, T, n D)
//   Pair (2i, 2i + 1) of the head at position t turns by t * theta^(-2i / D). The backward turns
//   back by the same angle: it reads nothing, and writes dx over dy when it turns all of x, or adds
//   it into x's gradient slot when it turns a slice (q and k of a fused qkv projection).
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
      const double a =
          static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      p[(t * (head_dim / 2) + i) * 2] = std::cos(a);
      p[(t * (head_dim / 2) + i) * 2 + 1] = std::sin(a);
    }
  return table.to(options.dtype().toScalarType() == at::kDouble ? at::kDouble : at::kFloat).to(options.device());
}

// y = R(t) x (sign = 1) or x = R(t)^T y (sign = -1), pair by pair over the first `rot` dimensions of
// each head, the others passed through; rows `ld_in` and `ld_out` apart. With `add`, y is added into
// `out`. `out` may be `in`.
template <typename T, bool add>
void rotate(const T* in, int64_t ld_in, T* out, int64_t ld_out, const T* table, int64_t batch, int64_t seq,
            int64_t width, int64_t head_dim, int64_t rot, T sign) {
  const int64_t half = rot / 2;
  detail::parallel_chunks(batch * seq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* cs = table + (row % seq) * half * 2;
      const T* x = in + row * ld_in;
      T* y = out + row * ld_out;
      for (int64_t h = 0; h < width / head_dim; ++h) {
        const T* xh = x + h * head_dim;
        T* yh = y + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const T c = cs[2 * i], s = sign * cs[2 * i + 1];
          const T x0 = xh[2 * i], x1 = xh[2 * i + 1];
          const T y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
          if constexpr (add) {
            yh[2 * i] += y0;
            yh[2 * i + 1] += y1;
          } else {
            yh[2 * i] = y0;
            yh[2 * i + 1] = y1;
          }
        }
        for (int64_t j = rot; j < head_dim; ++j) {
          if constexpr (add)
            yh[j] += xh[j];
          else
            yh[j] = xh[j];
        }
      }
    }
  });
}

// The columns the node turns: [col, col + width) of a row of `full` columns.
struct Slice {
  int64_t col = 0, width = 0;
};
Slice slice_of(const OpNode& op, int64_t full) { return {op.in_col, op.in_width > 0 ? op.in_width : full}; }

// Turns columns [from.col, from.col + width) of `in` into `out` (contiguous, `width` columns), or,
// with `add`, adds them turned back into columns [to.col, ...) of `out`.
template <typename F>
bool rotate_cpu(const at::Tensor& in, Slice from, at::Tensor& out, Slice to, const at::Tensor& table, int64_t D,
                int64_t rot, double sign, bool add) {
  if (!in.device().is_cpu() || in.stride(2) != 1 || out.stride(2) != 1 || in.stride(0) != in.size(1) * in.stride(1) ||
      out.stride(0) != out.size(1) * out.stride(1))
    return false;
  const int64_t batch = in.size(0), seq = in.size(1);
  const F* x = in.data_ptr<F>() + from.col;
  F* y = out.data_ptr<F>() + to.col;
  if (add)
    rotate<F, true>(x, in.stride(1), y, out.stride(1), table.data_ptr<F>(), batch, seq, from.width, D, rot,
                    static_cast<F>(sign));
  else
    rotate<F, false>(x, in.stride(1), y, out.stride(1), table.data_ptr<F>(), batch, seq, from.width, D, rot,
                     static_cast<F>(sign));
  return true;
}

// Turns `from` of `in` into `to` of `out` (written, or added with `add`).
void apply(const at::Tensor& in, Slice from, at::Tensor& out, Slice to, const OpNode& op, double sign, bool add) {
  const int64_t B = in.size(0), T = in.size(1), W = from.width, D = op.attn.head_dim;
  const int64_t R = op.rotary_dims > 0 ? op.rotary_dims : D;  // the frequencies span the turned dimensions
  const at::Tensor table = angles(T, R, op.theta, in.options());
  if (in.scalar_type() == at::kFloat && rotate_cpu<float>(in, from, out, to, table, D, R, sign, add)) return;
  if (in.scalar_type() == at::kDouble && rotate_cpu<double>(in, from, out, to, table, D, R, sign, add)) return;
  // The same math as ATen ops.
  const at::Tensor heads = in.narrow(2, from.col, W).reshape({B, T, W / D, D});
  const at::Tensor x = heads.narrow(3, 0, R).reshape({B, T, W / D, R / 2, 2});
  const at::Tensor c = table.select(2, 0).view({1, T, 1, R / 2}), s = table.select(2, 1).view({1, T, 1, R / 2}) * sign;
  const at::Tensor x0 = x.select(4, 0), x1 = x.select(4, 1);
  const at::Tensor turned = at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, 4).view({B, T, W / D, R});
  const at::Tensor y = at::cat({turned, heads.narrow(3, R, D - R)}, 3).view({B, T, W});
  at::Tensor dst = out.narrow(2, to.col, W);
  if (add)
    dst.add_(y);
  else
    dst.copy_(y);
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.in(op, 0);
  const Slice from = slice_of(op, x.size(2));
  at::Tensor y = at::empty({x.size(0), x.size(1), from.width}, x.options());
  apply(x, from, y, {0, from.width}, op, 1.0, false);
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  if (op.in_width > 0) {  // a slice: added into the input's gradient
    at::Tensor& dx = e.grad_slot(op, 0);
    const at::Tensor& dy = e.grad_out(op, 0);
    apply(dy, {0, op.in_width}, dx, {op.in_col, op.in_width}, op, -1.0, true);
    return;
  }
  at::Tensor dx = e.grad_buffer(op, 0);  // dy itself when the plan writes over it
  const at::Tensor dy = dx.defined() ? dx : e.grad_out(op, 0);
  if (!dx.defined()) dx = at::empty_like(dy);
  apply(dy, {0, dy.size(2)}, dx, {0, dy.size(2)}, op, -1.0, false);
  e.set_grad(op, 0, std::move(dx));
}

GradKind grad_kind(const OpNode& node, int) { return node.in_width > 0 ? GradKind::Slot : GradKind::OverDy; }

// The angle table: built in double, kept in the activations' type.
int64_t scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const int64_t entries = b.tensors[n.in[0]].shape[1] * (n.rotary_dims > 0 ? n.rotary_dims : n.attn.head_dim);
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

// The same on a slice: heads 1 and 2 of four in a fused projection (the others stay as they are).
BlockSpec slice_example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.rope_slice");
  const int x = b.input("qkv", {2, 5, 4 * 4}, DType::F32, "four heads of 4");
  const int y = b.op(OpKind::Rope, "qk_rot", {x}, {{"qk_rot", {2, 5, 8}}})[0];
  b.last().theta = 10000;
  b.last().attn.head_dim = 4;
  b.last().in_col = 4, b.last().in_width = 8;
  b.last().rotary_dims = 2;  // GPT-NeoX's partial rotary: the first half of each head turned
  return b.finish(y);
}

// Complex multiplication by e^(i t f): LLaMA's reference formulation.
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor x = n.in_width > 0 ? in[0].narrow(2, n.in_col, n.in_width) : in[0];
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), D = n.attn.head_dim;
  const int64_t R = n.rotary_dims > 0 ? n.rotary_dims : D;
  const at::Tensor i = at::arange(R / 2, at::kDouble);
  const at::Tensor f = at::pow(n.theta, -2.0 * i / static_cast<double>(R));
  const at::Tensor a = at::arange(T, at::kDouble).unsqueeze(1) * f.unsqueeze(0);  // (T, R/2)
  const at::Tensor c = a.cos().to(x.scalar_type()).view({1, T, 1, R / 2}),
                   s = a.sin().to(x.scalar_type()).view({1, T, 1, R / 2});
  const at::Tensor heads = x.reshape({B, T, W / D, D});
  const at::Tensor p = heads.narrow(3, 0, R).reshape({B, T, W / D, R / 2, 2});
  const at::Tensor x0 = p.select(4, 0), x1 = p.select(4, 1);
  const at::Tensor turned = at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, 4).view({B, T, W / D, R});
  return {at::cat({turned, heads.narrow(3, R, D - R)}, 3).view({B, T, W})};
}

const detail::OpTestCase kTest{example, reference, 0, true, slice_example};

}  // namespace

extern const OpDef kRope = [] {
  OpDef d;
  d.name = "rope";
  d.n_in = 1, d.n_out = 1;
  d.grad_in[0] = GradKind::OverDy;
  d.grad_kind = grad_kind;
  d.forward_scratch = scratch;
  d.backward_scratch = scratch;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
