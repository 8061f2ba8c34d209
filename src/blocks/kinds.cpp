// The list of block kinds, and what depends only on it: validation and whole models.
#include "blocks/kinds.h"

#include <algorithm>
#include <cmath>

#include "remat/error.h"

namespace remat::blocks {

extern const BlockKind kSeed, kGpt2, kLlama, kMoe;

namespace {

// The block kinds, in the order --arch lists them.
const BlockKind* const kKinds[] = {&kSeed, &kGpt2, &kLlama, &kMoe};

// The kinds' names, those with `causal` set only when `causal_only`.
std::string names(bool causal_only = false) {
  std::string s;
  for (const BlockKind* k : kKinds)
    if (k->causal || !causal_only) s += (s.empty() ? "" : ", ") + std::string(k->name);
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

ModelConfig with_choices_resolved(const ModelConfig& cfg) {
  ModelConfig c = cfg;
  if (const auto resolve = blocks::block_kind(c.arch).resolve_choices) {
    resolve(c);
    c.loss = resolved_loss(c);
  }
  return c;
}

bool routes_experts(std::string_view kind) { return blocks::block_kind(kind).routes; }

bool attends_causally(std::string_view kind) { return blocks::block_kind(kind).causal; }

namespace {

// Every size positive and below a bound far past any model trained, so that every size and
// product of sizes fits int64 (overflow corrupted plans and the heap) and a plan answers in bounded time.
void validate_sizes(const ModelConfig& c) {
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
  auto at_most = [](const char* name, int64_t v, int64_t limit, const char* why) {
    if (v > limit) fail("ModelConfig.{} {} is over the limit {} ({})", name, v, limit, why);
  };
  constexpr int64_t k16M = int64_t{1} << 24;
  at_most("layers", c.layers, 16384, "planning replays every layer");
  at_most("dim", c.dim, int64_t{1} << 20, "a 1T model has 25600");
  at_most("heads", c.heads, 65536, "a 1T model has 160");
  at_most("batch", c.batch, k16M, "sequences per micro-batch");
  at_most("seq", c.seq, k16M, "tokens per sequence");
  at_most("vocab", c.vocab, k16M, "tokens in the vocabulary");
  at_most("ffn", c.ffn, k16M, "the MLP width");
  at_most("tp", c.tp, 4096, "tensor-parallel ranks");
  at_most("cp", c.cp, 4096, "context-parallel ranks");
  // The largest tensors: (B, T, widest) activations, (B, H, T, T) attention scores and the weight
  // matrices, counted in doubles so that nothing wraps; 2^60 bytes is an exabyte.
  const double b = static_cast<double>(c.batch), t = static_cast<double>(c.seq), d = static_cast<double>(c.dim);
  // q, k and v side by side: heads of head_size (when given) need not add up to dim.
  const double qkv =
      static_cast<double>(c.heads + 2 * c.kv()) * static_cast<double>(c.head_size > 0 ? c.head_size : c.dim / c.heads);
  const double widest =
      std::max({3 * d, qkv, 2 * static_cast<double>(c.ffn > 0 ? c.ffn : 4 * c.dim), static_cast<double>(c.vocab)});
  const double largest = 8 * std::max({b * t * widest, b * static_cast<double>(c.heads) * t * t, widest * d});
  if (largest > std::ldexp(1.0, 60))
    fail(
        "ModelConfig batch {} x seq {} x dim {} (heads {}, vocab {}) makes tensors of {:.3g} bytes, over 2^60: "
        "shrink the batch, sequence or width",
        c.batch, c.seq, c.dim, c.heads, c.vocab, largest);
}

// The split over tensor-, sequence- and context-parallel ranks.
void validate_split(const ModelConfig& c) {
  if (c.tp < 1) fail("ModelConfig.tp must be a positive integer, got {}", c.tp);
  if (c.tp > 1) {
    if (c.heads % c.tp != 0 || c.kv() % c.tp != 0)
      fail(
          "ModelConfig.tp {} must divide the attention heads ({}) and key/value heads ({}): each rank takes whole "
          "heads",
          c.tp, c.heads, c.kv());
    if (c.hidden() % c.tp != 0)
      fail("ModelConfig.tp {} must divide the MLP width ({}): the first MLP linear is split by columns", c.tp,
           c.hidden());
  }
  if (c.sp && c.tp == 1) fail("ModelConfig.sp (sequence parallelism) splits the sequence over tp ranks; set tp > 1");
  if (c.cp < 1) fail("ModelConfig.cp must be a positive integer, got {}", c.cp);
  if (c.cp > 1 && c.seq % c.cp != 0)
    fail("ModelConfig.seq {} is not divisible by ModelConfig.cp {}: each context-parallel rank holds seq / cp tokens",
         c.seq, c.cp);
  if (c.cp > 1 && c.attention != AttentionImpl::Flash)
    fail(
        "ModelConfig.cp {} runs attention in a ring over the ranks' keys and values, which math attention's T x T "
        "tensors cannot; use --attention flash",
        c.cp);
  if (c.sp && c.local_seq() % c.tp != 0)
    fail(
        "ModelConfig.seq {} is not divisible by ModelConfig.tp {} (x cp {}); sequence parallelism gives each rank "
        "seq / (cp tp) tokens",
        c.seq, c.tp, c.cp);
}

}  // namespace

void validate(const ModelConfig& c) {
  const blocks::BlockKind& kind = blocks::block_kind(c.arch);
  validate_sizes(c);
  if (c.head_size < 0 || c.head_size > 65536)
    fail("ModelConfig.head_size must be in 0..65536 (0: dim / heads), got {}", c.head_size);
  if (c.head_size == 0 && c.dim % c.heads != 0)
    fail("ModelConfig.dim {} is not divisible by ModelConfig.heads {}; pick heads that divide dim (e.g. {})", c.dim,
         c.heads, c.dim % 8 == 0 ? 8 : 1);
  if (c.heads % c.kv() != 0)
    fail("ModelConfig.heads {} is not divisible by ModelConfig.kv_heads {}; key/value heads must divide the heads",
         c.heads, c.kv());
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) fail("ModelConfig.dropout must be in [0, 1), got {}", c.dropout);
  if (c.dtype == DType::Bool || c.dtype == DType::I64)
    fail("ModelConfig.dtype {} is not a floating-point type; allowed: fp32, bf16, fp16", to_string(c.dtype));
  if (c.loss == Loss::Fused && c.dtype != DType::BF16)
    fail(
        "ModelConfig.loss fused is Megatron-LM's fused cross-entropy, modelled for dtype bf16 only (its gradient "
        "is made in bf16; under another dtype a cast follows, not measured); got {}",
        to_string(c.dtype));
  if (c.loss == Loss::Chunked && (c.loss_chunks < 1 || c.loss_chunks > 999999))
    fail("ModelConfig.loss_chunks must be in 1..999999 for the chunked loss (chunked:N), got {}", c.loss_chunks);
  if (!(c.rope_theta > 0)) fail("ModelConfig.rope_theta must be > 0, got {}", c.rope_theta);
  if (!(c.norm_eps > 0 && c.norm_eps < 1)) fail("ModelConfig.norm_eps must be in (0, 1), got {}", c.norm_eps);
  validate_split(c);
  if (c.ep != 1 && !kind.routes)
    fail("ModelConfig.ep {} splits experts over ranks; a {} block has none (use arch moe)", c.ep, c.arch);
  if (c.etp != 1 && !kind.routes)
    fail("ModelConfig.etp {} splits experts' linears over ranks; a {} block has none (use arch moe)", c.etp, c.arch);
  if (c.attention == AttentionImpl::Flash && !kind.causal)
    fail("ModelConfig.attention flash is for causal blocks ({}); a {} block attends to all positions",
         blocks::names(/*causal_only=*/true), c.arch);
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
