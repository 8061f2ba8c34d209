// seed: the seed experiment's block. x + attn(x), then + ffn(.) with a Linear/ReLU/Linear FFN; no norm,
// no mask, no dropout. The data (B, T, C) floats is the first block's input; the loss is MSE to a
// target of the same shape, as the experiment trains it.
#include <initializer_list>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "blocks/kinds.h"
#include "blocks/parts.h"
#include "remat/error.h"

namespace remat::blocks {
namespace {

BlockSpec block(const ModelConfig& c) {
  Builder b(c, "seed");
  const int x = b.input("x", b.btc(c.dim), c.dtype, "block input (residual stream)");
  const int qkv = linear(b, "qkv", x, 3 * c.dim, 0, "q, k, v projections");
  const int atty = core_attention(b, qkv, qkv, qkv, attention_layout(c, /*causal=*/false, 0, c.dim, 2 * c.dim));
  const int proj = linear(b, "proj", atty, c.dim, 0, "attention output projection", true, Init::ResidualNormal);
  const int x2 = add(b, "x2", x, proj, "residual stream after attention");
  const int fc = linear(b, "fc", x2, c.hidden(), tag::kMlpInner, "FFN first linear");
  const int act = unary(b, OpKind::Relu, "act", fc, tag::kMlpAct | tag::kMlpInner, "FFN activation (ReLU)");
  const int mlp = linear(b, "mlp", act, c.dim, 0, "FFN second linear", true, Init::ResidualNormal);
  return b.finish(add(b, "y", x2, mlp, "block output"));
}

BlockSpec head(const ModelConfig& c, bool) {
  Builder b(c, "seed.head");
  const int y = b.input("y", b.btc(c.dim), c.dtype, "last block output");
  const int target = b.input("target", b.btc(c.dim), c.dtype, "regression target");
  return b.finish(b.op(OpKind::MseLoss, "loss", {y, target}, {{"loss", {}, DType::F32, 0, "mean squared error"}})[0]);
}

void check(const ModelConfig& c) {
  if (c.dropout > 0.0)
    fail(
        "ModelConfig.dropout {} is not available for arch seed (the seed block has no dropout); use arch gpt2 or llama",
        c.dropout);
  if (c.kv() != c.heads)
    fail("ModelConfig.kv_heads {} is for grouped-query attention, which seed blocks do not have; use arch llama",
         c.kv_heads);
  if (c.tp > 1) fail("ModelConfig.tp {}: seed blocks have no tensor-parallel split; use arch gpt2 or llama", c.tp);
  // Each decoder choice the config sets: a field the CLI shows as its flag, or (only a
  // --model-config or --model sets them) a feature by name.
  std::string set;
  for (const auto& [given, what] :
       std::initializer_list<std::pair<bool, const char*>>{{c.norm != Norm::Default, "ModelConfig.norm"},
                                                           {c.positions != Positions::Default, "ModelConfig.positions"},
                                                           {c.mlp != Mlp::Default, "ModelConfig.mlp"},
                                                           {c.bias != Switch::Default, "ModelConfig.bias"},
                                                           {c.qkv_bias, "ModelConfig.qkv_bias"},
                                                           {c.tied != Switch::Default, "ModelConfig.tied"},
                                                           {c.fused_qkv != Switch::Default, "ModelConfig.fused_qkv"},
                                                           {c.loss != Loss::Default, "ModelConfig.loss"},
                                                           {c.head_size > 0, "ModelConfig.head_size"},
                                                           {c.rotary_fraction != 1.0, "partial rotary"},
                                                           {c.parallel_residual, "a parallel residual"},
                                                           {c.qk_norm, "q/k norms"}})
    if (given) set += fmt::format("{}{}", set.empty() ? "" : ", ", what);
  if (!set.empty())
    fail("the seed block takes no decoder choice (those are for gpt2 and llama); this model sets {}", set);
}

}  // namespace

extern const BlockKind kSeed{"seed",
                             "the seed experiment's block: attention + Linear/ReLU/Linear FFN, residuals, no norm",
                             nullptr,
                             block,
                             head,
                             check,
                             /*resolve_choices=*/nullptr,
                             /*has_logits=*/false,
                             /*routes=*/false,
                             /*causal=*/false};

}  // namespace remat::blocks
