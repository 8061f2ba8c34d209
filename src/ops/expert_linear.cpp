// expert_linear: the experts' linears over the dispatch buffer, one GEMM per run of rows that
// belong to one expert (a grouped GEMM).
//   in: xs (R, K), rows (R) int64   out: y (R, N)   params: weight (E, N, K)
//   y[r] = xs[r] weight[rows[r]]^T; a row whose expert is -1 (an empty capacity row) gives zeros.
//   backward reads xs and rows; dxs is a fresh tensor, dweight[e] the sum over expert e's rows
//   (zeros for an expert no row went to).
#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "util/gemm.h"

namespace remat::ops {
namespace {

// Calls fn(begin, end, expert) for each maximal run of rows with one expert (expert -1 included).
template <typename Fn>
void for_each_run(const at::Tensor& rows, Fn fn) {
  const int64_t* id = rows.data_ptr<int64_t>();
  const int64_t n = rows.numel();
  for (int64_t b = 0; b < n;) {
    int64_t e = b + 1;
    while (e < n && id[e] == id[b]) ++e;
    fn(b, e, id[b]);
    b = e;
  }
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &xs = e.in(op, 0), &rows = e.in(op, 1).contiguous(), &w = e.param(op, 0);
  at::Tensor y = at::empty(e.out_shape(op, 0), xs.options());
  for_each_run(rows, [&](int64_t b, int64_t end, int64_t expert) {
    at::Tensor out = y.narrow(0, b, end - b);
    if (expert < 0)
      out.zero_();
    else
      detail::mm_out(out, xs.narrow(0, b, end - b), false, w.select(0, expert), true, 0.0);
  });
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &xs = e.saved_in(op, 0), &rows = e.saved_in(op, 1).contiguous(), &w = e.param(op, 0);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  const bool need_dx = e.needs_grad(op, 0);
  at::Tensor dx = need_dx ? at::empty(xs.sizes(), dy.options()) : at::Tensor();
  at::Tensor dw = at::empty(w.sizes(), dy.options());
  std::vector<bool> touched(w.size(0), false);
  for_each_run(rows, [&](int64_t b, int64_t end, int64_t expert) {
    if (expert < 0) {
      if (need_dx) dx.narrow(0, b, end - b).zero_();
      return;
    }
    const at::Tensor g = dy.narrow(0, b, end - b);
    if (need_dx) {
      at::Tensor d = dx.narrow(0, b, end - b);
      detail::mm_out(d, g, false, w.select(0, expert), false, 0.0);
    }
    at::Tensor dwe = dw.select(0, expert);
    detail::mm_out(dwe, g, true, xs.narrow(0, b, end - b), false, touched[expert] ? 1.0 : 0.0);
    touched[expert] = true;
  });
  for (int64_t x = 0; x < w.size(0); ++x)
    if (!touched[x]) dw.select(0, x).zero_();
  if (need_dx) e.set_grad(op, 0, std::move(dx));
  e.add_param_grad(op, 0, std::move(dw));
}

OpFlops flops(const BlockSpec& b, const OpNode& n) {
  const TensorSpec &x = b.tensors[n.in[0]], &y = b.tensors[n.out[0]];
  const int64_t m = x.shape[0], k = x.shape[1], out = y.shape[1];
  return {2 * m * out * k, 4 * m * out * k};  // every row of the buffer; backward: dx and dW
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.expert_linear");
  const int x = b.input("xs", {7, 4}, DType::F32, "dispatched tokens");
  const int rows = b.input("rows", {7}, DType::I64, "expert of each row");
  return b.finish(b.op(OpKind::ExpertLinear, "y", {x, rows}, {{"y", {7, 5}}}, {{"y.weight", {3, 5, 4}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in,
                                  const std::vector<at::Tensor>& p) {
  const at::Tensor& rows = in[n.in[1]];
  const at::Tensor w = p[0].index_select(0, rows.clamp_min(0));             // (R, N, K)
  const at::Tensor kept = (rows >= 0).to(p[0].scalar_type()).unsqueeze(1);  // an empty row (-1) gives zeros
  return {at::bmm(w, in[n.in[0]].unsqueeze(2)).squeeze(2) * kept};
}

const detail::OpTestCase kTest{example,         reference, /*index_range=*/3, /*float64=*/true, /*example2=*/nullptr,
                               /*index_low=*/-1};

}  // namespace

extern const OpDef kExpertLinear = [] {
  OpDef d;
  d.name = "expert_linear";
  d.n_in = 2, d.n_out = 1, d.max_params = 1;
  d.bwd_reads_in = 0b11;
  d.grad_in[0] = GradKind::Fresh;
  d.flops = flops;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
