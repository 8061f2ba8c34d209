#include "blocks/parts.h"

namespace remat::blocks {

namespace {

// The output shape of a linear with `out` features in all, split as `split` says.
std::vector<int64_t> linear_shape(const Builder& b, int x, int64_t out, Split split) {
  const ModelConfig& c = b.cfg();
  if (split == Split::Column) return b.btc((out + c.tp - 1) / c.tp);
  if (split == Split::Row) return b.res(out);
  std::vector<int64_t> shape = b.tensor(x).shape;
  shape.back() = out;
  return shape;
}

}  // namespace

int linear(Builder& b, const std::string& name, int x, int64_t out, uint32_t tags, const std::string& doc, bool bias,
           Init init, Split split) {
  const int64_t in = b.tensor(x).shape.back();
  const std::vector<int64_t> shape = linear_shape(b, x, out, split);
  const int64_t n = shape.back();
  std::vector<ParamSpec> params = {{name + ".weight", {n, in}, init}};
  if (bias) params.push_back({name + ".bias", {n}, Init::Zeros, 0.0, /*decay=*/false});
  const int y = b.op(OpKind::Linear, name, {x}, {{name, shape, b.cfg().dtype, tags, doc}}, std::move(params))[0];
  b.last().tp = {split, b.cfg().tp, b.cfg().sp};
  return y;
}

int tied_linear(Builder& b, const std::string& name, int x, int64_t out, const std::string& tied_to,
                const std::string& doc) {
  const int64_t in = b.tensor(x).shape.back();
  const std::vector<int64_t> shape = linear_shape(b, x, out, Split::Column);
  ParamSpec w{name + ".weight", {shape.back(), in}};
  w.tied_to = tied_to;
  const int y = b.op(OpKind::Linear, name, {x}, {{name, shape, b.cfg().dtype, 0, doc}}, {w})[0];
  b.last().tp = {Split::Column, b.cfg().tp, b.cfg().sp};
  return y;
}

int layer_norm(Builder& b, const std::string& name, int x, const std::string& doc) {
  const ModelConfig& c = b.cfg();
  std::vector<int64_t> stat = b.tensor(x).shape;
  stat.back() = 1;
  const int64_t width = b.tensor(x).shape.back();
  const int y = b.op(
      OpKind::LayerNorm, name, {x},
      {{name, b.tensor(x).shape, c.dtype, tag::kNormOut, doc},
       {name + "_mean", stat, DType::F32, tag::kNormStat, "LayerNorm mean per token"},
       {name + "_rstd", stat, DType::F32, tag::kNormStat, "LayerNorm 1/std per token"}},
      {{name + ".weight", {width}, Init::Ones, 0.0, false}, {name + ".bias", {width}, Init::Zeros, 0.0, false}})[0];
  b.last().eps = c.norm_eps;
  return y;
}

int rms_norm(Builder& b, const std::string& name, int x, const std::string& doc, int64_t group) {
  std::vector<int64_t> stat = b.tensor(x).shape;
  const int64_t width = group > 0 ? group : b.tensor(x).shape.back();
  stat.back() /= width;
  const int y = b.op(OpKind::RmsNorm, name, {x},
                     {{name, b.tensor(x).shape, b.cfg().dtype, tag::kNormOut, doc},
                      {name + "_rstd", stat, DType::F32, tag::kNormStat,
                       group > 0 ? "RMSNorm 1/rms per token and head" : "RMSNorm 1/rms per token"}},
                     {{name + ".weight", {width}, Init::Ones, 0.0, /*decay=*/false}})[0];
  b.last().eps = b.cfg().norm_eps;
  return y;
}

int unary(Builder& b, OpKind kind, const std::string& name, int x, uint32_t tags, const std::string& doc) {
  return b.op(kind, name, {x}, {{name, b.tensor(x).shape, b.cfg().dtype, tags, doc}})[0];
}

int dropout(Builder& b, const std::string& name, int x, uint32_t tags, const std::string& what) {
  const ModelConfig& c = b.cfg();
  if (c.dropout <= 0.0) return x;
  const std::vector<int64_t> shape = b.tensor(x).shape;
  const int mask = b.op(OpKind::DropoutMask, name + "_mask", {},
                        {{name + "_mask", shape, DType::Bool, tags | tag::kMask, "dropout keep-mask of " + what}})[0];
  b.last().p = c.dropout;
  const int y = b.op(OpKind::Dropout, name + "_drop", {x, mask},
                     {{name + "_drop", shape, c.dtype, tags, what + " after dropout"}})[0];
  b.last().p = c.dropout;
  return y;
}

int add(Builder& b, const std::string& name, int x, int y, const std::string& doc) {
  return b.op(OpKind::Add, name, {x, y}, {{name, b.tensor(x).shape, b.cfg().dtype, 0, doc}})[0];
}

AttentionLayout attention_layout(const ModelConfig& cfg, bool causal, int64_t q_col, int64_t k_col, int64_t v_col) {
  AttentionLayout l;
  l.batch = cfg.batch;
  l.heads = cfg.rank_heads();
  l.kv_heads = cfg.rank_kv();
  l.head_dim = cfg.head_dim();
  l.seq = cfg.local_seq();
  l.ring = cfg.cp;
  l.causal = causal;
  l.block = causal ? std::min(cfg.attn_block, l.seq) : l.seq;
  l.q_col = q_col;
  l.k_col = k_col;
  l.v_col = v_col;
  return l;
}

int core_attention(Builder& b, int q, int k, int v, const AttentionLayout& layout) {
  const ModelConfig& c = b.cfg();
  const std::vector<int64_t> btc = b.btc(c.rank_heads() * c.head_dim());
  if (c.attention == AttentionImpl::Flash) {
    // One fused op: no T x T tensor is stored; the backward reruns the scores from q, k and the
    // per-row log-sum-exp. Attention dropout happens inside, replayed from a seed: no mask. The
    // layout (math attention's) addresses the mask, so both draw the same one.
    const int atty =
        b.op(OpKind::FlashAttention, "atty", {q, k, v},
             {{"atty", btc, c.dtype, 0, "attention output, heads merged"},
              {"lse", {c.batch, c.rank_heads(), c.local_seq()}, DType::F32, 0, "softmax log-sum-exp per row"}})[0];
    b.last().attn = layout;
    b.last().p = c.dropout;
    return atty;
  }
  const int scores = b.op(OpKind::Scores, "scores", {q, k},
                          {{"scores", layout.shape(), c.dtype, tag::kAttnCore, "attention scores q k^T / sqrt(D)"}})[0];
  b.last().attn = layout;
  int probs = unary(b, OpKind::Softmax, "probs", scores, tag::kAttnCore, "attention probabilities");
  b.last().attn = layout;
  probs = dropout(b, "probs", probs, tag::kAttnCore, "attention probabilities");
  const int atty =
      b.op(OpKind::AttnValues, "atty", {probs, v}, {{"atty", btc, c.dtype, 0, "attention output, heads merged"}})[0];
  b.last().attn = layout;
  return atty;
}

}  // namespace remat::blocks
