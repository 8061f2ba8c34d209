#include "remat/config.h"

#include "remat/error.h"

namespace remat {

void validate(const ModelConfig& c) {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) fail("--{} must be a positive integer, got {}", name, v);
  };
  positive("layers", c.layers);
  positive("dim", c.dim);
  positive("heads", c.heads);
  positive("batch", c.batch);
  positive("seq", c.seq);
  positive("vocab", c.vocab);
  positive("attn-block", c.attn_block);
  if (c.ffn < 0) fail("--ffn must be >= 0 (0 means 4 * dim), got {}", c.ffn);
  if (c.dim % c.heads != 0)
    fail("--dim {} is not divisible by --heads {}; pick heads that divide dim (e.g. {})", c.dim,
         c.heads, c.dim % 8 == 0 ? 8 : 1);
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    fail("--dropout must be in [0, 1), got {}", c.dropout);
  if (c.arch == Arch::Seed && c.dropout > 0.0)
    fail("--dropout {} is not available for --arch seed (the seed block has no dropout); use --arch gpt2",
         c.dropout);
  if (c.dtype == DType::Bool || c.dtype == DType::I64)
    fail("--dtype {} is not a floating-point type; allowed: fp32, bf16, fp16", to_string(c.dtype));
}

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::Bool: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

std::string_view to_string(Arch a) { return a == Arch::Seed ? "seed" : "gpt2"; }

std::string_view to_string(DType t) {
  switch (t) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
    case DType::Bool: return "bool";
    case DType::I64: return "int64";
  }
  return "?";
}

std::string_view to_string(AttentionImpl a) { return a == AttentionImpl::Math ? "math" : "flash"; }

Arch parse_arch(std::string_view s) {
  if (s == "seed") return Arch::Seed;
  if (s == "gpt2") return Arch::Gpt2;
  fail("unknown --arch '{}'; allowed: seed, gpt2", s);
}

DType parse_dtype(std::string_view s) {
  if (s == "fp32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "fp16") return DType::F16;
  fail("unknown --dtype '{}'; allowed: fp32, bf16, fp16", s);
}

AttentionImpl parse_attention(std::string_view s) {
  if (s == "math") return AttentionImpl::Math;
  if (s == "flash") return AttentionImpl::Flash;
  fail("unknown --attention '{}'; allowed: math, flash", s);
}

std::string describe(const ModelConfig& c) {
  std::string s = fmt::format("{} L={} C={} H={} B={} T={} {}", to_string(c.arch), c.layers, c.dim,
                              c.heads, c.batch, c.seq, to_string(c.dtype));
  if (c.hidden() != 4 * c.dim) s += fmt::format(" ffn={}", c.hidden());
  if (c.arch == Arch::Gpt2) s += fmt::format(" V={}", c.vocab);
  if (c.dropout > 0) s += fmt::format(" dropout={}", c.dropout);
  if (c.attention != AttentionImpl::Math) s += fmt::format(" attention={}", to_string(c.attention));
  if (c.attn_block != 128 && c.arch == Arch::Gpt2) s += fmt::format(" attn-block={}", c.attn_block);
  return s;
}

}  // namespace remat
