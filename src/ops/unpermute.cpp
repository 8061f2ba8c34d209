// unpermute: the experts' outputs, already weighted (weigh), summed back into token order.
//   in: ys (R, C), slots (..., k) int64   out: y (..., C)
//   y[t] = sum_j ys[slots[t, j]], j in order; a dropped copy (slot -1) adds nothing.
//   backward reads slots alone; dys is a fresh tensor (zero in rows no copy names). Planned as
//   PyTorch's deterministic index_add (Routing::deterministic), it keeps ys as well, as that
//   op's autograd does (its gradient of the source is expanded to the source's shape).
#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/expert_parallel.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "remat/units.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRowsPerTask = 64;

template <typename T>
void forward_rows(const T* ys, const int64_t* slots, T* y, int64_t tokens, int64_t k, int64_t width) {
  detail::parallel_chunks(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* out = y + t * width;
      std::fill(out, out + width, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[t * k + j];
        if (r < 0) continue;
        const T* in = ys + r * width;
        for (int64_t c = 0; c < width; ++c) out[c] += in[c];
      }
    }
  });
}

// One pass in token order: a row named twice (never by dispatch's slots) still sums in one order.
template <typename T>
void backward_rows(const T* dy, const int64_t* slots, T* dys, int64_t tokens, int64_t k, int64_t width) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = slots[t * k + j];
      if (r < 0) continue;
      for (int64_t c = 0; c < width; ++c) dys[r * width + c] += dy[t * width + c];
    }
}

bool is_double(const at::Tensor& t) { return t.scalar_type() == at::kDouble; }

void check(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || (t.scalar_type() != at::kFloat && !is_double(t)))
    fail("unpermute runs on contiguous float32/float64 CPU tensors, got {}", std::string(t.dtype().name()));
}

void check_slots(const at::Tensor& slots) {
  if (slots.scalar_type() != at::kLong || !slots.is_contiguous())
    REMAT_INTERNAL("unpermute takes contiguous int64 slots, got {} {}{}", std::string(slots.dtype().name()),
                   shape_str(slots.sizes().vec()), slots.is_contiguous() ? "" : " (not contiguous)");
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &ys = e.in(op, 0), &slots = e.in(op, 1);
  check(ys), check_slots(slots);
  at::Tensor y = at::empty(e.out_shape(op, 0), ys.options());
  const int64_t k = slots.size(-1), tokens = slots.numel() / k, width = ys.size(1);
  if (is_double(ys))
    forward_rows(ys.data_ptr<double>(), slots.data_ptr<int64_t>(), y.data_ptr<double>(), tokens, k, width);
  else
    forward_rows(ys.data_ptr<float>(), slots.data_ptr<int64_t>(), y.data_ptr<float>(), tokens, k, width);
  e.set_out(op, 0, std::move(y));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& slots = e.saved_in(op, 1);
  const at::Tensor dy = e.grad_out(op, 0).contiguous();
  check(dy), check_slots(slots);
  const std::vector<int64_t>& rows = e.in_shape(op, 0);
  at::Tensor dys = kernels::zeros(rows, dy.options());
  const int64_t k = slots.size(-1), tokens = slots.numel() / k, width = rows.back();
  if (is_double(dy))
    backward_rows(dy.data_ptr<double>(), slots.data_ptr<int64_t>(), dys.data_ptr<double>(), tokens, k, width);
  else
    backward_rows(dy.data_ptr<float>(), slots.data_ptr<int64_t>(), dys.data_ptr<float>(), tokens, k, width);
  e.set_grad(op, 0, std::move(dys));
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.unpermute");
  const int ys = b.input("ys", {6, 4}, DType::F32, "expert outputs");
  const int slots = b.input("slots", {2, 3, 2}, DType::I64, "rows of each copy");
  return b.finish(b.op(OpKind::Unpermute, "y", {ys, slots}, {{"y", {2, 3, 4}}})[0]);
}

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor &ys = in[n.in[0]], &slots = in[n.in[1]];
  const at::Tensor kept = (slots >= 0).to(ys.scalar_type()).unsqueeze(-1);  // a dropped copy adds nothing
  const at::Tensor picked =
      ys.index_select(0, slots.clamp_min(0).reshape({-1})).reshape({slots.size(0), slots.size(1), slots.size(2), -1});
  return {(picked * kept).sum(2)};
}

const detail::OpTestCase kTest{example,         reference, /*index_range=*/6, /*float64=*/true, /*example2=*/nullptr,
                               /*index_low=*/-1};

}  // namespace

extern const OpDef kUnpermute = [] {
  OpDef d;
  d.name = "unpermute";
  d.n_in = 2, d.n_out = 1;
  d.bwd_reads_in = 0b10;
  d.bwd_reads_in_of = [](const OpNode& n) { return n.routing.deterministic ? 0b11u : 0b10u; };
  d.grad_in[0] = GradKind::Fresh;
  d.comm = ep::return_comm;  // under expert parallelism (planning): back to the tokens' ranks
  d.forward_scratch = ep::return_buffers;
  d.backward_scratch = ep::return_buffers;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
