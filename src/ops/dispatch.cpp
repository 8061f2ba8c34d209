// dispatch: each token's copies into the rows of the experts it was routed to.
//   in: x (..., C), experts (..., k) int64   out: xs (R, C), slots (..., k) int64, rows (R) int64
//   Expert e's rows are contiguous and in token order (token t's j-th expert before token t+1's).
//   Dropless (Routing::capacity 0): R = tokens x k, expert e's rows start after those of the
//   experts before it. With a capacity c: R = E x c, expert e holds rows [e c, e c + c); a copy
//   that finds its expert full is dropped (slot -1, its weight then counts for nothing) and rows
//   left empty are zeros. slots[t, j] is the row of token t's j-th copy; rows[r] the expert of
//   row r (-1: empty). The routing decides every value; the sizes are known before the step.
//   backward reads slots; dx is a fresh tensor, the sum of its copies' gradients.
#include <cstring>
#include <vector>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/expert_parallel.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRowsPerTask = 64;

// slots and rows from the experts, as the header says.
void place(const Routing& r, const int64_t* experts, int64_t copies, int64_t* slots, int64_t* rows, int64_t n_rows) {
  for (int64_t i = 0; i < copies; ++i)
    if (experts[i] < 0 || experts[i] >= r.experts)
      REMAT_INTERNAL("dispatch: expert {} outside [0, {})", experts[i], r.experts);
  std::vector<int64_t> next(r.experts, 0);
  if (r.capacity == 0) {
    for (int64_t i = 0; i < copies; ++i) ++next[experts[i]];
    int64_t start = 0;
    for (int64_t& n : next) start += std::exchange(n, start);
  } else {
    for (int64_t e = 0; e < r.experts; ++e) next[e] = e * r.capacity;
  }
  std::fill(rows, rows + n_rows, int64_t{-1});
  for (int64_t i = 0; i < copies; ++i) {
    const int64_t e = experts[i];
    if (r.capacity > 0 && next[e] == (e + 1) * r.capacity) {
      slots[i] = -1;
      continue;
    }
    slots[i] = next[e]++;
    rows[slots[i]] = e;
  }
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &x = e.in(op, 0), &experts = e.in(op, 1).contiguous();
  if (!x.device().is_cpu() || !x.is_contiguous())
    fail("dispatch runs on contiguous CPU tensors; its input is on {} (contiguous={})", x.device().str(),
         x.is_contiguous());
  const int64_t k = op.routing.top_k, width = x.size(-1), tokens = x.numel() / width;
  at::Tensor xs = at::empty(e.out_shape(op, 0), x.options());
  at::Tensor slots = at::empty(e.out_shape(op, 1), experts.options());
  at::Tensor rows = at::empty(e.out_shape(op, 2), experts.options());
  place(op.routing, experts.data_ptr<int64_t>(), tokens * k, slots.data_ptr<int64_t>(), rows.data_ptr<int64_t>(),
        rows.numel());
  const int64_t row_bytes = width * static_cast<int64_t>(x.element_size());
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(xs.data_ptr());
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  detail::parallel_chunks(xs.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)  // empty capacity rows
      if (rw[r] < 0) std::memset(dst + r * row_bytes, 0, row_bytes);
  });
  detail::parallel_chunks(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (s[t * k + j] >= 0) std::memcpy(dst + s[t * k + j] * row_bytes, src + t * row_bytes, row_bytes);
  });
  e.set_out(op, 0, std::move(xs));
  e.set_out(op, 1, std::move(slots));
  e.set_out(op, 2, std::move(rows));
}

template <typename T>
void gather_rows(const T* dxs, const int64_t* slots, T* dx, int64_t tokens, int64_t k, int64_t width) {
  detail::parallel_chunks(tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* out = dx + t * width;
      std::fill(out, out + width, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[t * k + j];
        if (r < 0) continue;
        const T* in = dxs + r * width;
        for (int64_t c = 0; c < width; ++c) out[c] += in[c];
      }
    }
  });
}

void backward(detail::OpEnv& e, const OpNode& op) {
  if (!e.needs_grad(op, 0)) return;
  const at::Tensor& slots = e.saved_out(op, 1);
  const at::Tensor dxs = e.grad_out(op, 0).contiguous();
  std::vector<int64_t> shape = slots.sizes().vec();
  shape.back() = dxs.size(1);
  at::Tensor dx = at::empty(shape, dxs.options());
  const int64_t k = op.routing.top_k, tokens = slots.numel() / k;
  if (dxs.scalar_type() == at::kFloat)
    gather_rows(dxs.data_ptr<float>(), slots.data_ptr<int64_t>(), dx.data_ptr<float>(), tokens, k, dxs.size(1));
  else if (dxs.scalar_type() == at::kDouble)
    gather_rows(dxs.data_ptr<double>(), slots.data_ptr<int64_t>(), dx.data_ptr<double>(), tokens, k, dxs.size(1));
  else
    fail("dispatch's backward runs on float32/float64, got {}", std::string(dxs.dtype().name()));
  e.set_grad(op, 0, std::move(dx));
}

// Under expert parallelism (planning) the buffer's rows arrive from the group as the token
// dispatcher moves them (ops/expert_parallel.h): the alltoall dispatcher's copies in expert order
// sent, those received and gathered before they are grouped by local expert (Megatron-LM's
// permute, all-to-all, all-gather, sort by expert); the allgather dispatcher's kept buffer.
OpComm comm(const BlockSpec& b, const OpNode& n) {
  if (n.routing.allgather) return ep::gathered_comm(n.routing, b.tensors[n.in[0]].bytes());
  return ep::all_to_all(n.routing, b.tensors[n.out[0]].bytes());
}

int64_t exchange_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const int64_t tokens = b.tensors[n.in[0]].bytes(), rows = b.tensors[n.out[0]].bytes();
  return ep::exchange_buffers(n.routing, ep::copies_bytes(n.routing, tokens, rows), rows);
}

int64_t exchange_scratch_backward(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const int64_t tokens = b.tensors[n.in[0]].bytes(), rows = b.tensors[n.out[0]].bytes();
  return ep::exchange_buffers_backward(n.routing, ep::copies_bytes(n.routing, tokens, rows), rows, tokens);
}

BlockSpec build(int64_t capacity) {
  ModelConfig cfg;
  detail::Builder b(cfg, capacity ? "test.dispatch_capacity" : "test.dispatch");
  const int64_t experts = 4, k = 2, rows = capacity ? experts * capacity : 2 * 5 * k;
  const int x = b.input("x", {2, 5, 3}, DType::F32, "tokens");
  const int ex = b.input("experts", {2, 5, k}, DType::I64, "routed experts");
  b.op(OpKind::Dispatch, "xs", {x, ex},
       {{"xs", {rows, 3}}, {"slots", {2, 5, k}, DType::I64}, {"rows", {rows}, DType::I64}});
  b.last().routing = {experts, k, capacity, false, true, 0.0};
  return b.finish(b.last().out[0]);
}

BlockSpec example() { return build(0); }
BlockSpec example2() { return build(2); }  // 20 copies for 8 rows: most are dropped

// The rows in ATen: a copy's place among its expert's copies is a running count of a one-hot.
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const Routing& r = n.routing;
  const at::Tensor& x = in[n.in[0]];
  const at::Tensor experts = in[n.in[1]].reshape({-1});
  const at::Tensor onehot = at::one_hot(experts, r.experts);
  const at::Tensor place = (onehot.cumsum(0) - 1).gather(1, experts.unsqueeze(1)).squeeze(1);
  const at::Tensor counts = onehot.sum(0);
  const at::Tensor start =
      r.capacity ? at::arange(r.experts, experts.options()) * r.capacity : counts.cumsum(0) - counts;
  at::Tensor slots = start.index_select(0, experts) + place;
  const int64_t n_rows = r.capacity ? r.experts * r.capacity : experts.numel();
  if (r.capacity) slots = at::where(place < r.capacity, slots, at::full_like(slots, -1));
  const at::Tensor kept = (slots >= 0).nonzero().squeeze(1);
  const at::Tensor tokens = at::div(kept, r.top_k, "floor");
  const at::Tensor xs =
      at::zeros({n_rows, x.size(-1)}, x.options())
          .index_copy(0, slots.index_select(0, kept), x.reshape({-1, x.size(-1)}).index_select(0, tokens));
  const at::Tensor rows = at::full({n_rows}, -1, experts.options())
                              .index_copy(0, slots.index_select(0, kept), experts.index_select(0, kept));
  return {xs, slots.reshape(in[n.in[1]].sizes()), rows};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/4, true, example2};

}  // namespace

extern const OpDef kDispatch = [] {
  OpDef d;
  d.name = "dispatch";
  d.n_in = 2, d.n_out = 3;
  d.bwd_reads_out = 0b010;
  d.grad_in[0] = GradKind::Fresh;
  d.comm = comm;
  d.forward_scratch = exchange_scratch;
  d.backward_scratch = exchange_scratch_backward;
  d.forward = forward;
  d.backward = backward;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
