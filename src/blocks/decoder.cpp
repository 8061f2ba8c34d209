#include "blocks/decoder.h"

#include "blocks/parts.h"
#include "remat/error.h"

namespace remat::blocks {

namespace {

bool on(Switch s, bool kind) { return s == Switch::Default ? kind : s == Switch::On; }

// The dimensions of a head rope turns: its first rotary_fraction, an even count.
int64_t rotary_dims(const ModelConfig& c) {
  return static_cast<int64_t>(static_cast<double>(c.head_dim()) * c.rotary_fraction) / 2 * 2;
}

int norm(Builder& b, const DecoderStyle& s, const std::string& which, int x, const std::string& doc) {
  return s.rms_norm ? rms_norm(b, "rms" + which, x, "RMSNorm " + doc)
                    : layer_norm(b, "ln" + which, x, "LayerNorm " + doc);
}

// A rotary embedding of `x`'s columns [col, col + width) (all of them when width is 0).
int rope(Builder& b, const std::string& name, int x, int64_t col, int64_t width, const std::string& doc) {
  const ModelConfig& c = b.cfg();
  const int64_t w = width > 0 ? width : b.tensor(x).shape.back();
  const int y = b.op(OpKind::Rope, name, {x}, {{name, b.btc(w), c.dtype, 0, doc}})[0];
  b.last().theta = c.rope_theta;
  b.last().attn.head_dim = c.head_dim();
  b.last().rotary_dims = rotary_dims(c);
  b.last().in_col = width > 0 ? col : 0;
  b.last().in_width = width;
  return y;
}

// q, k, v (projected, rotated) and the attention output.
int attention(Builder& b, const DecoderStyle& s, int n1) {
  const ModelConfig& c = b.cfg();
  const int64_t d = c.head_dim(), q_all = c.heads * d, kv_all = c.kv() * d;
  const int64_t q_rank = c.rank_heads() * d, kv_rank = c.rank_kv() * d;  // this tensor-parallel rank's columns
  const bool bias = s.bias || s.qkv_bias;
  const bool rope_on = s.positions == Positions::Rope;
  if (s.fused_qkv) {
    const int qkv =
        linear(b, "qkv", n1, q_all + 2 * kv_all, 0, "q, k, v projections", bias, Init::Normal, Split::Column);
    if (!rope_on)
      return core_attention(b, qkv, qkv, qkv, attention_layout(c, /*causal=*/true, 0, q_rank, q_rank + kv_rank));
    // Rotated q and k are new tensors; v stays in the projection, which it keeps alive.
    const int qk = rope(b, "qk_rot", qkv, 0, q_rank + kv_rank, "q and k, rotated");
    return core_attention(b, qk, qk, qkv, attention_layout(c, /*causal=*/true, 0, q_rank, q_rank + kv_rank));
  }
  int q = linear(b, "q", n1, q_all, 0, "q projection", bias, Init::Normal, Split::Column);
  int k = linear(b, "k", n1, kv_all, 0, "k projection", bias, Init::Normal, Split::Column);
  const int v = linear(b, "v", n1, kv_all, 0, "v projection", bias, Init::Normal, Split::Column);
  if (c.qk_norm) {  // Qwen3: each head of q and k normalised, one weight per head dimension
    q = rms_norm(b, "q_norm", q, "RMSNorm of q's heads", d);
    k = rms_norm(b, "k_norm", k, "RMSNorm of k's heads", d);
  }
  if (rope_on) {
    q = rope(b, "q_rot", q, 0, 0, "q, rotated");
    k = rope(b, "k_rot", k, 0, 0, "k, rotated");
  }
  return core_attention(b, q, k, v, attention_layout(c, /*causal=*/true, 0, 0, 0));
}

}  // namespace

int decoder_mlp_activation(Builder& b, const DecoderStyle& s, int n2, const std::string& prefix,
                           const std::string& what, int64_t width, uint32_t tags, uint32_t act_tags) {
  const ModelConfig& c = b.cfg();
  if (!s.swiglu) {
    const int fc = linear(b, prefix + "fc", n2, width, tags, what + " first linear (GELU input)", s.bias, Init::Normal,
                          Split::Column);
    return unary(b, OpKind::Gelu, prefix + "act", fc, tags | act_tags, what + " activation (GELU output)");
  }
  const int gate =
      linear(b, prefix + "gate", n2, width, tags, what + " gate projection", s.bias, Init::Normal, Split::Column);
  const int up =
      linear(b, prefix + "up", n2, width, tags, what + " up projection", s.bias, Init::Normal, Split::Column);
  return b.op(
      OpKind::Swiglu, prefix + "act", {gate, up},
      {{prefix + "act", b.btc(width / c.tp), c.dtype, tags | act_tags, what + " SwiGLU output silu(gate) * up"}})[0];
}

DecoderStyle resolve_style(const ModelConfig& c, const DecoderStyle& kind) {
  DecoderStyle s = kind;
  if (c.norm != Norm::Default) s.rms_norm = c.norm == Norm::Rms;
  if (c.positions != Positions::Default) s.positions = c.positions;
  if (c.mlp != Mlp::Default) s.swiglu = c.mlp == Mlp::Swiglu;
  s.bias = on(c.bias, kind.bias);
  s.qkv_bias = c.qkv_bias;
  s.tied = on(c.tied, kind.tied);
  s.fused_qkv = on(c.fused_qkv, kind.fused_qkv);
  return s;
}

void set_choices(ModelConfig& c, const DecoderStyle& kind) {
  const DecoderStyle s = resolve_style(c, kind);
  c.norm = s.rms_norm ? Norm::Rms : Norm::Layer;
  c.positions = s.positions;
  c.mlp = s.swiglu ? Mlp::Swiglu : Mlp::Gelu;
  c.bias = s.bias ? Switch::On : Switch::Off;
  c.tied = s.tied ? Switch::On : Switch::Off;
  c.fused_qkv = s.fused_qkv ? Switch::On : Switch::Off;
}

void check_decoder(const ModelConfig& c, const DecoderStyle& s) {
  if (s.positions == Positions::Rope && c.head_dim() % 2 != 0) {
    if (c.head_size > 0)
      fail("ModelConfig.head_size {} is odd; rotary embeddings turn pairs of head dimensions", c.head_size);
    fail("ModelConfig.dim {} / ModelConfig.heads {} = {} is odd; rotary embeddings turn pairs of head dimensions",
         c.dim, c.heads, c.head_dim());
  }
  if (!(c.rotary_fraction > 0 && c.rotary_fraction <= 1))
    fail("ModelConfig.rotary_fraction must be in (0, 1], got {}", c.rotary_fraction);
  if (s.positions == Positions::Rope && rotary_dims(c) == 0)
    fail("ModelConfig.rotary_fraction {} turns no pair of the head's {} dimensions", c.rotary_fraction, c.head_dim());
  if (c.qk_norm && s.fused_qkv)
    fail(
        "ModelConfig.qk_norm normalises q's and k's heads as separate projections; give fused_qkv off (--qkv "
        "separate)");
  if (c.rotary_fraction != 1.0 && s.positions != Positions::Rope)
    fail("ModelConfig.rotary_fraction {} is for rotary positions; this block has positions {}", c.rotary_fraction,
         to_string(s.positions));
}

BlockSpec decoder_stem(const ModelConfig& c, const DecoderStyle& s, const std::string& name) {
  Builder b(c, name + ".stem");
  const int tokens = b.input("tokens", {c.batch, c.local_seq()}, DType::I64, "token ids");
  std::vector<ParamSpec> params = {{"wte", {c.rank_vocab(), c.dim}}};
  if (s.positions == Positions::Learned) params.push_back({"wpe", {c.seq, c.dim}, Init::Normal, 0.02, /*decay=*/false});
  const int x = b.op(OpKind::Embedding, "emb", {tokens},
                     {{"emb", b.res(c.dim), c.dtype, 0,
                       s.positions == Positions::Learned ? "token + position embedding" : "token embedding"}},
                     std::move(params))[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  return b.finish(dropout(b, "emb", x, 0, "embedding"));
}

int decoder_attention(Builder& b, const DecoderStyle& s, int x) {
  const ModelConfig& c = b.cfg();
  const int n1 = norm(b, s, "1", x, "1 output");
  const int atty = attention(b, s, n1);
  int proj = linear(b, "proj", atty, c.dim, 0, "attention output projection", s.bias, Init::ResidualNormal, Split::Row);
  proj = dropout(b, "proj", proj, 0, "attention projection");
  return add(b, "x2", x, proj, "residual stream after attention");
}

int decoder_norm2(Builder& b, const DecoderStyle& s, int x, int x2) {
  // GPT-NeoX's parallel residual: the MLP reads the block input; the stream adds both branches.
  return norm(b, s, "2", b.cfg().parallel_residual ? x : x2, "2 output");
}

BlockSpec decoder_block(const ModelConfig& c, const DecoderStyle& s, const std::string& name) {
  Builder b(c, name);
  const int x = b.input("x", b.res(c.dim), c.dtype, "block input (residual stream)");
  const int x2 = decoder_attention(b, s, x);
  const int n2 = decoder_norm2(b, s, x, x2);
  const int act = decoder_mlp_activation(b, s, n2, "", "MLP", c.hidden(), tag::kMlpInner, tag::kMlpAct);
  int mlp = linear(b, "mlp", act, c.dim, 0, s.swiglu ? "MLP down projection" : "MLP second linear", s.bias,
                   Init::ResidualNormal, Split::Row);
  mlp = dropout(b, "mlp", mlp, tag::kMlpInner, "MLP output");
  return b.finish(add(b, "y", x2, mlp, "block output"));
}

BlockSpec decoder_head(const ModelConfig& c, const DecoderStyle& s, const std::string& name, bool loss) {
  Builder b(c, name + (loss ? ".head" : ".logits"));
  const int x = b.input("x", b.res(c.dim), c.dtype, "last block output");
  const int targets = loss ? b.input("targets", {c.batch, c.local_seq()}, DType::I64, "next-token ids") : -1;
  const int nf = norm(b, s, "f", x, "final output");
  const Loss kind = resolved_loss(c);
  if (loss && kind == Loss::Chunked) {
    // The LM head and the loss in one op, a chunk of tokens at a time: no logits tensor.
    ParamSpec w{"logits.weight", {c.rank_vocab(), c.dim}};
    if (s.tied) w.tied_to = "wte";
    const int out = b.op(OpKind::ChunkedCrossEntropy, "loss", {nf, targets},
                         {{"loss", {}, DType::F32, 0, "mean cross-entropy"},
                          {"lse", {c.batch, c.local_seq()}, DType::F32, 0, "log-sum-exp of each token's logits"}},
                         {w})[0];
    b.last().tp = {Split::Vocab, c.tp, c.sp};
    b.last().chunks = c.loss_chunks;
    return b.finish(out);
  }
  const int logits = s.tied ? tied_linear(b, "logits", nf, c.vocab, "wte", "LM head output")
                            : linear(b, "logits", nf, c.vocab, 0, "LM head output", false, Init::Normal, Split::Column);
  if (!loss) return b.finish(logits);
  // Frameworks up-cast bf16/fp16 logits before the softmax: the log-probabilities kept for the
  // backward are fp32 unless the loss runs in the model's dtype.
  const DType logp = kind == Loss::Model ? c.dtype : DType::F32;
  const int out = b.op(OpKind::CrossEntropy, "loss", {logits, targets},
                       {{"loss", {}, DType::F32, 0, "mean cross-entropy"},
                        {"logp", {c.batch, c.local_seq(), c.rank_vocab()}, logp, 0, "log-probabilities"}})[0];
  b.last().tp = {Split::Vocab, c.tp, c.sp};
  b.last().upcast = kind == Loss::Upcast;
  b.last().compiled = kind == Loss::Fused;
  return b.finish(out);
}

}  // namespace remat::blocks
