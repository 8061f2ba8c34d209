// flash_attention: fused causal attention that keeps only its output and a (B, H, T) log-sum-exp;
// no T x T tensor ever exists (Dao et al. 2022, 2023). NOTE [Flash attention].
//   in: q_src, k_src, v_src holding q, k and v at the layout's columns (any two, or all three, may be
//       one tensor: a fused projection)   out: atty (B, T, H D), lse (B, H, T)
//   backward reads the inputs and both outputs, reruns each tile's scores from q, k and lse, and
//   adds dq, dk and dv into the inputs' gradients.
//
// Forward: each (batch, head, tile of query rows) runs over the tiles of keys with an online
// softmax: the output rows are rescaled as the row maximum grows. Backward: each (batch, key/value
// head) runs every query head that shares it, every query tile and every key tile in a fixed
// order, so dq, dk and dv are summed in the same order on any thread count. Tile products are
// single-threaded BLAS calls on remat's kernel threads; the pointwise work is kernels.h's.
//
// Dropout on the probabilities draws one seed, where math attention's mask op draws its own, and
// keeps element (b, h, i, j) exactly when math attention's packed probs_mask keeps it: the mask is
// addressed by element, so each tile regenerates its part (forward, backward, any recompute)
// without a stored mask, and a model trains the same under --attention math and flash up to
// float rounding.
#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "core/builder.h"
#include "ops/attention_common.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "remat/error.h"
#include "util/gemm.h"
#include "util/parallel.h"

namespace remat::ops {
namespace {

constexpr int64_t kTile = 128;  // query rows and key columns per tile

int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

// Key tiles a query tile meets: all of them, or (causal) those up to its last row.
int64_t key_tiles(const AttentionLayout& l, int64_t qt) {
  return l.causal ? std::min(tiles(l.seq), qt + 1) : tiles(l.seq);
}

// Keys row i sees within the tile of columns [j0, j0 + nc).
int64_t visible(const AttentionLayout& l, int64_t i, int64_t j0, int64_t nc) {
  return l.causal ? std::clamp<int64_t>(i - j0 + 1, 0, nc) : nc;
}

// Where (b, h, i, j0) sits in math attention's packed probabilities: its dropout mask's index.
int64_t mask_index(const AttentionLayout& l, int64_t b, int64_t h, int64_t i, int64_t j0) {
  const int64_t r = i / l.block;
  return attention::matrix_offset(l, r, b, h) + (i - l.first_row(r)) * l.cols(r) + j0;
}

// Raw pointers and row strides of the tensors one call works on.
struct Geometry {
  AttentionLayout l;
  int64_t ld_q = 0, ld_k = 0, ld_v = 0, ld_o = 0;
  const float *qs = nullptr, *ks = nullptr, *vs = nullptr;
  int64_t rows(int64_t b, int64_t t) const { return b * l.seq + t; }
  const float* q(int64_t b, int64_t h, int64_t t) const { return qs + rows(b, t) * ld_q + l.q_col + h * l.head_dim; }
  const float* k(int64_t b, int64_t g, int64_t t) const { return ks + rows(b, t) * ld_k + l.k_col + g * l.head_dim; }
  const float* val(int64_t b, int64_t g, int64_t t) const { return vs + rows(b, t) * ld_v + l.v_col + g * l.head_dim; }
};

Geometry geometry(const AttentionLayout& l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  Geometry g;
  g.l = l;
  g.ld_q = q.size(2);
  g.ld_k = k.size(2);
  g.ld_v = v.size(2);
  g.ld_o = l.heads * l.head_dim;
  g.qs = q.data_ptr<float>();
  g.ks = k.data_ptr<float>();
  g.vs = v.data_ptr<float>();
  return g;
}

// Per-thread scratch, in floats: forward a tile of scores and the row maxima; backward two tiles
// and the rows' dO . O. Dropout adds a tile of keep bytes either way.
int64_t forward_floats() { return kTile * kTile + kTile; }
int64_t backward_floats() { return 2 * kTile * kTile + kTile; }

bool supported(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

void check_supported(const OpNode& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (!supported(q) || !supported(k) || !supported(v))
    fail("flash_attention runs on contiguous float32 CPU tensors on this build; '{}' got {} on {}", op.name,
         c10::toString(q.scalar_type()), q.device().str());
}

// rowsum(dO * O) of `rows` query rows, both with row stride ld: rowsum(P * dP), dropout or not.
void row_dots(const float* dout, const float* o, int64_t ld, int64_t rows, int64_t d, float* dot) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *a = dout + r * ld, *c = o + r * ld;
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) sum += a[i] * c[i];
    dot[r] = sum;
  }
}

// The dropped row of P into `out` (n visible of nc columns, the rest 0), and its keep bytes into `keep`.
void drop_row(const float* row, uint8_t* keep, int64_t index, int64_t n, int64_t nc, double p, uint64_t seed,
              float* out) {
  kernels::dropout_keep(keep, index, n, p, seed);
  kernels::mask_scale(row, keep, static_cast<float>(1.0 / (1.0 - p)), out, n);
  std::fill(out + n, out + nc, 0.0f);
}

void forward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor &q = e.in(op, 0), &k = e.in(op, 1), &v = e.in(op, 2);
  check_supported(op, q, k, v);
  const Geometry geo = geometry(l, q, k, v);
  const bool dropout = op.p > 0;
  const uint64_t seed = dropout ? e.seed(op) : 0;
  const float scale = static_cast<float>(attention::scale(l));
  at::Tensor atty = at::empty({l.batch, l.seq, l.heads * l.head_dim}, q.options());
  at::Tensor lse = at::empty({l.batch, l.heads, l.seq}, q.options());
  const int slots = detail::kernel_threads();
  at::Tensor scratch = at::empty({slots, forward_floats()}, q.options());
  at::Tensor keep = dropout ? at::empty({slots, kTile * kTile}, q.options().dtype(at::kBool)) : at::Tensor();
  float* out = atty.data_ptr<float>();
  float* plse = lse.data_ptr<float>();
  const int64_t nq = tiles(l.seq), D = l.head_dim;
  detail::SingleThreadedBlas one_thread;
  detail::parallel_chunks_indexed(l.batch * l.heads * nq, 1, [&](int64_t task, int64_t, int worker) {
    const int64_t b = task / (l.heads * nq), h = task / nq % l.heads, qt = task % nq, g = h / l.group();
    const int64_t i0 = qt * kTile, rows = std::min(kTile, l.seq - i0);
    float* s = scratch.data_ptr<float>() + worker * forward_floats();
    float* m = s + kTile * kTile;
    uint8_t* kp = dropout ? reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()) + worker * kTile * kTile : nullptr;
    float* l_row = plse + (b * l.heads + h) * l.seq + i0;  // the row sums, until they become lse
    float* o = out + geo.rows(b, i0) * geo.ld_o + h * D;
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = std::numeric_limits<float>::lowest();
      l_row[r] = 0.0f;
      std::fill(o + r * geo.ld_o, o + r * geo.ld_o + D, 0.0f);
    }
    for (int64_t kt = 0; kt < key_tiles(l, qt); ++kt) {
      const int64_t j0 = kt * kTile, nc = std::min(kTile, l.seq - j0);
      detail::sgemm(false, true, rows, nc, D, scale, geo.q(b, h, i0), geo.ld_q, geo.k(b, g, j0), geo.ld_k, 0.0f, s,
                    kTile);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = visible(l, i0 + r, j0, nc);
        float* row = s + r * kTile;
        float* o_row = o + r * geo.ld_o;
        if (n == 0) {
          std::fill(row, row + nc, 0.0f);
          continue;
        }
        const float alpha = kernels::online_softmax_row(row, row, n, m[r], l_row[r]);
        std::fill(row + n, row + nc, 0.0f);
        if (dropout) drop_row(row, kp, mask_index(l, b, h, i0 + r, j0), n, nc, op.p, seed, row);
        if (alpha != 1.0f)
          for (int64_t d = 0; d < D; ++d) o_row[d] *= alpha;
      }
      detail::sgemm(false, false, rows, D, nc, 1.0f, s, kTile, geo.val(b, g, j0), geo.ld_v, 1.0f, o, geo.ld_o);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / l_row[r];
      for (int64_t d = 0; d < D; ++d) o[r * geo.ld_o + d] *= inv;
      l_row[r] = m[r] + std::log(l_row[r]);
    }
  });
  e.set_out(op, 0, std::move(atty));
  e.set_out(op, 1, std::move(lse));
}

void backward(detail::OpEnv& e, const OpNode& op) {
  const AttentionLayout& l = op.attn;
  const at::Tensor &q = e.saved_in(op, 0), &k = e.saved_in(op, 1), &v = e.saved_in(op, 2);
  const at::Tensor &atty = e.saved_out(op, 0), &lse = e.saved_out(op, 1);
  const at::Tensor dout_t = e.grad_out(op, 0).contiguous();
  check_supported(op, q, k, v);
  const Geometry geo = geometry(l, q, k, v);
  const bool dropout = op.p > 0;
  const uint64_t seed = dropout ? e.seed(op) : 0;
  const float keep_scale = static_cast<float>(1.0 / (1.0 - op.p)), scale = static_cast<float>(attention::scale(l));
  at::Tensor& dq_t = e.grad_slot(op, 0);
  at::Tensor& dk_t = e.grad_slot(op, 1);  // the same tensor as dq_t when q and k share one
  at::Tensor& dv_t = e.grad_slot(op, 2);  // and so on
  const int slots = detail::kernel_threads();
  at::Tensor scratch = at::empty({slots, backward_floats()}, q.options());
  at::Tensor keep = dropout ? at::empty({slots, kTile * kTile}, q.options().dtype(at::kBool)) : at::Tensor();
  const float *o = atty.data_ptr<float>(), *plse = lse.data_ptr<float>(), *dout = dout_t.data_ptr<float>();
  float *pdq = dq_t.data_ptr<float>(), *pdk = dk_t.data_ptr<float>(), *pdv = dv_t.data_ptr<float>();
  const int64_t nq = tiles(l.seq), D = l.head_dim, G = l.group();
  detail::SingleThreadedBlas one_thread;
  detail::parallel_chunks_indexed(l.batch * l.kv(), 1, [&](int64_t task, int64_t, int worker) {
    const int64_t b = task / l.kv(), g = task % l.kv();
    float* p = scratch.data_ptr<float>() + worker * backward_floats();
    float* ds = p + kTile * kTile;
    float* dot = ds + kTile * kTile;
    uint8_t* kp = dropout ? reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()) + worker * kTile * kTile : nullptr;
    for (int64_t h = g * G; h < (g + 1) * G; ++h)
      for (int64_t qt = 0; qt < nq; ++qt) {
        const int64_t i0 = qt * kTile, rows = std::min(kTile, l.seq - i0);
        const float* lse_row = plse + (b * l.heads + h) * l.seq + i0;
        const float* do_rows = dout + geo.rows(b, i0) * geo.ld_o + h * D;
        float* dq = pdq + geo.rows(b, i0) * geo.ld_q + l.q_col + h * D;
        row_dots(do_rows, o + geo.rows(b, i0) * geo.ld_o + h * D, geo.ld_o, rows, D, dot);
        for (int64_t kt = 0; kt < key_tiles(l, qt); ++kt) {
          const int64_t j0 = kt * kTile, nc = std::min(kTile, l.seq - j0);
          float* dk = pdk + geo.rows(b, j0) * geo.ld_k + l.k_col + g * D;
          float* dvv = pdv + geo.rows(b, j0) * geo.ld_v + l.v_col + g * D;
          detail::sgemm(false, true, rows, nc, D, scale, geo.q(b, h, i0), geo.ld_q, geo.k(b, g, j0), geo.ld_k, 0.0f, p,
                        kTile);
          for (int64_t r = 0; r < rows; ++r) {  // P, then the dropped P into ds (for dV)
            const int64_t n = visible(l, i0 + r, j0, nc);
            float* row = p + r * kTile;
            kernels::exp_shifted(row, row, n, lse_row[r]);
            std::fill(row + n, row + nc, 0.0f);
            if (dropout)
              drop_row(row, kp + r * kTile, mask_index(l, b, h, i0 + r, j0), n, nc, op.p, seed, ds + r * kTile);
          }
          // dV += P_dropped^T dO
          detail::sgemm(true, false, nc, D, rows, 1.0f, dropout ? ds : p, kTile, do_rows, geo.ld_o, 1.0f, dvv,
                        geo.ld_v);
          // dP = dO V^T, then dS = P (dP * keep / (1 - p) - dot), in place
          detail::sgemm(false, true, rows, nc, D, 1.0f, do_rows, geo.ld_o, geo.val(b, g, j0), geo.ld_v, 0.0f, ds,
                        kTile);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = visible(l, i0 + r, j0, nc);
            kernels::softmax_grad_row(p + r * kTile, ds + r * kTile, dropout ? kp + r * kTile : nullptr, keep_scale,
                                      dot[r], ds + r * kTile, n);
            std::fill(ds + r * kTile + n, ds + r * kTile + nc, 0.0f);
          }
          // dQ += dS K / sqrt(D); dK += dS^T Q / sqrt(D)
          detail::sgemm(false, false, rows, D, nc, scale, ds, kTile, geo.k(b, g, j0), geo.ld_k, 1.0f, dq, geo.ld_q);
          detail::sgemm(true, false, nc, D, rows, scale, ds, kTile, geo.q(b, h, i0), geo.ld_q, 1.0f, dk, geo.ld_k);
        }
      }
  });
}

// FLOPs of the tiles actually computed: forward q k^T and P V; backward q k^T again, dO V^T, P^T dO,
// dS K and dS^T Q.
OpFlops flops(const BlockSpec&, const OpNode& n) {
  const AttentionLayout& l = n.attn;
  int64_t area = 0;  // scores computed per (batch, head)
  for (int64_t qt = 0; qt < tiles(l.seq); ++qt) {
    const int64_t rows = std::min(kTile, l.seq - qt * kTile);
    for (int64_t kt = 0; kt < key_tiles(l, qt); ++kt) area += rows * std::min(kTile, l.seq - kt * kTile);
  }
  // In a ring of context-parallel ranks each one's queries meet `ring` times the keys (its share of
  // the whole causal square, when the sequence is split in balanced chunks).
  const int64_t gemm = 2 * l.batch * l.heads * area * l.head_dim * l.ring;
  return {2 * gemm, 5 * gemm};
}

// Ring attention (context parallelism): one key chunk and one value chunk (a rank's share) in use
// and the next pair arriving; the backward also sends the dK and dV of the chunk it is done with.
int64_t ring_chunk(const BlockSpec& b, const OpNode& n) {
  const AttentionLayout& l = n.attn;
  return n.attn.ring > 1 ? l.batch * l.seq * l.kv() * l.head_dim * dtype_size(b.dtype) : 0;
}

int64_t forward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig& ctx) {
  return ctx.blas * (forward_floats() * 4 + (n.p > 0 ? kTile * kTile : 0)) + 4 * ring_chunk(b, n);
}

int64_t backward_scratch(const BlockSpec& b, const OpNode& n, const ThreadConfig& ctx) {
  return ctx.blas * (backward_floats() * 4 + (n.p > 0 ? kTile * kTile : 0)) + 6 * ring_chunk(b, n);
}

// The ring: each rank sends its key and value chunks around (cp - 1 hops), and in the backward also
// their gradients.
OpComm comm(const BlockSpec& b, const OpNode& n) {
  const double hops = static_cast<double>(n.attn.ring - 1), kv = static_cast<double>(2 * ring_chunk(b, n));
  return {hops * kv, 2 * hops * kv};
}

// Grouped-query heads (4 query heads, 2 key/value heads of 8), causal, over three tiles of keys
// with a ragged last one: q, k and v in tensors of their own.
AttentionLayout example_layout() {
  AttentionLayout l;
  l.batch = 2, l.heads = 4, l.kv_heads = 2, l.head_dim = 8, l.seq = 300, l.block = 128, l.causal = true;
  return l;
}

BlockSpec example() {
  ModelConfig cfg;
  const AttentionLayout l = example_layout();
  detail::Builder b(cfg, "test.flash_attention");
  const int q = b.input("q", {2, 300, 4 * 8}, DType::F32, "q");
  const int k = b.input("k", {2, 300, 2 * 8}, DType::F32, "k");
  const int v = b.input("v", {2, 300, 2 * 8}, DType::F32, "v");
  const std::vector<int> out =
      b.op(OpKind::FlashAttention, "atty", {q, k, v}, {{"atty", {2, 300, 4 * 8}}, {"lse", {2, 4, 300}, DType::F32}});
  b.last().attn = l;
  return b.finish(out[0]);
}

// The same heads from one fused qkv projection.
BlockSpec fused_example() {
  ModelConfig cfg;
  AttentionLayout l = example_layout();
  l.q_col = 0, l.k_col = 4 * 8, l.v_col = (4 + 2) * 8;
  detail::Builder b(cfg, "test.flash_attention_fused");
  const int qkv = b.input("qkv", {2, 300, (4 + 2 + 2) * 8}, DType::F32, "q, k and v");
  const std::vector<int> out = b.op(OpKind::FlashAttention, "atty", {qkv, qkv, qkv},
                                    {{"atty", {2, 300, 4 * 8}}, {"lse", {2, 4, 300}, DType::F32}});
  b.last().attn = l;
  return b.finish(out[0]);
}

// Dense attention with a causal mask (no dropout in the example), and its log-sum-exp.
std::vector<at::Tensor> reference(const OpNode& n, const std::vector<at::Tensor>& in, const std::vector<at::Tensor>&) {
  const AttentionLayout& l = n.attn;
  const at::Tensor q = attention::heads_of(in[n.in[0]], l.q_col, l.heads, l);
  const at::Tensor k = attention::heads_of(in[n.in[1]], l.k_col, l.kv(), l).repeat_interleave(l.group(), 1);
  const at::Tensor v = attention::heads_of(in[n.in[2]], l.v_col, l.kv(), l).repeat_interleave(l.group(), 1);
  at::Tensor s = at::matmul(q, k.transpose(-1, -2)) * attention::scale(l);
  if (l.causal) s = s.masked_fill(at::ones({l.seq, l.seq}, at::kBool).triu(1), -INFINITY);
  const at::Tensor out = at::matmul(at::softmax(s, -1), v).permute({0, 2, 1, 3}).reshape({l.batch, l.seq, -1});
  return {out, at::logsumexp(s, -1)};
}

const detail::OpTestCase kTest{example, reference, /*index_range=*/0, /*float64=*/false, fused_example};

// Eager PyTorch's grouped-query attention (torchtitan's and Hugging Face's repeat_kv): keys and
// values are repeated to every query head before scaled_dot_product_attention, which saves the
// copies; this op reads the kv_heads ones in place.
int64_t eager_saved(const BlockSpec& b, const OpNode& n) {
  const AttentionLayout& a = n.attn;
  return 2 * a.batch * a.seq * (a.heads - a.kv()) * a.head_dim * dtype_size(b.dtype);
}

}  // namespace

extern const OpDef kFlashAttention = [] {
  OpDef d;
  d.name = "flash_attention";
  d.n_in = 3, d.n_out = 2;
  d.bwd_reads_in = 0b111;
  d.bwd_reads_out = 0b11;
  d.grad_in[0] = GradKind::Slot;
  d.grad_in[1] = GradKind::Slot;
  d.grad_in[2] = GradKind::Slot;
  d.flops = flops;
  d.forward_scratch = forward_scratch;
  d.backward_scratch = backward_scratch;
  d.comm = comm;
  d.forward = forward;
  d.backward = backward;
  d.eager_saved = eager_saved;
  d.eager_input = 1;  // the repeated copies live as long as the keys they copy
  d.eager_tensors = 2;
  d.test = &kTest;
  return d;
}();

}  // namespace remat::ops
