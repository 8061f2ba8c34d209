// combine: the experts' outputs weighted back into token order.
//   in: ys (R, C), weights (..., k), slots (..., k) int64   out: y (..., C)
//   y[t] = sum_j weights[t, j] ys[slots[t, j]], j in order; a dropped copy (slot -1) adds nothing.
//   backward reads all three; dys and dweights are fresh tensors (dys zero in rows no copy names).
#include <vector>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/expert_parallel.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRowsPerTask = 64;

template <typename T>
void forward_rows(const T* ys, const T* w, const int64_t* slots, T* y, int64_t tokens, int64_t k, int64_t width) {
  detail::parallel_chunks(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* out = y + t * width;
      std::fill(out, out + width, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[t * k + j];
        if (r < 0) continue;
        const T a = w[t * k + j];
        const T* in = ys + r * width;
        for (int64_t c = 0; c < width; ++c) out[c] += a * in[c];
      }
    }
  });
}

template <typename T>
void backward_rows(const T* dy, const T* ys, const T* w, const int64_t* slots, T* dys, T* dw, int64_t tokens, int64_t k,
                   int64_t width) {
  detail::parallel_chunks(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[t * k + j];
        T dot = 0;
        if (r >= 0)
          for (int64_t c = 0; c < width; ++c) dot += dy[t * width + c] * ys[r * width + c];
        dw[t * k + j] = dot;
      }
  });
  // One pass in token order: a row named twice (never by dispatch's slots) still sums in one order.
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = slots[t * k + j];
      if (r < 0) continue;
      const T a = w[t * k + j];
      for (int64_t c = 0; c < width; ++c) dys[r * width + c] += a * dy[t * width + c];
    }
}

bool is_double(const at::Tensor& t) { return t.scalar_type() == at::kDouble; }

void check(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || (t.scalar_type() != at::kFloat && !is_double(t)))
    fail("combine runs on contiguous float32/float64 CPU tensors, got {}", std::string(t.dtype().name()));
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &ys = e.in(op, 0), &w = e.in(op, 1), &slots = e.in(op, 2);
  check(ys), check(w);
  at::Tensor y = at::empty(e.out_shape(op, 0), ys.options());
  const int64_t k = slots.size(-1), tokens = slots.numel() / k, width = ys.size(1);
  if (is_double(ys))
    forward_rows(ys.data_ptr<double>(), w.data_ptr<double>(), slots.data_ptr<int64_t>(), y.data_ptr<double>(), tokens,
                 k, width);
  else
    forward_rows(ys.data_ptr<float>(), w.data_ptr<float>(), slots.data_ptr<int64_t>(), y.data_ptr<float>(), tokens, k,
                 width);
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &ys = e.saved_in(op, 0), &w = e.saved_in(op, 1), &slots = e.saved_in(op, 2);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  check(dy);
  at::Tensor dys = kernels::zeros(ys.sizes(), dy.options()), dw = at::empty(w.sizes(), dy.options());
  const int64_t k = slots.size(-1), tokens = slots.numel() / k, width = ys.size(1);
  if (is_double(dy))
    backward_rows(dy.data_ptr<double>(), ys.data_ptr<double>(), w.data_ptr<double>(), slots.data_ptr<int64_t>(),
                  dys.data_ptr<double>(), dw.data_ptr<double>(), tokens, k, width);
  else
    backward_rows(dy.data_ptr<float>(), ys.data_ptr<float>(), w.data_ptr<float>(), slots.data_ptr<int64_t>(),
                  dys.data_ptr<float>(), dw.data_ptr<float>(), tokens, k, width);
  e.set_grad(op, 0, std::move(dys));
  e.set_grad(op, 1, std::move(dw));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.combine");
  const int ys = b.input("ys", {6, 4}, DType::F32, "expert outputs");
  const int w = b.input("weights", {2, 3, 2}, DType::F32, "routing weights");
  const int slots = b.input("slots", {2, 3, 2}, DType::I64, "rows of each copy");
  return b.finish(b.op(OpKind::Combine, "y", {ys, w, slots}, {{"y", {2, 3, 4}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor &ys = in[n.in[0]], &w = in[n.in[1]], &slots = in[n.in[2]];
  const at::Tensor kept = (slots >= 0).to(w.scalar_type());  // a dropped copy (-1) adds nothing
  const at::Tensor picked =
      ys.index_select(0, slots.clamp_min(0).reshape({-1})).reshape({slots.size(0), slots.size(1), slots.size(2), -1});
  return {(picked * (w * kept).unsqueeze(-1)).sum(2)};
}

const detail::OpTestCase kTest{example,         reference, /*index_range=*/6, /*float64=*/true, /*example2=*/nullptr,
                               /*index_low=*/-1};

}  // namespace

extern const OpDef kCombine = [] {
  OpDef d;
  d.name = "combine";
  d.n_in = 3, d.n_out = 1;
  d.bwd_reads_in = 0b111;
  d.grad_in[0] = GradKind::Fresh;
  d.grad_in[1] = GradKind::Fresh;
  d.comm = ep::return_comm;  // under expert parallelism (planning): back to the tokens' ranks
  d.forward_scratch = ep::return_buffers;
  d.backward_scratch = ep::return_buffers;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
