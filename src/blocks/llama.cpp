// llama: LLaMA's block (Touvron et al. 2023). Pre-RMSNorm; rotary position embeddings on q and k;
// grouped-query attention (ModelConfig.kv_heads); a SwiGLU MLP; no biases; an untied LM head.
//   stem   x = drop(wte[tokens])
//   block  x + drop(proj(attn(rope(qk(n1)), v(n1)))), n1 = rms1(x); then + drop(mlp(swiglu(gate_up(rms2(.)))))
//   head   cross_entropy(logits(rmsf(x)), targets)
// Parameters match the published counts (LLaMA-2 7B: 6,738,415,616; 70B: 68,976,648,192): q and k
// are one matrix, gate and up another, which changes no count. Tags give the presets their usual
// meaning: attn drops the T x T tensors, mlp-act the SwiGLU product (rerun from gate_up by one
// cheap pass), norm the RMSNorm outputs (their rstd stays).
#include "blocks/kinds.h"
#include "blocks/parts.h"
#include "remat/error.h"

namespace remat::blocks {
namespace {

int rms_norm(Builder& b, const std::string& name, int x, const std::string& doc) {
  std::vector<int64_t> stat = b.tensor(x).shape;
  stat.back() = 1;
  const int64_t width = b.tensor(x).shape.back();
  const int y = b.op(OpKind::RmsNorm, name, {x},
                     {{name, b.tensor(x).shape, b.cfg().dtype, tag::kNormOut, doc},
                      {name + "_rstd", stat, DType::F32, tag::kNormStat, "RMSNorm 1/rms per token"}},
                     {{name + ".weight", {width}, Init::Ones, 0.0, /*decay=*/false}})[0];
  b.last().eps = b.cfg().norm_eps;
  return y;
}

BlockSpec stem(const ModelConfig& c) {
  Builder b(c, "llama.stem");
  const int tokens = b.input("tokens", {c.batch, c.seq}, DType::I64, "token ids");
  const int x = b.op(OpKind::Embedding, "emb", {tokens}, {{"emb", b.res(c.dim), c.dtype, 0, "token embedding"}},
                     {{"wte", {c.rank_vocab(), c.dim}}})[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  return b.finish(dropout(b, "emb", x, 0, "embedding"));
}

BlockSpec block(const ModelConfig& c) {
  Builder b(c, "llama");
  const int64_t d = c.head_dim(), q_width = c.heads * d, kv_width = c.kv() * d;
  const int64_t q_rank = c.rank_heads() * d, kv_rank = c.rank_kv() * d;  // this tensor-parallel rank's columns
  const int x = b.input("x", b.res(c.dim), c.dtype, "block input (residual stream)");
  const int n1 = rms_norm(b, "rms1", x, "RMSNorm 1 output");
  const int qk = linear(b, "qk", n1, q_width + kv_width, 0, "q and k projections, before rotation", false, Init::Normal,
                        Split::Column);
  const int qk_rot = b.op(OpKind::Rope, "qk_rot", {qk}, {{"qk_rot", b.btc(q_rank + kv_rank), c.dtype, 0, "q and k, rotated"}})[0];
  b.last().theta = c.rope_theta;
  b.last().attn.head_dim = d;
  const int v = linear(b, "v", n1, kv_width, 0, "v projection", false, Init::Normal, Split::Column);
  const int atty = core_attention(b, qk_rot, v, attention_layout(c, /*causal=*/true, 0, q_rank, 0));
  int proj = linear(b, "proj", atty, c.dim, 0, "attention output projection", false, Init::ResidualNormal, Split::Row);
  proj = dropout(b, "proj", proj, 0, "attention projection");
  const int x2 = add(b, "x2", x, proj, "residual stream after attention");
  const int n2 = rms_norm(b, "rms2", x2, "RMSNorm 2 output");
  const int gate_up = linear(b, "gate_up", n2, 2 * c.hidden(), tag::kMlpInner, "MLP gate and up projections", false,
                             Init::Normal, Split::Column);
  const int act = b.op(OpKind::Swiglu, "act", {gate_up},
                       {{"act", b.btc(c.rank_hidden()), c.dtype, tag::kMlpAct | tag::kMlpInner, "SwiGLU output silu(gate) * up"}})[0];
  int mlp = linear(b, "mlp", act, c.dim, 0, "MLP down projection", false, Init::ResidualNormal, Split::Row);
  mlp = dropout(b, "mlp", mlp, tag::kMlpInner, "MLP output");
  return b.finish(add(b, "y", x2, mlp, "block output"));
}

BlockSpec head(const ModelConfig& c, bool loss) {
  Builder b(c, loss ? "llama.head" : "llama.logits");
  const int x = b.input("x", b.res(c.dim), c.dtype, "last block output");
  const int targets = loss ? b.input("targets", {c.batch, c.seq}, DType::I64, "next-token ids") : -1;
  const int nf = rms_norm(b, "rmsf", x, "final RMSNorm output");
  const int logits = linear(b, "logits", nf, c.vocab, 0, "LM head output", false, Init::Normal, Split::Column);
  if (!loss) return b.finish(logits);
  const int out = b.op(OpKind::CrossEntropy, "loss", {logits, targets},
                       {{"loss", {}, DType::F32, 0, "mean cross-entropy"},
                        {"logp", {c.batch, c.seq, c.rank_vocab()}, c.dtype, 0, "log-probabilities"}})[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  return b.finish(out);
}

void check(const ModelConfig& c) {
  if (c.head_dim() % 2 != 0)
    fail("ModelConfig.dim {} / ModelConfig.heads {} = {} is odd; rotary embeddings turn pairs of head dimensions",
         c.dim, c.heads, c.head_dim());
}

}  // namespace

extern const BlockKind kLlama{"llama", "LLaMA: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases",
                              stem, block, head, check, /*has_logits=*/true};

}  // namespace remat::blocks
