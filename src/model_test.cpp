#include "remat/model.h"

#include <gtest/gtest.h>

#include <random>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include "remat/error.h"
#include "remat/memory.h"
#include "remat/module_model.h"

namespace remat {
namespace {

ModelConfig tiny(Arch arch, double dropout = 0.0) {
  ModelConfig c;
  c.arch = arch;
  c.layers = 4; c.dim = 16; c.heads = 4; c.batch = 2; c.seq = 8; c.vocab = 11; c.dropout = dropout;
  c.attn_block = 4;  // two causal row blocks: the packed layout end to end
  return c;
}

struct Batch {
  at::Tensor input, target;
};

Batch batch(const ModelConfig& c, uint64_t seed) {
  at::manual_seed(seed);
  auto [input, target] = random_batch(c);
  return {input, target};
}

struct Outcome {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
  int64_t saved_bytes = 0, predicted = 0;
};

Outcome run(const ModelConfig& c, const std::string& policy, ExecOptions opts = {}) {
  at::manual_seed(1);
  GPT model(c, Policy::parse(policy), opts);
  const Batch b = batch(c, 2);
  at::manual_seed(3);  // dropout seeds
  Outcome o;
  const int64_t before = MemoryTracker::live();
  o.loss = model->forward(b.input, b.target);
  o.saved_bytes = MemoryTracker::live() - before;
  o.predicted = model->predicted_saved_bytes();
  o.loss.backward();
  for (const at::Tensor& p : model->parameters()) o.grads.push_back(p.grad());
  return o;
}

void expect_bitwise(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  EXPECT_TRUE(at::equal(a.loss, b.loss)) << what << ": loss";
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(b.grads[i].defined()) << what << ": parameter " << i << " got no gradient";
    EXPECT_TRUE(at::equal(a.grads[i], b.grads[i]))
        << what << ": parameter " << i << " differs by " << (a.grads[i] - b.grads[i]).abs().max().item<double>();
  }
}

const std::vector<std::string> kPresetsAndForms = {
    "full", "attn", "mlp-act", "norm", "mlp", "attn+mlp-act", "save:ln1,qkv", "keep:probs_mask+full",
    "drop:probs_drop", "every:2", "every:3=attn", "block:2", "block:1=mlp", "uniform:2", "uniform:4",
    "layers:0-1=attn,2=full,3=norm+mlp-act"};

TEST(Engine, EveryPresetAndFormGivesBitwiseEqualGradientsWithDropout) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const Outcome none = run(c, "none");
  for (const std::string& p : kPresetsAndForms) expect_bitwise(none, run(c, p), p);
}

TEST(Engine, RandomPerTensorPoliciesGiveBitwiseEqualGradients) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const BlockSpec b = make_block(c);
  const Outcome none = run(c, "none");
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 12; ++trial) {
    std::string policy = "layers:";
    for (int64_t l = 0; l < c.layers; ++l) {
      std::string names;
      for (int t : b.choosable())
        if (rng() % 2) names += (names.empty() ? "" : ",") + b.tensors[t].name;
      policy += fmt::format("{}{}={}", l ? "," : "", l, names.empty() ? "none" : "drop:" + names);
    }
    expect_bitwise(none, run(c, policy), policy);
  }
}

TEST(Engine, SeedArchPoliciesGiveBitwiseEqualGradients) {
  const ModelConfig c = tiny(Arch::Seed);
  const Outcome none = run(c, "none");
  for (const char* p : {"full", "attn", "mlp-act", "every:2", "uniform:2"}) expect_bitwise(none, run(c, p), p);
}

TEST(Engine, PredictedSavedBytesEqualTheTracker) {
  for (Arch arch : {Arch::Gpt2, Arch::Seed}) {
    const ModelConfig c = tiny(arch, arch == Arch::Gpt2 ? 0.1 : 0.0);
    for (const char* p : {"none", "full", "attn", "mlp-act", "every:2", "uniform:2", "save:qkv"}) {
      if (arch == Arch::Seed && std::string(p) == "save:qkv") continue;
      const Outcome o = run(c, p);
      EXPECT_EQ(o.saved_bytes, o.predicted) << to_string(arch) << " " << p;
    }
  }
}

TEST(Engine, BackwardLeavesNothingBehind) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  at::manual_seed(1);
  GPT model(c, Policy::parse("attn+mlp-act"));
  const Batch b = batch(c, 2);
  const int64_t before = MemoryTracker::live();
  model->forward(b.input, b.target).backward();
  int64_t grads = 0;
  for (at::Tensor& p : model->parameters()) {
    grads += p.grad().nbytes();
    p.mutable_grad() = at::Tensor();
  }
  EXPECT_GT(grads, 0);
  EXPECT_EQ(MemoryTracker::live(), before);
}

TEST(Engine, VerifyChecksEveryRecomputeBitwise) {
  ExecOptions verify;
  verify.verify = true;
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  EXPECT_NO_THROW(run(c, "full", verify));
  EXPECT_NO_THROW(run(c, "attn+norm", verify));
}

TEST(Engine, SeedBlockComputesTheModulePathsFunction) {
  const ModelConfig c = tiny(Arch::Seed);
  at::manual_seed(5);
  ModuleModel module(c, Policy::parse("none"));
  GPT engine(c, Policy::parse("none"));
  {
    at::NoGradGuard off;
    const auto src = module.parameters();
    const auto dst = engine->parameters();
    ASSERT_EQ(src.size(), dst.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  const Batch b = batch(c, 6);
  // The module path takes (T, B, C), as torch::nn::MultiheadAttention does.
  at::Tensor module_loss = at::mse_loss(module.forward(b.input.transpose(0, 1)), b.target.transpose(0, 1));
  at::Tensor engine_loss = engine->forward(b.input, b.target);
  module_loss.backward();
  engine_loss.backward();
  EXPECT_NEAR(module_loss.item<double>(), engine_loss.item<double>(), 1e-6);
  const auto mp = module.parameters(), ep = engine->parameters();
  for (size_t i = 0; i < mp.size(); ++i) {
    const double diff = (mp[i].grad() - ep[i].grad()).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5) << "parameter " << i;
  }
}

TEST(Engine, TrainsWithTorchOptim) {
  const ModelConfig c = tiny(Arch::Gpt2);
  at::manual_seed(7);
  GPT model(c, Policy::parse("attn+mlp-act"));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  const Batch b = batch(c, 8);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    adam.zero_grad();
    at::Tensor loss = model->forward(b.input, b.target);
    loss.backward();
    adam.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first);  // memorises one batch
}

TEST(Engine, EmbeddingIsTiedToTheHead) {
  const ModelConfig c = tiny(Arch::Gpt2);
  GPT model(c, Policy::parse("none"));
  size_t wte = 0;
  for (const auto& item : model->named_parameters()) wte += item.key() == "wte";
  EXPECT_EQ(wte, 1u);
  EXPECT_EQ(model->parameters().size(), 2 + 12 * static_cast<size_t>(c.layers) + 2);
}

TEST(Engine, RejectsPoliciesThatDoNotResolve) {
  EXPECT_THROW(GPT(tiny(Arch::Seed), Policy::parse("norm")), Error);
  EXPECT_THROW(GPT(tiny(Arch::Gpt2), Policy::parse("layers:0-9=full")), Error);
}

}  // namespace
}  // namespace remat
