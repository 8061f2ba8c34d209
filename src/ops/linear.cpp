// linear: y = x W^T + b, over the last dimension; the bias is optional.
//   in: x (..., K)   out: y (..., N)   params: weight (N, K)[, bias (N)]
//   backward reads x (and the weight); dx is a fresh tensor.
// Tensor parallel (planning): a column split holds N / tp output features, a row split K / tp input
// features with its output summed over the ranks (block.h, Split). Under sequence parallelism the
// whole-sequence tensor (the gathered input of a column split, the unreduced output of a row split,
// and in backward the regathered input, the unscattered dx or the gathered dy) is a transient.
#include <algorithm>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "ops/reduce.h"
#include "ops/tensor_parallel.h"
#include "util/gemm.h"

namespace remat::ops {
namespace {

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  at::Tensor y = at::empty(sizes, x.options());
  at::Tensor y2 = y.view({-1, w.size(0)});
  // The GEMM adds into the bias rows.
  if (b.defined() && kernels::fits(y2) && kernels::fits(b))
    kernels::fill_rows(b.data_ptr<float>(), y2.data_ptr<float>(), y2.size(0), y2.size(1));
  else if (b.defined())
    y2.copy_(b.expand_as(y2));
  detail::mm_out(y2, x2, false, w, true, b.defined() ? 1.0 : 0.0);
  return y;
}

struct LinearGrads {
  at::Tensor dx, dw, db;  // dx undefined unless asked for; db undefined without a bias
};

LinearGrads linear_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, bool has_bias,
                            bool need_dx) {
  const at::Tensor dy2 = dy.reshape({-1, w.size(0)});
  LinearGrads g;
  if (need_dx) {  // a tensor of its own, not a view of mm's result: a later op may write over it
    g.dx = at::empty(x.sizes(), dy.options());
    at::Tensor dx2 = g.dx.view({-1, w.size(1)});
    detail::mm_out(dx2, dy2, false, w, false, 0.0);
  }
  g.dw = at::empty(w.sizes(), dy.options());
  detail::mm_out(g.dw, dy2, true, x.reshape({-1, w.size(1)}), false, 0.0);
  if (has_bias) g.db = column_sums(dy2);
  return g;
}

void forward(detail::OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, linear_forward(e.in(op, 0), e.param(op, 0), e.has_param(op, 1) ? e.param(op, 1) : at::Tensor()));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  LinearGrads g =
      linear_backward(e.grad_out(op, 0), e.saved_in(op, 0), e.param(op, 0), e.has_param(op, 1), e.needs_grad(op, 0));
  if (g.dx.defined()) e.set_grad(op, 0, std::move(g.dx));
  e.add_param_grad(op, 0, std::move(g.dw));
  if (g.db.defined()) e.add_param_grad(op, 1, std::move(g.db));
}

OpFlops flops(const BlockSpec& b, const OpNode& n) {
  const TensorSpec &x = b.tensors[n.in[0]], &y = b.tensors[n.out[0]];
  const int64_t k = x.shape.back(), out = y.shape.back();
  // Rows of the whole sequence: under sequence parallelism one side holds seq / tp of them.
  const int64_t m = std::max(x.numel() / k, y.numel() / out);
  return {2 * m * out * k, 4 * m * out * k, 2 * m * out * k};  // backward: dx and dW
}

bool seq_parallel(const OpNode& n) { return n.tp.active() && n.tp.seq; }

int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  if (!seq_parallel(n)) return 0;
  return n.tp.split == Split::Column ? tp::gathered(b, n.in[0], n.tp) : tp::gathered(b, n.out[0], n.tp);
}

int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  if (!seq_parallel(n)) return 0;
  return n.tp.split == Split::Column ? 2 * tp::gathered(b, n.in[0], n.tp) : tp::gathered(b, n.out[0], n.tp);
}

OpComm comm(const BlockSpec& b, const OpNode& n) {
  const int64_t t = n.tp.ranks;
  const int64_t x = b.tensors[n.in[0]].bytes(), y = b.tensors[n.out[0]].bytes();
  if (n.tp.split == Split::Column)
    return n.tp.seq ? OpComm{tp::gather(x * t, t), 2 * tp::gather(x * t, t)} : OpComm{0, tp::all_reduce(x, t)};
  return n.tp.seq ? OpComm{tp::gather(y * t, t), tp::gather(y * t, t)} : OpComm{tp::all_reduce(y, t), 0};
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.linear");
  const int x = b.input("x", {3, 4, 5}, DType::F32, "input");
  const int y = b.op(OpKind::Linear, "y", {x}, {{"y", {3, 4, 6}}}, {{"y.weight", {6, 5}}, {"y.bias", {6}}})[0];
  return b.finish(y);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
  return {at::linear(in[0], p[0], p.size() > 1 ? p[1] : at::Tensor())};
}

const detail::OpTestCase kTest{example, reference};

}  // namespace

extern const OpDef kLinear = [] {
  OpDef d;
  d.name = "linear";
  d.n_in = 1, d.n_out = 1, d.max_params = 2;
  d.bwd_reads_in = 0b1;
  d.grad_in[0] = GradKind::Fresh;
  d.flops = flops;
  d.forward_scratch = forward_scratch;
  d.backward_scratch = backward_scratch;
  d.comm = comm;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
