// The list of block kinds, and what depends only on it: validation and whole models.
#include "blocks/kinds.h"

#include "remat/error.h"

namespace remat::blocks {

extern const BlockKind kSeed, kGpt2, kLlama;

namespace {

// The block kinds, in the order --arch lists them.
const BlockKind* const kKinds[] = {&kSeed, &kGpt2, &kLlama};

std::string names() {
  std::string s;
  for (const BlockKind* k : kKinds) s += (s.empty() ? "" : ", ") + std::string(k->name);
  return s;
}

}  // namespace

const BlockKind& block_kind(std::string_view name) {
  for (const BlockKind* k : kKinds)
    if (name == k->name) return *k;
  fail("unknown ModelConfig.arch '{}'; allowed: {}", name, names());
}

}  // namespace remat::blocks

namespace remat {

std::vector<std::string> block_kinds() {
  std::vector<std::string> v;
  for (const blocks::BlockKind* k : blocks::kKinds) v.emplace_back(k->name);
  return v;
}

std::string block_kind_doc(std::string_view kind) { return blocks::block_kind(kind).doc; }

void validate(const ModelConfig& c) {
  const blocks::BlockKind& kind = blocks::block_kind(c.arch);
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) fail("ModelConfig.{} must be a positive integer, got {}", name, v);
  };
  positive("layers", c.layers);
  positive("dim", c.dim);
  positive("heads", c.heads);
  positive("batch", c.batch);
  positive("seq", c.seq);
  positive("vocab", c.vocab);
  positive("attn_block", c.attn_block);
  if (c.ffn < 0) fail("ModelConfig.ffn must be >= 0 (0 means 4 * dim), got {}", c.ffn);
  if (c.kv_heads < 0) fail("ModelConfig.kv_heads must be >= 0 (0 means heads), got {}", c.kv_heads);
  if (c.dim % c.heads != 0)
    fail("ModelConfig.dim {} is not divisible by ModelConfig.heads {}; pick heads that divide dim (e.g. {})", c.dim,
         c.heads, c.dim % 8 == 0 ? 8 : 1);
  if (c.heads % c.kv() != 0)
    fail("ModelConfig.heads {} is not divisible by ModelConfig.kv_heads {}; key/value heads must divide the heads",
         c.heads, c.kv());
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) fail("ModelConfig.dropout must be in [0, 1), got {}", c.dropout);
  if (c.dtype == DType::Bool || c.dtype == DType::I64)
    fail("ModelConfig.dtype {} is not a floating-point type; allowed: fp32, bf16, fp16", to_string(c.dtype));
  if (!(c.rope_theta > 0)) fail("ModelConfig.rope_theta must be > 0, got {}", c.rope_theta);
  if (!(c.norm_eps > 0 && c.norm_eps < 1)) fail("ModelConfig.norm_eps must be in (0, 1), got {}", c.norm_eps);
  if (c.tp < 1) fail("ModelConfig.tp must be a positive integer, got {}", c.tp);
  if (c.tp > 1) {
    if (c.heads % c.tp != 0 || c.kv() % c.tp != 0)
      fail("ModelConfig.tp {} must divide the attention heads ({}) and key/value heads ({}): each rank takes whole heads",
           c.tp, c.heads, c.kv());
    if (c.hidden() % c.tp != 0)
      fail("ModelConfig.tp {} must divide the MLP width ({}): the first MLP linear is split by columns", c.tp,
           c.hidden());
  }
  if (c.sp && c.tp == 1) fail("ModelConfig.sp (sequence parallelism) splits the sequence over tp ranks; set tp > 1");
  if (c.sp && c.seq % c.tp != 0)
    fail("ModelConfig.seq {} is not divisible by ModelConfig.tp {}; sequence parallelism gives each rank seq / tp tokens",
         c.seq, c.tp);
  if (kind.validate) kind.validate(c);
}

BlockSpec make_block(const ModelConfig& cfg) {
  validate(cfg);
  return blocks::block_kind(cfg.arch).block(cfg);
}

ModelSpec make_model(const ModelConfig& cfg) {
  validate(cfg);
  const blocks::BlockKind& kind = blocks::block_kind(cfg.arch);
  ModelSpec m;
  m.arch = cfg.arch;
  m.layers = cfg.layers;
  m.block = kind.block(cfg);
  m.has_stem = kind.stem != nullptr;
  if (m.has_stem) m.stem = kind.stem(cfg);
  m.head = kind.head(cfg, true);
  if (kind.has_logits) m.logits = kind.head(cfg, false);
  return m;
}

}  // namespace remat
