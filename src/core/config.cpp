#include "remat/config.h"

#include "remat/error.h"

namespace remat {

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

DType parse_dtype(std::string_view s) {
  if (s == "fp32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "fp16") return DType::F16;
  fail("unknown ModelConfig.dtype '{}'; allowed: fp32, bf16, fp16", s);
}

AttentionImpl parse_attention(std::string_view s) {
  if (s == "math") return AttentionImpl::Math;
  if (s == "flash") return AttentionImpl::Flash;
  fail("unknown ModelConfig.attention '{}'; allowed: math, flash", s);
}

std::string describe(const ModelConfig& c) {
  std::string s = fmt::format("{} L={} C={} H={}", c.arch, c.layers, c.dim, c.heads);
  if (c.kv() != c.heads) s += fmt::format(" KV={}", c.kv());
  s += fmt::format(" B={} T={} {}", c.batch, c.seq, to_string(c.dtype));
  if (c.hidden() != 4 * c.dim) s += fmt::format(" ffn={}", c.hidden());
  if (c.arch != "seed") s += fmt::format(" V={}", c.vocab);
  if (c.dropout > 0) s += fmt::format(" dropout={}", c.dropout);
  if (c.attention != AttentionImpl::Math) s += fmt::format(" attention={}", to_string(c.attention));
  if (c.attn_block != 128 && c.arch != "seed") s += fmt::format(" attn-block={}", c.attn_block);
  if (c.tp > 1) s += fmt::format(" tp={}{}", c.tp, c.sp ? "+sp" : "");
  return s;
}

}  // namespace remat
