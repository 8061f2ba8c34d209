#include "test_util.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "remat/block.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "remat/units.h"

namespace remat::testing {

ModelConfig tiny(const std::string& arch, double dropout) {
  ModelConfig c;
  c.arch = arch;
  c.layers = 4;
  c.dim = 16;
  c.heads = 4;
  c.batch = 2;
  c.seq = 8;
  c.vocab = 11;
  c.dropout = dropout;
  c.attn_block = 4;
  return c;
}

MeasuredStep measure_step(const ModelConfig& c, const ResolvedPolicy& policy) {
  MeasuredStep m;
  const int64_t empty = MemoryTracker::live();
  at::manual_seed(1);
  GPT model(c, policy);
  Adam adam(model->parameters(), AdamOptions{1e-3});
  at::manual_seed(2);
  auto [input, target] = random_batch(c);
  const int64_t before = MemoryTracker::live();
  m.base = before - empty;
  MemoryTracker::reset_peak();
  {
    at::Tensor loss = model->forward(input, target);
    m.saved = MemoryTracker::live() - before;
    loss.backward();
  }
  adam.step();
  m.peak = MemoryTracker::peak() - before;
  return m;
}

std::vector<std::string> all_kinds() { return block_kinds(); }

std::vector<std::string> token_kinds() {
  std::vector<std::string> out;
  for (const std::string& k : block_kinds())
    if (make_model(tiny(k)).has_stem) out.push_back(k);
  return out;
}

std::vector<EngineCase> engine_cases() {
  std::vector<EngineCase> out;
  for (const std::string& k : block_kinds()) {
    ModelConfig c = tiny(k, k == "seed" ? 0.0 : 0.1);
    out.push_back({k, c});
    c.attention = AttentionImpl::Flash;
    try {
      validate(c);
    } catch (const std::exception&) {
      continue;  // a kind without causal attention
    }
    out.push_back({k + "_flash", c});
  }
  // Decoders between the kinds' defaults (blocks/decoder.h): rotary q and k sliced from a fused
  // projection, grouped-query attention, SwiGLU and RMSNorm on gpt2, an untied head, biased q/k/v,
  // and the chunked loss with a tied and an untied head.
  ModelConfig g = tiny("gpt2", 0.1);
  g.positions = Positions::Rope, g.kv_heads = 2, g.mlp = Mlp::Swiglu, g.norm = Norm::Rms, g.tied = Switch::Off;
  out.push_back({"gpt2_rope_gqa_swiglu_untied", g});
  g.attention = AttentionImpl::Flash;
  out.push_back({"gpt2_rope_gqa_swiglu_untied_flash", g});
  ModelConfig l = tiny("llama", 0.1);
  l.fused_qkv = Switch::On, l.qkv_bias = true, l.norm = Norm::Layer, l.loss = Loss::Chunked, l.loss_chunks = 3;
  out.push_back({"llama_fused_qkvbias_chunked", l});
  ModelConfig q = tiny("llama", 0.1);  // Qwen3's q/k norms; GPT-NeoX's partial rotary and parallel residual
  q.qk_norm = true, q.rotary_fraction = 0.5, q.parallel_residual = true, q.kv_heads = 2;
  out.push_back({"llama_qknorm_partial_rotary_parallel", q});
  ModelConfig w = tiny("llama", 0.1);  // Qwen3's heads wider than dim / heads: q is 32 wide on a 16-wide stream
  w.head_size = 8, w.kv_heads = 2, w.qk_norm = true;
  out.push_back({"llama_wide_heads", w});
  ModelConfig t = tiny("gpt2", 0.1);
  t.loss = Loss::Chunked, t.loss_chunks = 4;
  out.push_back({"gpt2_chunked_tied", t});
  ModelConfig m = tiny("moe", 0.1);  // a capacity that drops copies, a shared expert, sigmoid scores
  m.capacity_factor = 0.5, m.shared_ffn = 24, m.router = Router::Sigmoid, m.norm_topk = false, m.top_k = 3;
  out.push_back({"moe_capacity_shared_sigmoid", m});
  ModelConfig a = tiny("moe", 0.1);  // Megatron-LM's experts: GELU, the weights on the activation
  a.mlp = Mlp::Gelu, a.expert_weights = ExpertWeights::Activation;
  out.push_back({"moe_gelu_weighted_activation", a});
  a.mlp = Mlp::Swiglu, a.capacity_factor = 0.5;
  out.push_back({"moe_capacity_weighted_activation", a});
  ModelConfig s = tiny("moe", 0.1);  // Megatron-LM's sinkhorn router, one expert per token
  s.router = Router::Sinkhorn, s.top_k = 1, s.aux_loss = 0, s.mlp = Mlp::Gelu,
  s.expert_weights = ExpertWeights::Activation;
  out.push_back({"moe_sinkhorn_top1", s});
  return out;
}

namespace {

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace

::testing::AssertionResult bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined())
    return ::testing::AssertionFailure() << (a.defined() ? "second" : "first") << " tensor is undefined";
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type())
    return ::testing::AssertionFailure() << shape_str(a.sizes().vec()) << " " << a.scalar_type() << " vs "
                                         << shape_str(b.sizes().vec()) << " " << b.scalar_type();
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  if (std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not bitwise equal: max abs diff " << max_diff(x, y);
}

::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, double tol) {
  if (!got.defined() || !want.defined()) return ::testing::AssertionFailure() << "an undefined tensor";
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure() << shape_str(got.sizes().vec()) << " vs " << shape_str(want.sizes().vec());
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  // Relative to the tensor's largest value, however small: a gradient of 1e-4 is held to 1e-4 x tol.
  const double scale = std::max(1e-30, want.to(at::kDouble).abs().max().item<double>());
  const double diff = max_diff(got, want);
  if (diff <= tol * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max abs diff " << diff << " over " << tol << " x " << scale;
}

std::string temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("remat_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

AtenThreads::AtenThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }

AtenThreads::~AtenThreads() { at::set_num_threads(saved_); }

}  // namespace remat::testing
