#include "remat/config.h"

#include <algorithm>
#include <cmath>

#include "remat/error.h"

namespace remat {

std::string_view to_string(DType t) {
  switch (t) {
    case DType::F32:
      return "fp32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "fp16";
    case DType::Bool:
      return "bool";
    case DType::I64:
      return "int64";
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

std::string_view to_string(Norm n) { return n == Norm::Layer ? "layer" : n == Norm::Rms ? "rms" : "default"; }
std::string_view to_string(Positions p) {
  return p == Positions::Learned ? "learned"
         : p == Positions::Rope  ? "rope"
         : p == Positions::None  ? "none"
                                 : "default";
}
std::string_view to_string(Mlp m) { return m == Mlp::Gelu ? "gelu" : m == Mlp::Swiglu ? "swiglu" : "default"; }
std::string_view to_string(Router r) {
  switch (r) {
    case Router::Softmax:
      return "softmax";
    case Router::Sigmoid:
      return "sigmoid";
    case Router::Sinkhorn:
      return "sinkhorn";
  }
  return "?";
}
std::string_view to_string(ExpertWeights w) { return w == ExpertWeights::Activation ? "activation" : "combine"; }
std::string to_string(Loss l, int64_t chunks) {
  switch (l) {
    case Loss::Default:
      return "default";
    case Loss::Fp32:
      return "fp32";
    case Loss::Upcast:
      return "upcast";
    case Loss::Model:
      return "model";
    case Loss::Fused:
      return "fused";
    case Loss::Chunked:
      return fmt::format("chunked:{}", chunks);
  }
  return "?";
}

Norm parse_norm(std::string_view s) {
  if (s == "layer") return Norm::Layer;
  if (s == "rms") return Norm::Rms;
  fail("unknown ModelConfig.norm '{}'; allowed: layer (LayerNorm), rms (RMSNorm)", s);
}

Positions parse_positions(std::string_view s) {
  if (s == "learned") return Positions::Learned;
  if (s == "rope") return Positions::Rope;
  if (s == "none") return Positions::None;
  fail("unknown ModelConfig.positions '{}'; allowed: learned, rope, none", s);
}

Mlp parse_mlp(std::string_view s) {
  if (s == "gelu") return Mlp::Gelu;
  if (s == "swiglu") return Mlp::Swiglu;
  fail("unknown ModelConfig.mlp '{}'; allowed: gelu, swiglu", s);
}

Router parse_router(std::string_view s) {
  if (s == "softmax") return Router::Softmax;
  if (s == "sigmoid") return Router::Sigmoid;
  if (s == "sinkhorn") return Router::Sinkhorn;
  fail("unknown ModelConfig.router '{}'; allowed: softmax, sigmoid, sinkhorn", s);
}

ExpertWeights parse_expert_weights(std::string_view s) {
  if (s == "combine") return ExpertWeights::Combine;
  if (s == "activation") return ExpertWeights::Activation;
  fail(
      "unknown ModelConfig.expert_weights '{}'; allowed: combine (weight the experts' outputs), activation "
      "(weight their activation, as Megatron-LM does)",
      s);
}

int64_t ModelConfig::expert_capacity() const {
  if (capacity_factor <= 0) return 0;
  // Each rank keeps ceil(c * its tokens * top_k / E) copies per expert and, padded to that, sends
  // them to the expert's rank, which takes as many from each of the ep ranks (Megatron-LM's
  // get_capacity and drop-and-pad all-to-all).
  const double per_rank =
      std::ceil(capacity_factor * static_cast<double>(batch * rank_seq() * top_k) / static_cast<double>(experts));
  return ep * std::max<int64_t>(1, static_cast<int64_t>(per_rank));
}

int64_t ModelConfig::dispatch_rows() const {
  if (capacity_factor > 0) return rank_experts() * expert_capacity() * etp;
  const int64_t balanced = batch * rank_seq() * top_k;
  return etp * (ep > 1 ? static_cast<int64_t>(std::ceil(static_cast<double>(balanced) * expert_imbalance)) : balanced);
}

void parse_loss(std::string_view s, ModelConfig& cfg) {
  if (s == "fp32") {
    cfg.loss = Loss::Fp32;
  } else if (s == "upcast") {
    cfg.loss = Loss::Upcast;
  } else if (s == "model") {
    cfg.loss = Loss::Model;
  } else if (s == "fused") {
    cfg.loss = Loss::Fused;
  } else if (s.rfind("chunked:", 0) == 0) {
    const std::string_view n = s.substr(8);
    int64_t v = n.empty() || n.size() > 6 ? -1 : 0;
    for (char ch : n) v = v >= 0 && ch >= '0' && ch <= '9' ? v * 10 + (ch - '0') : -1;
    if (v < 1) fail("ModelConfig.loss '{}': chunked:N needs N in 1..999999, e.g. chunked:8", s);
    cfg.loss = Loss::Chunked;
    cfg.loss_chunks = v;
  } else {
    fail("unknown ModelConfig.loss '{}'; allowed: fp32, upcast, model, fused, chunked:N", s);
  }
}

std::string describe(const ModelConfig& c) {
  std::string s = fmt::format("{} L={} C={} H={}", c.arch, c.layers, c.dim, c.heads);
  if (c.kv() != c.heads) s += fmt::format(" KV={}", c.kv());
  s += fmt::format(" B={} T={} {}", c.batch, c.seq, to_string(c.dtype));
  if (c.hidden() != 4 * c.dim) s += fmt::format(" ffn={}", c.hidden());
  if (c.head_size > 0) s += fmt::format(" head-dim={}", c.head_size);
  if (c.arch != "seed") s += fmt::format(" V={}", c.vocab);
  if (c.dropout > 0) s += fmt::format(" dropout={}", c.dropout);
  if (c.attention != AttentionImpl::Math) s += fmt::format(" attention={}", to_string(c.attention));
  if (c.attn_block != 128 && c.arch != "seed") s += fmt::format(" attn-block={}", c.attn_block);
  if (c.norm != Norm::Default) s += fmt::format(" norm={}", to_string(c.norm));
  if (c.positions != Positions::Default) s += fmt::format(" positions={}", to_string(c.positions));
  if (c.mlp != Mlp::Default) s += fmt::format(" mlp={}", to_string(c.mlp));
  if (c.bias != Switch::Default) s += c.bias == Switch::On ? " bias" : " no-bias";
  if (c.qkv_bias) s += " qkv-bias";
  if (c.tied != Switch::Default) s += c.tied == Switch::On ? " tied" : " untied";
  if (c.fused_qkv != Switch::Default) s += c.fused_qkv == Switch::On ? " qkv=fused" : " qkv=separate";
  if (c.loss != Loss::Default) s += " loss=" + to_string(c.loss, c.loss_chunks);
  if (c.rotary_fraction != 1.0) s += fmt::format(" rotary={}", c.rotary_fraction);
  if (c.parallel_residual) s += " parallel-residual";
  if (c.qk_norm) s += " qk-norm";
  if (c.arch == "moe") {
    s += fmt::format(" experts={} top-k={}", c.experts, c.top_k);
    if (c.shared_ffn > 0) s += fmt::format(" shared-ffn={}", c.shared_ffn);
    if (c.capacity_factor > 0) s += fmt::format(" capacity={}", c.capacity_factor);
    if (c.router != Router::Softmax) s += fmt::format(" router={}", to_string(c.router));
    if (c.expert_weights != ExpertWeights::Combine) s += fmt::format(" weights={}", to_string(c.expert_weights));
    if (c.router_fp32) s += " router-dtype=fp32";
    if (c.ep > 1) s += fmt::format(" ep={}", c.ep);
    if (c.etp > 1) s += fmt::format(" etp={}", c.etp);
  }
  if (c.tp > 1) s += fmt::format(" tp={}{}", c.tp, c.sp ? "+sp" : "");
  return s;
}

}  // namespace remat
