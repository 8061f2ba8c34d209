// llama: LLaMA (Touvron et al. 2023) as its defaults: pre-RMSNorm; q, k and v from three linears,
// q and k turned by rotary position embeddings; grouped-query attention (ModelConfig.kv_heads); a
// SwiGLU MLP with separate gate and up projections; no biases; an untied LM head. Parameters match
// the published counts (LLaMA-2 7B: 6,738,415,616; 70B: 68,976,648,192). Tags give the presets their
// usual meaning: attn drops the T x T tensors, mlp-act the SwiGLU product (rerun from gate and up by
// one cheap pass), norm the RMSNorm outputs (their rstd stays). Mistral, Qwen2 (ModelConfig.qkv_bias)
// and Megatron-LM's fused projections (ModelConfig.fused_qkv) are its options (blocks/decoder.h).
//   stem   x = drop(wte[tokens])
//   block  x + drop(proj(attn(rope(q(n1)), rope(k(n1)), v(n1)))), n1 = rms1(x);
//          then + drop(mlp(silu(gate(n2)) * up(n2))), n2 = rms2(.)
//   head   cross_entropy(logits(rmsf(x)), targets)
#include "blocks/decoder.h"
#include "blocks/kinds.h"

namespace remat::blocks {
namespace {

const DecoderStyle kLlamaStyle{/*rms_norm=*/true,  Positions::Rope, /*swiglu=*/true,    /*bias=*/false,
                               /*qkv_bias=*/false, /*tied=*/false,  /*fused_qkv=*/false};

DecoderStyle style(const ModelConfig& c) { return resolve_style(c, kLlamaStyle); }
void choices(ModelConfig& c) { set_choices(c, kLlamaStyle); }
BlockSpec stem(const ModelConfig& c) { return decoder_stem(c, style(c), "llama"); }
BlockSpec block(const ModelConfig& c) { return decoder_block(c, style(c), "llama"); }
BlockSpec head(const ModelConfig& c, bool loss) { return decoder_head(c, style(c), "llama", loss); }
void check(const ModelConfig& c) { check_decoder(c, style(c)); }

}  // namespace

extern const BlockKind kLlama{"llama",
                              "LLaMA: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, no biases",
                              stem,
                              block,
                              head,
                              check,
                              choices,
                              /*has_logits=*/true};

}  // namespace remat::blocks
