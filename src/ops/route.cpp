// route: a mixture of experts' router, from its logits to each token's experts and their weights.
//   in: logits (..., E)   out: weights (..., k), experts (..., k) int64, probs (..., E)
//   probs = softmax(logits) (or a sigmoid per expert); experts = the k highest probabilities, the
//   highest first and, between equal ones, the lower expert first, so that a recompute of the same
//   logits routes every token as the forward did; weights = their probabilities, divided by their
//   sum when Routing::normalize.
//   Routing::sinkhorn (Megatron-LM's sinkhorn router) chooses by balanced scores instead: exp(logits)
//   scaled per token and per expert (Sinkhorn-Knopp) until every token's row sums to 1/tokens and
//   every expert's column nearly to 1/E; a token's k experts are the k highest of its balanced row,
//   which orders its experts as logits + log(column scale) does. The weights stay probabilities.
//   The scales come from every token of the call in a fixed order, one thread, so the choice is the
//   same in any recompute and under any thread count.
//   backward reads experts and probs; dlogits is a fresh tensor. It also adds the gradient of the
//   load-balancing loss aux = c E sum_e f_e P_e (Switch Transformer; Megatron-LM's
//   switch_load_balancing_loss_func), f_e the share of the (token, slot) pairs routed to expert e
//   and P_e its mean probability over the tokens (for sigmoid scores, each token's divided by their
//   sum plus 1e-20 first, as Megatron-LM's compute_routing_scores_for_aux_loss does: raw sigmoids
//   would let the loss fall by lowering every logit), c = Routing::aux_loss: as Megatron's
//   MoEAuxLossAutoScaler does, the loss's value is not part of the model's output and its gradient
//   joins the router's in the backward. Under gradient accumulation the caller divides c by the
//   micro-batches, as it divides the loss.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kRowsPerTask = 64;

// Added to a token's sum of sigmoid scores before they are divided by it for the load-balancing
// loss (Megatron-LM's 1e-20): a token whose every score underflowed divides by it, not by 0.
constexpr double kSigmoidScoreFloor = 1e-20;

// Sinkhorn-Knopp's sweeps stop when the column scales move less than this on average (Megatron-LM's
// tolerance), or after kSinkhornSweeps.
constexpr double kSinkhornTolerance = 1e-4;
constexpr int kSinkhornSweeps = 1000;

// Sinkhorn's working memory, in doubles: the exp(z) table (rows x E), the row scales, and two sets
// of column scales. An ATen tensor, so that the memory tracker sees it (forward_scratch).
int64_t sinkhorn_doubles(int64_t rows, int64_t n) { return rows * n + rows + 2 * n; }

// log of each expert's column scale c_e in the balanced scores a_t exp(z_te) c_e: rows alternately
// scaled to sum to 1 / rows, columns to 1 / E, from c = 1. Each row of exp(z) is taken relative to
// its largest entry, which only rescales a_t: the c_e are those of exp(z) itself. Works in `work`
// (sinkhorn_doubles); returns where in it the E logs are.
template <typename T>
const double* sinkhorn_log_scales(const T* logits, int64_t rows, int64_t n, at::Tensor& work) {
  double* cost = work.data_ptr<double>();
  double* row = cost + rows * n;
  double* col = row + rows;
  double* next = col + n;
  std::fill(col, col + n, 1.0);
  for (int64_t t = 0; t < rows; ++t) {
    const T* z = logits + t * n;
    const double top = static_cast<double>(*std::max_element(z, z + n));
    for (int64_t e = 0; e < n; ++e) cost[t * n + e] = std::exp(static_cast<double>(z[e]) - top);
  }
  const double per_row = 1.0 / static_cast<double>(rows), per_col = 1.0 / static_cast<double>(n);
  for (int sweep = 0; sweep < kSinkhornSweeps; ++sweep) {
    for (int64_t t = 0; t < rows; ++t) {
      double s = 0;
      for (int64_t e = 0; e < n; ++e) s += cost[t * n + e] * col[e];
      row[t] = per_row / s;
    }
    std::fill(next, next + n, 0.0);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t e = 0; e < n; ++e) next[e] += cost[t * n + e] * row[t];
    double moved = 0;
    for (int64_t e = 0; e < n; ++e) {
      next[e] = per_col / next[e];
      moved += std::abs(next[e] - col[e]);
    }
    std::swap(col, next);
    if (moved / static_cast<double>(n) <= kSinkhornTolerance) break;
  }
  for (int64_t e = 0; e < n; ++e) col[e] = std::log(col[e]);
  return col;
}

template <typename T>
void forward_rows(const Routing& r, const T* logits, T* weights, int64_t* experts, T* probs, int64_t rows) {
  const int64_t n = r.experts, k = r.top_k;
  // What a token's experts are chosen by: its probabilities, or its balanced scores (as logits +
  // log column scale, in the same order).
  at::Tensor work = r.sinkhorn ? at::empty({sinkhorn_doubles(rows, n)}, at::kDouble) : at::Tensor();
  const double* balance = r.sinkhorn ? sinkhorn_log_scales(logits, rows, n, work) : nullptr;
  detail::parallel_chunks(rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<double> key(r.sinkhorn ? n : 0);
    for (int64_t t = begin; t < end; ++t) {
      const T* z = logits + t * n;
      T* p = probs + t * n;
      if (r.sigmoid) {
        for (int64_t e = 0; e < n; ++e) p[e] = T(1) / (T(1) + std::exp(-z[e]));
      } else {
        T top = z[0];
        for (int64_t e = 1; e < n; ++e) top = std::max(top, z[e]);
        T sum = 0;
        for (int64_t e = 0; e < n; ++e) sum += (p[e] = std::exp(z[e] - top));
        for (int64_t e = 0; e < n; ++e) p[e] /= sum;
      }
      for (int64_t e = 0; e < static_cast<int64_t>(key.size()); ++e) key[e] = static_cast<double>(z[e]) + balance[e];
      auto above = [&](int64_t a, int64_t b) { return r.sinkhorn ? key[a] > key[b] : p[a] > p[b]; };
      int64_t* ex = experts + t * k;
      T* w = weights + t * k;
      T chosen_sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; ++e) {
          if (std::find(ex, ex + j, e) != ex + j) continue;
          if (best < 0 || above(e, best)) best = e;  // strictly greater: ties go to the lower expert
        }
        ex[j] = best;
        w[j] = p[best];
        chosen_sum += p[best];
      }
      if (r.normalize)
        for (int64_t j = 0; j < k; ++j) w[j] /= chosen_sum;
    }
  });
}

template <typename T>
void backward_rows(const Routing& r, const T* dweights, const int64_t* experts, const T* probs, T* dlogits,
                   int64_t rows) {
  const int64_t n = r.experts, k = r.top_k;
  // The load-balancing loss's gradient by each token's score entering P_e: c E f_e / tokens,
  // f_e = count_e / (tokens k).
  std::vector<double> aux(n, 0.0);
  if (r.aux_loss != 0) {
    for (int64_t i = 0; i < rows * k; ++i) aux[experts[i]] += 1.0;
    const double scale = r.aux_loss * static_cast<double>(n) / (static_cast<double>(rows) * rows * k);
    for (double& a : aux) a *= scale;
  }
  detail::parallel_chunks(rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<T> dp(n);
    for (int64_t t = begin; t < end; ++t) {
      const T* p = probs + t * n;
      const int64_t* ex = experts + t * k;
      const T* dw = dweights + t * k;
      if (r.sigmoid && r.aux_loss != 0) {  // q_e = p_e / S: dp_e = (g_e - sum_e' g_e' q_e') / S
        double sum = kSigmoidScoreFloor, dot = 0;
        for (int64_t e = 0; e < n; ++e) sum += static_cast<double>(p[e]);
        for (int64_t e = 0; e < n; ++e) dot += aux[e] * (static_cast<double>(p[e]) / sum);
        for (int64_t e = 0; e < n; ++e) dp[e] = static_cast<T>((aux[e] - dot) / sum);
      } else {
        for (int64_t e = 0; e < n; ++e) dp[e] = static_cast<T>(aux[e]);
      }
      if (r.normalize) {  // w_j = p_j / S: dp_i = (dw_i - sum_j dw_j w_j) / S
        T sum = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) sum += p[ex[j]];
        for (int64_t j = 0; j < k; ++j) dot += dw[j] * (p[ex[j]] / sum);
        for (int64_t j = 0; j < k; ++j) dp[ex[j]] += (dw[j] - dot) / sum;
      } else {
        for (int64_t j = 0; j < k; ++j) dp[ex[j]] += dw[j];
      }
      T* dz = dlogits + t * n;
      if (r.sigmoid) {
        for (int64_t e = 0; e < n; ++e) dz[e] = dp[e] * p[e] * (T(1) - p[e]);
      } else {
        T dot = 0;
        for (int64_t e = 0; e < n; ++e) dot += dp[e] * p[e];
        for (int64_t e = 0; e < n; ++e) dz[e] = p[e] * (dp[e] - dot);
      }
    }
  });
}

int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  if (!n.routing.sinkhorn) return 0;
  return sinkhorn_doubles(b.tensors[n.in[0]].numel() / n.routing.experts, n.routing.experts) *
         static_cast<int64_t>(sizeof(double));
}

void check(const at::Tensor& t) {
  if (!t.device().is_cpu() || !t.is_contiguous() || (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble))
    fail("route runs on contiguous float32/float64 CPU tensors, got {} on {}", std::string(t.dtype().name()),
         t.device().str());
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor& logits = e.in(op, 0);
  check(logits);
  const int64_t rows = logits.numel() / op.routing.experts;
  at::Tensor weights = at::empty(e.out_shape(op, 0), logits.options());
  at::Tensor experts = at::empty(e.out_shape(op, 1), logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty(e.out_shape(op, 2), logits.options());
  if (logits.scalar_type() == at::kFloat)
    forward_rows(op.routing, logits.data_ptr<float>(), weights.data_ptr<float>(), experts.data_ptr<int64_t>(),
                 probs.data_ptr<float>(), rows);
  else
    forward_rows(op.routing, logits.data_ptr<double>(), weights.data_ptr<double>(), experts.data_ptr<int64_t>(),
                 probs.data_ptr<double>(), rows);
  e.set_out(op, 0, std::move(weights));
  e.set_out(op, 1, std::move(experts));
  e.set_out(op, 2, std::move(probs));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const at::Tensor &experts = e.saved_out(op, 1), &probs = e.saved_out(op, 2);
  if (!e.grad_out(op, 0).defined()) REMAT_INTERNAL("route '{}' has no gradient of its weights", op.name);
  const at::Tensor dweights = e.grad_out(op, 0).contiguous();
  const int64_t rows = probs.numel() / op.routing.experts;
  at::Tensor dlogits = at::empty_like(probs);
  if (probs.scalar_type() == at::kFloat)
    backward_rows(op.routing, dweights.data_ptr<float>(), experts.data_ptr<int64_t>(), probs.data_ptr<float>(),
                  dlogits.data_ptr<float>(), rows);
  else
    backward_rows(op.routing, dweights.data_ptr<double>(), experts.data_ptr<int64_t>(), probs.data_ptr<double>(),
                  dlogits.data_ptr<double>(), rows);
  e.set_grad(op, 0, std::move(dlogits));
}

BlockSpec build(bool sigmoid, bool normalize) {
  ModelConfig cfg;
  detail::Builder b(cfg, sigmoid ? "test.route_sigmoid" : "test.route");
  const int z = b.input("logits", {2, 5, 6}, DType::F32, "router logits");
  b.op(OpKind::Route, "route", {z}, {{"weights", {2, 5, 3}}, {"experts", {2, 5, 3}, DType::I64}, {"probs", {2, 5, 6}}});
  b.last().routing = {6, 3, 0, sigmoid, normalize, 0.0};
  return b.finish(b.last().out[0]);
}

BlockSpec example() { return build(false, true); }
BlockSpec example2() { return build(true, false); }

std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const at::Tensor& z = in[n.in[0]];
  const at::Tensor probs = n.routing.sigmoid ? at::sigmoid(z) : at::softmax(z, -1);
  auto [top, experts] = at::topk(probs, n.routing.top_k);
  const at::Tensor weights = n.routing.normalize ? top / top.sum(-1, true) : top;
  return {weights, experts, probs};
}

const detail::OpTestCase kTest{example, reference, 0, true, example2};

}  // namespace

extern const OpDef kRoute = [] {
  OpDef d;
  d.name = "route";
  d.n_in = 1, d.n_out = 3;
  d.bwd_reads_out = 0b110;
  d.grad_in[0] = GradKind::Fresh;
  d.forward = forward;
  d.backward = backward;
  d.forward_scratch = forward_scratch;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
