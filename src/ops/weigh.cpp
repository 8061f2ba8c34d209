// weigh: each dispatch row times the routing weight of the token copy it holds, before the experts'
// second linear (Megatron-LM's placement, ModelConfig.expert_weights activation).
//   in: x (R, F), weights (..., k), slots (..., k) int64   out: y (R, F)
//   y[r] = s[r] x[r], s[r] the sum of the weights of the copies whose slot is r (dispatch names each
//   row once: its copy's weight; a row no copy names, capacity padding, is zero).
//   backward reads all three; dx and dweights are fresh: dx[r] = s[r] dy[r], dweights[t, j] = <dy, x>
//   over row slots[t, j] (0 for a dropped copy, slot -1).
#include <vector>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "remat/units.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRowsPerTask = 64;

// s[r], summed over the copies in token order.
template <typename T>
std::vector<T> row_weights(const T* w, const int64_t* slots, int64_t copies, int64_t rows) {
  std::vector<T> s(static_cast<size_t>(rows), T(0));
  for (int64_t i = 0; i < copies; ++i)
    if (slots[i] >= 0) s[static_cast<size_t>(slots[i])] += w[i];
  return s;
}

// out[r] = s[r] in[r], row by row.
template <typename T>
void scale_rows(const T* in, const std::vector<T>& s, T* out, int64_t width) {
  detail::parallel_chunks(static_cast<int64_t>(s.size()), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t c = 0; c < width; ++c) out[r * width + c] = s[static_cast<size_t>(r)] * in[r * width + c];
  });
}

// dw[i] = <dy, x> over row slots[i].
template <typename T>
void weight_grads(const T* dy, const T* x, const int64_t* slots, T* dw, int64_t copies, int64_t width) {
  detail::parallel_chunks(copies, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = slots[i];
      T dot = 0;
      if (r >= 0)
        for (int64_t c = 0; c < width; ++c) dot += dy[r * width + c] * x[r * width + c];
      dw[i] = dot;
    }
  });
}

bool is_double(const at::Tensor& t) { return t.scalar_type() == at::kDouble; }

void check(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || (t.scalar_type() != at::kFloat && !is_double(t)))
    fail("weigh runs on contiguous float32/float64 CPU tensors, got {}", std::string(t.dtype().name()));
}

template <typename T>
void forward_typed(const at::Tensor& x, const at::Tensor& w, const at::Tensor& slots, at::Tensor& y) {
  const std::vector<T> s = row_weights(w.data_ptr<T>(), slots.data_ptr<int64_t>(), slots.numel(), x.size(0));
  scale_rows(x.data_ptr<T>(), s, y.data_ptr<T>(), x.size(1));
}

template <typename T>
void backward_typed(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& slots,
                    at::Tensor& dx, at::Tensor& dw) {
  const std::vector<T> s = row_weights(w.data_ptr<T>(), slots.data_ptr<int64_t>(), slots.numel(), x.size(0));
  scale_rows(dy.data_ptr<T>(), s, dx.data_ptr<T>(), x.size(1));
  weight_grads(dy.data_ptr<T>(), x.data_ptr<T>(), slots.data_ptr<int64_t>(), dw.data_ptr<T>(), slots.numel(),
               x.size(1));
}

void check_routing(const at::Tensor& x, const at::Tensor& w, const at::Tensor& slots) {
  check(x), check(w);
  if (w.scalar_type() != x.scalar_type())
    fail("weigh takes weights of its rows' dtype {}, got {}", std::string(x.dtype().name()),
         std::string(w.dtype().name()));
  if (slots.scalar_type() != at::kLong || !slots.is_contiguous() || slots.sizes() != w.sizes())
    REMAT_INTERNAL("weigh takes contiguous int64 slots shaped as its weights {}, got {} {}{}",
                   shape_str(w.sizes().vec()), std::string(slots.dtype().name()), shape_str(slots.sizes().vec()),
                   slots.is_contiguous() ? "" : " (not contiguous)");
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &x = e.in(op, 0), &w = e.in(op, 1), &slots = e.in(op, 2);
  check_routing(x, w, slots);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (is_double(x))
    forward_typed<double>(x, w, slots, y);
  else
    forward_typed<float>(x, w, slots, y);
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &x = e.saved_in(op, 0), &w = e.saved_in(op, 1), &slots = e.saved_in(op, 2);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  check(dy);
  at::Tensor dx = at::empty(x.sizes(), dy.options()), dw = at::empty(w.sizes(), dy.options());
  if (is_double(dy))
    backward_typed<double>(dy, x, w, slots, dx, dw);
  else
    backward_typed<float>(dy, x, w, slots, dx, dw);
  e.set_grad(op, 0, std::move(dx));
  e.set_grad(op, 1, std::move(dw));
}

// Planning: fp32 weights on half-precision rows (ModelConfig::router_fp32) make the product in
// fp32 and cast it back (Megatron-LM's experts' unfused bias_act with fp32 probabilities); in
// backward the gradient of that cast is fp32 too. One fp32 copy of the rows in each pass. A
// SwiGLU's product is weighted inside Megatron-LM's fused kernel (weighted_bias_swiglu): none.
int64_t fp32_product(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const TensorSpec &x = b.tensors[n.in[0]], &w = b.tensors[n.in[1]];
  const bool fused = x.producer >= 0 && b.ops[x.producer].kind == OpKind::Swiglu;
  return w.dtype == DType::F32 && x.dtype != DType::F32 && !fused ? x.numel() * dtype_size(DType::F32) : 0;
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.weigh");
  const int x = b.input("x", {6, 4}, DType::F32, "dispatched rows");
  const int w = b.input("weights", {2, 3, 2}, DType::F32, "routing weights");
  const int slots = b.input("slots", {2, 3, 2}, DType::I64, "rows of each copy");
  return b.finish(b.op(OpKind::Weigh, "y", {x, w, slots}, {{"y", {6, 4}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor &x = in[n.in[0]], &w = in[n.in[1]], &slots = in[n.in[2]];
  const at::Tensor kept = (slots >= 0).to(w.scalar_type());  // a dropped copy (-1) weighs no row
  const at::Tensor s =
      at::zeros({x.size(0)}, w.options()).index_add(0, slots.clamp_min(0).reshape({-1}), (w * kept).reshape({-1}));
  return {x * s.unsqueeze(1)};
}

const detail::OpTestCase kTest{example,         reference, /*index_range=*/6, /*float64=*/true, /*example2=*/nullptr,
                               /*index_low=*/-1};

}  // namespace

extern const OpDef kWeigh = [] {
  OpDef d;
  d.name = "weigh";
  d.n_in = 3, d.n_out = 1;
  d.bwd_reads_in = 0b111;
  d.grad_in[0] = GradKind::Fresh;
  d.grad_in[1] = GradKind::Fresh;
  d.forward_scratch = fp32_product;
  d.backward_scratch = fp32_product;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
