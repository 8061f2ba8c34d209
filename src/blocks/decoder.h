// The decoder both token kinds build (internal). gpt2 and llama differ only in their defaults; a
// ModelConfig may change any choice (blocks/kinds.h), so one builder makes GPT-2, LLaMA and what
// people train between them (Megatron-LM's GPT with rotary positions and SwiGLU, Mistral, Qwen2
// with biased q/k/v, GPT-NeoX-like untied LayerNorm models).
//
//   stem   x = drop(wte[tokens] (+ wpe[0:T]))
//   block  x + drop(proj(attn(q, k, v))), q k v = linear(norm1(x)) (fused or three; rotated with rope)
//          then + drop(mlp(act(...))), act = gelu(fc(norm2(.))) or silu(gate(.)) * up(.)
//   head   cross_entropy(normf(x) W^T, targets), W = wte when tied
//
// Names follow the choices: the norms are ln1/ln2/lnf (LayerNorm) or rms1/rms2/rmsf (RMSNorm); the
// projections qkv (fused) or q, k, v, rotated into qk_rot or q_rot, k_rot; the MLP's fc or gate
// and up, act and mlp.
#pragma once

#include "core/builder.h"
#include "remat/block.h"
#include "remat/config.h"

namespace remat::blocks {

// Every choice of a decoder, resolved.
struct DecoderStyle {
  bool rms_norm = false;                     // RMSNorm, else LayerNorm
  Positions positions = Positions::Learned;  // Learned, Rope or None (never Default)
  bool swiglu = false;                       // SwiGLU MLP (gate, up), else GELU (fc)
  bool bias = true;                          // biases on every linear
  bool qkv_bias = false;                     // biases on q, k and v
  bool tied = true;                          // the LM head is wte
  bool fused_qkv = true;                     // one qkv linear
};

// `kind`'s defaults with what `cfg` sets over them.
DecoderStyle resolve_style(const ModelConfig& cfg, const DecoderStyle& kind);
// Sets each choice cfg leaves Default to `kind`'s, so that cfg names the decoder it builds.
void set_choices(ModelConfig& cfg, const DecoderStyle& kind);

// The stem, the block and the head of a decoder in `style`; `name` is the kind's ("gpt2"), the
// stages are named name, name.stem, name.head and name.logits (the head without its loss).
BlockSpec decoder_stem(const ModelConfig& c, const DecoderStyle& style, const std::string& name);
BlockSpec decoder_block(const ModelConfig& c, const DecoderStyle& style, const std::string& name);
BlockSpec decoder_head(const ModelConfig& c, const DecoderStyle& style, const std::string& name, bool loss);

// The attention half of a decoder block on the residual stream `x`: the first norm, q, k and v,
// attention, the output projection and its dropout, added to x. Returns that sum (x2).
int decoder_attention(detail::Builder& b, const DecoderStyle& style, int x);
// The second norm, of x2 (or of x under a parallel residual).
int decoder_norm2(detail::Builder& b, const DecoderStyle& style, int x, int x2);

// An MLP of n2 in `style` up to its activation: GELU of fc, or silu(gate) * up, `width` features in
// all, split by columns over tp. Names take `prefix` ("", "shared_"), docs `what` ("MLP"); every
// tensor gets `tags`, the activation `act_tags` as well. Returns the activation.
int decoder_mlp_activation(detail::Builder& b, const DecoderStyle& style, int n2, const std::string& prefix,
                           const std::string& what, int64_t width, uint32_t tags, uint32_t act_tags);

// What a decoder in `style` supports beyond validate()'s checks: rotary positions turn pairs of
// head dimensions. Throws remat::Error.
void check_decoder(const ModelConfig& c, const DecoderStyle& style);

}  // namespace remat::blocks
