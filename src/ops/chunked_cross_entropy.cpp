// chunked_cross_entropy: the LM head and the loss fused, a chunk of tokens at a time: no logits
// tensor of the whole micro-batch ever exists (torchtune's chunked output loss, Liger's fused linear
// cross-entropy). Only each token's log-sum-exp is kept; the backward recomputes each chunk's logits.
//   in: x (B, T, C), targets (B, T) int64   params: weight (V, C)   out: loss (scalar float32),
//   lse (B, T) float32
//   forward, per chunk of rows: logits = x W^T into one reused buffer, lse and the target's logit
//   from it; loss = mean(lse - logit[target]).
//   backward reads x, targets, the weight and lse; per chunk: logits again, turned in place into
//   dlogits = (softmax - onehot) * dloss / N, then dx = dlogits W (a fresh tensor) and
//   dW += dlogits^T x. OpNode::chunks chunks of ceil(B T / chunks) rows.
// Planning bf16/fp16: the chunk's logits in the model's dtype are up-cast to fp32 (forward), and the
// fp32 gradient cast back for the products (backward): scratch counts both.
#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "ops/tensor_parallel.h"
#include "remat/error.h"
#include "util/gemm.h"

namespace remat::ops {
namespace {

int64_t rows_of(const BlockSpec& b, const OpNode& n) { return b.tensors[n.in[1]].numel(); }
int64_t chunk_rows(int64_t rows, int64_t chunks) {
  return (rows + std::max<int64_t>(chunks, 1) - 1) / std::max<int64_t>(chunks, 1);
}

// The lse of each row of `logits` (rows x V) into `lse`, and the sum over rows of lse - the target's
// logit. float32 on the vector loops and remat's kernel threads (ops/kernels.h); float64 (the op
// tests) in plain double loops.
double lse_rows(const float* logits, int64_t rows, int64_t v, const int64_t* targets, float* lse) {
  kernels::log_sum_exp_rows(logits, lse, rows, v);
  double loss = 0;
  for (int64_t r = 0; r < rows; ++r)
    loss += static_cast<double>(lse[r]) - static_cast<double>(logits[r * v + targets[r]]);
  return loss;
}
double lse_rows(const double* logits, int64_t rows, int64_t v, const int64_t* targets, double* lse) {
  double loss = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = logits + r * v;
    const double m = *std::max_element(row, row + v);
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(row[j] - m);
    lse[r] = m + std::log(sum);
    loss += lse[r] - row[targets[r]];
  }
  return loss;
}

// Turns each row of logits into (softmax - onehot(target)) * scale, in place.
void dlogits_rows(float* logits, int64_t rows, int64_t v, const int64_t* targets, const float* lse, double scale) {
  kernels::softmax_from_lse_rows(logits, lse, static_cast<float>(scale), logits, rows, v);
  for (int64_t r = 0; r < rows; ++r) logits[r * v + targets[r]] -= static_cast<float>(scale);
}
void dlogits_rows(double* logits, int64_t rows, int64_t v, const int64_t* targets, const double* lse, double scale) {
  for (int64_t r = 0; r < rows; ++r) {
    double* row = logits + r * v;
    for (int64_t j = 0; j < v; ++j) row[j] = std::exp(row[j] - lse[r]) * scale;
    row[targets[r]] -= scale;
  }
}

void check_cpu(const OpNode& op, const at::Tensor& x) {
  if (!x.device().is_cpu() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble))
    fail("chunked_cross_entropy runs on CPU float32 and float64 on this build; '{}' got {} on {}", op.name,
         c10::toString(x.scalar_type()), x.device().str());
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor x = e.in(op, 0).contiguous();
  const at::Tensor t = e.in(op, 1).contiguous();
  const at::Tensor& w = e.param(op, 0);
  check_cpu(op, x);
  const int64_t n = t.numel(), c = x.size(-1), v = w.size(0), per = chunk_rows(n, op.chunks);
  const at::Tensor x2 = x.view({n, c});
  // float32 as the table says (float64 in the op tests, which hold float64 to 1e-12); the outputs
  // first, then the chunk buffer.
  const at::TensorOptions stats = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor loss_t = at::empty({}, stats);
  at::Tensor lse = at::empty(t.sizes(), stats);
  at::Tensor buffer = at::empty({per, v}, x.options());
  double loss = 0;
  for (int64_t r0 = 0; r0 < n; r0 += per) {
    const int64_t rows = std::min(per, n - r0);
    at::Tensor logits = buffer.narrow(0, 0, rows);
    detail::mm_out(logits, x2.narrow(0, r0, rows), false, w, true, 0.0);
    const int64_t* targets = t.data_ptr<int64_t>() + r0;
    loss += x.scalar_type() == at::kFloat
                ? lse_rows(logits.data_ptr<float>(), rows, v, targets, lse.data_ptr<float>() + r0)
                : lse_rows(logits.data_ptr<double>(), rows, v, targets, lse.data_ptr<double>() + r0);
  }
  buffer = at::Tensor();
  loss_t.fill_(loss / static_cast<double>(n));
  e.set_out(op, 0, std::move(loss_t));
  e.set_out(op, 1, std::move(lse));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& x = e.saved_in(op, 0);
  const at::Tensor& t = e.saved_in(op, 1);
  const at::Tensor& lse = e.saved_out(op, 1);
  const at::Tensor& w = e.param(op, 0);
  const int64_t n = t.numel(), c = x.size(-1), v = w.size(0), per = chunk_rows(n, op.chunks);
  const double scale = e.grad_out(op, 0).item<double>() / static_cast<double>(n);
  const at::Tensor x2 = x.reshape({n, c});
  at::Tensor dx = e.needs_grad(op, 0) ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor dw = at::empty(w.sizes(), w.options());
  at::Tensor buffer = at::empty({per, v}, x.options());
  for (int64_t r0 = 0; r0 < n; r0 += per) {
    const int64_t rows = std::min(per, n - r0);
    at::Tensor logits = buffer.narrow(0, 0, rows);
    detail::mm_out(logits, x2.narrow(0, r0, rows), false, w, true, 0.0);
    const int64_t* targets = t.data_ptr<int64_t>() + r0;
    if (x.scalar_type() == at::kFloat)
      dlogits_rows(logits.data_ptr<float>(), rows, v, targets, lse.data_ptr<float>() + r0, scale);
    else
      dlogits_rows(logits.data_ptr<double>(), rows, v, targets, lse.data_ptr<double>() + r0, scale);
    if (dx.defined()) {
      at::Tensor dx_rows = dx.view({n, c}).narrow(0, r0, rows);
      detail::mm_out(dx_rows, logits, false, w, false, 0.0);
    }
    detail::mm_out(dw, logits, true, x2.narrow(0, r0, rows), false, r0 == 0 ? 0.0 : 1.0);
  }
  buffer = at::Tensor();
  if (dx.defined()) e.set_grad(op, 0, std::move(dx));
  e.add_param_grad(op, 0, std::move(dw));
}

OpFlops flops(const BlockSpec& b, const OpNode& n) {
  const int64_t tokens = rows_of(b, n), c = b.tensors[n.in[0]].shape.back(), v = b.params[n.params[0]].shape[0];
  return {2 * tokens * c * v, 6 * tokens * c * v};  // backward: the logits again, dx and dW
}

// One chunk's logits; planning bf16/fp16, their fp32 copy beside them (forward) and the gradient
// cast back for the products (backward).
int64_t chunk_bytes(const BlockSpec& b, const OpNode& n, bool backward) {
  const int64_t d = dtype_size(b.dtype), v = b.params[n.params[0]].shape[0];
  const int64_t per_element = d == 4 ? 4 : d + 4 + (backward ? d : 0);
  return chunk_rows(rows_of(b, n), n.chunks) * v * per_element;
}
int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) { return chunk_bytes(b, n, false); }
int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) { return chunk_bytes(b, n, true); }

// Vocabulary split: per token the maximum, the sum of exponentials and the target's logit are
// all-reduced in float32, forward and again when the backward reruns the chunk; dx is all-reduced.
OpComm comm(const BlockSpec& b, const OpNode& n) {
  const int64_t tokens = rows_of(b, n);
  const double stats = 3 * tp::all_reduce(tokens * 4, n.tp.ranks);
  return {stats, stats + tp::all_reduce(b.tensors[n.in[0]].bytes(), n.tp.ranks)};
}

BlockSpec example() {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.chunked_cross_entropy");
  const int x = b.input("x", {2, 5, 6}, DType::F32, "normed hidden states");
  const int targets = b.input("targets", {2, 5}, DType::I64, "targets");
  const std::vector<int> out =
      b.op(OpKind::ChunkedCrossEntropy, "loss", {x, targets}, {{"loss", {}, DType::F32}, {"lse", {2, 5}, DType::F32}},
           {{"logits.weight", {11, 6}}});
  b.last().chunks = 3;  // 4 + 4 + 2 rows
  return b.finish(out[0]);
}

std::vector<at::Tensor> reference(const OpNode&, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& p) {
  const at::Tensor logits = at::matmul(in[0], p[0].t());
  const at::Tensor logp = at::log_softmax(logits, -1);
  return {at::nll_loss(logp.reshape({-1, logits.size(-1)}), in[1].reshape({-1})), at::logsumexp(logits, -1)};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/11};

}  // namespace

extern const OpDef kChunkedCrossEntropy = [] {
  OpDef d;
  d.name = "chunked_cross_entropy";
  d.n_in = 2, d.n_out = 2, d.max_params = 1;
  d.bwd_reads_in = 0b11;
  d.bwd_reads_out = 0b10;
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
