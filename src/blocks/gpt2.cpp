// gpt2: pre-LayerNorm blocks with causal multi-head attention and a GELU MLP, dropout optional.
//   stem   x = drop(wte[tokens] + wpe[0:T])
//   block  x + drop(proj(attn(ln1(x)))), then + drop(mlp(gelu(fc(ln2(.)))))
//   head   cross_entropy(lnf(x) wte^T, targets)       (the LM head is tied to wte)
#include "blocks/kinds.h"
#include "blocks/parts.h"
#include "remat/error.h"

namespace remat::blocks {
namespace {

BlockSpec stem(const ModelConfig& c) {
  Builder b(c, "gpt2.stem");
  const int tokens = b.input("tokens", {c.batch, c.seq}, DType::I64, "token ids");
  const int x = b.op(OpKind::Embedding, "emb", {tokens}, {{"emb", b.res(c.dim), c.dtype, 0, "token + position embedding"}},
                     {{"wte", {c.rank_vocab(), c.dim}}, {"wpe", {c.seq, c.dim}, Init::Normal, 0.02, /*decay=*/false}})[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  return b.finish(dropout(b, "emb", x, 0, "embedding"));
}

BlockSpec block(const ModelConfig& c) {
  Builder b(c, "gpt2");
  const int64_t w = c.rank_heads() * c.head_dim();  // q, k and v columns on this tensor-parallel rank
  const int x = b.input("x", b.res(c.dim), c.dtype, "block input (residual stream)");
  const int ln1 = layer_norm(b, "ln1", x, "LayerNorm 1 output");
  const int qkv = linear(b, "qkv", ln1, 3 * c.dim, 0, "q, k, v projections", true, Init::Normal, Split::Column);
  const int atty = core_attention(b, qkv, qkv, attention_layout(c, /*causal=*/true, 0, w, 2 * w));
  int proj = linear(b, "proj", atty, c.dim, 0, "attention output projection", true, Init::ResidualNormal, Split::Row);
  proj = dropout(b, "proj", proj, 0, "attention projection");
  const int x2 = add(b, "x2", x, proj, "residual stream after attention");
  const int ln2 = layer_norm(b, "ln2", x2, "LayerNorm 2 output");
  const int fc = linear(b, "fc", ln2, c.hidden(), tag::kMlpInner, "MLP first linear (GELU input)", true, Init::Normal,
                        Split::Column);
  const int act = unary(b, OpKind::Gelu, "act", fc, tag::kMlpAct | tag::kMlpInner, "MLP activation (GELU output)");
  int mlp = linear(b, "mlp", act, c.dim, 0, "MLP second linear", true, Init::ResidualNormal, Split::Row);
  mlp = dropout(b, "mlp", mlp, tag::kMlpInner, "MLP output");
  return b.finish(add(b, "y", x2, mlp, "block output"));
}

BlockSpec head(const ModelConfig& c, bool loss) {
  Builder b(c, loss ? "gpt2.head" : "gpt2.logits");
  const int x = b.input("x", b.res(c.dim), c.dtype, "last block output");
  const int targets = loss ? b.input("targets", {c.batch, c.seq}, DType::I64, "next-token ids") : -1;
  const int lnf = layer_norm(b, "lnf", x, "final LayerNorm output");
  const int logits = tied_linear(b, "logits", lnf, c.vocab, "wte", "LM head output");
  if (!loss) return b.finish(logits);
  const int out = b.op(OpKind::CrossEntropy, "loss", {logits, targets},
                       {{"loss", {}, DType::F32, 0, "mean cross-entropy"},
                        {"logp", {c.batch, c.seq, c.rank_vocab()}, c.dtype, 0, "log-probabilities"}})[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  return b.finish(out);
}

void check(const ModelConfig& c) {
  if (c.kv() != c.heads)
    fail("ModelConfig.kv_heads {} is for grouped-query attention, which gpt2 blocks do not have; use arch llama",
         c.kv_heads);
}

}  // namespace

extern const BlockKind kGpt2{"gpt2", "GPT-2: pre-LayerNorm, causal attention, GELU MLP, tied LM head, dropout",
                             stem, block, head, check, /*has_logits=*/true};

}  // namespace remat::blocks
