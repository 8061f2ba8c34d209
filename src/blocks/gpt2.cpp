// gpt2: GPT-2 (Radford et al. 2019) as its defaults: pre-LayerNorm blocks with causal multi-head
// attention from one qkv projection, a GELU MLP, learned positions, biases everywhere, dropout
// optional, and the LM head tied to the token embedding. Megatron-LM's GPT is this block; its
// options (rotary positions, SwiGLU, RMSNorm, no biases, an untied head, grouped-query attention)
// are ModelConfig's (blocks/decoder.h).
//   stem   x = drop(wte[tokens] + wpe[0:T])
//   block  x + drop(proj(attn(ln1(x)))), then + drop(mlp(gelu(fc(ln2(.)))))
//   head   cross_entropy(lnf(x) wte^T, targets)
#include "blocks/decoder.h"
#include "blocks/kinds.h"

namespace remat::blocks {
namespace {

const DecoderStyle kGpt2Style{/*rms_norm=*/false, Positions::Learned, /*swiglu=*/false,  /*bias=*/true,
                              /*qkv_bias=*/false, /*tied=*/true,      /*fused_qkv=*/true};

DecoderStyle style(const ModelConfig& c) { return resolve_style(c, kGpt2Style); }
void choices(ModelConfig& c) { set_choices(c, kGpt2Style); }
BlockSpec stem(const ModelConfig& c) { return decoder_stem(c, style(c), "gpt2"); }
BlockSpec block(const ModelConfig& c) { return decoder_block(c, style(c), "gpt2"); }
BlockSpec head(const ModelConfig& c, bool loss) { return decoder_head(c, style(c), "gpt2", loss); }
void check(const ModelConfig& c) { check_decoder(c, style(c)); }

}  // namespace

extern const BlockKind kGpt2{"gpt2",
                             "GPT-2: pre-LayerNorm, causal attention, GELU MLP, tied LM head, dropout",
                             stem,
                             block,
                             head,
                             check,
                             choices,
                             /*has_logits=*/true};

}  // namespace remat::blocks
