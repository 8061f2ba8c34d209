// The engine's promise, for every block kind: any policy gives gradients bitwise equal to none's,
// and the bytes forward() keeps are the ones predicted from the table.
#include "remat/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include "remat/error.h"
#include "remat/memory.h"
#include "remat/module_model.h"
#include "test_util.h"
#include "util/parallel_testing.h"

namespace remat {
namespace {

using testing::tiny;

struct Outcome {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
  int64_t saved_bytes = 0, predicted = 0;
};

Outcome run(const ModelConfig& c, const ResolvedPolicy& policy, ExecOptions opts = {}) {
  at::manual_seed(1);
  GPT model(c, policy, opts);
  at::manual_seed(2);
  auto [input, target] = random_batch(c);
  at::manual_seed(3);  // dropout seeds
  Outcome o;
  const int64_t before = MemoryTracker::live();
  o.loss = model->forward(input, target);
  o.saved_bytes = MemoryTracker::live() - before;
  o.predicted = model->predicted_saved_bytes();
  o.loss.backward();
  for (const at::Tensor& p : model->parameters()) o.grads.push_back(p.grad());
  return o;
}

Outcome run(const ModelConfig& c, const std::string& policy, ExecOptions opts = {}) {
  return run(c, Policy::parse(policy).resolve(make_block(c), c.layers), std::move(opts));
}

void expect_bitwise(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  EXPECT_TRUE(testing::bitwise_equal(a.loss, b.loss)) << what << ": loss";
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(testing::bitwise_equal(b.grads[i], a.grads[i])) << what << ": parameter " << i;
}

// A random per-tensor policy for each layer.
std::string random_policy(const BlockSpec& b, int64_t layers, std::mt19937& rng) {
  std::string policy = "layers:";
  for (int64_t l = 0; l < layers; ++l) {
    std::string names;
    for (int t : b.choosable())
      if (rng() % 2) names += (names.empty() ? "" : ",") + b.tensors[t].name;
    policy += fmt::format("{}{}={}", l ? "," : "", l, names.empty() ? "none" : "drop:" + names);
  }
  return policy;
}

// Every block kind, dropout on where the kind has it.
class EngineKinds : public ::testing::TestWithParam<testing::EngineCase> {
 protected:
  ModelConfig cfg() const { return GetParam().cfg; }
  // Whether the kind has tensors for `preset` to drop. Parsed outside the try: a preset the
  // grammar no longer knows fails the test instead of being skipped on every kind.
  bool has(const char* preset) const {
    const Policy policy = Policy::parse(preset);
    try {
      policy.resolve(make_block(cfg()), cfg().layers);
      return true;
    } catch (const Error&) {
      return false;
    }
  }
};

TEST_P(EngineKinds, EveryPresetAndFormGivesBitwiseEqualGradients) {
  const ModelConfig c = cfg();
  const Outcome none = run(c, "none");
  for (const char* p :
       {"full", "mlp-act", "mlp", "every:2", "block:2", "uniform:2", "uniform:4", "layers:0-1=mlp,2=full,3=mlp-act"})
    expect_bitwise(none, run(c, p), p);
  for (const char* p : {"attn", "attn+mlp-act", "every:3=attn", "norm", "moe-act", "moe", "shared", "every:2=moe"})
    // where the kind has such tensors
    if (has(p)) expect_bitwise(none, run(c, p), p);
}

// Recomputing a layer's dropped tensors at the start of its backward (as torch.utils.checkpoint
// does, LayerPolicy::eager) changes when, never what: the same bits. torchtitan's op mode, which
// holds tensors no backward reads, too.
TEST_P(EngineKinds, EagerRecomputeAndTorchtitanOpGiveBitwiseEqualGradients) {
  const ModelConfig c = cfg();
  const Outcome none = run(c, "none");
  for (const char* p : {"full", "mlp", "torchtitan-op"}) {
    ResolvedPolicy policy = Policy::parse(p).resolve(make_block(c), c.layers);
    expect_bitwise(none, run(c, policy), p);
    for (LayerPolicy& l : policy.layers) l.eager = true;
    expect_bitwise(none, run(c, policy), std::string(p) + ", eager");
  }
}

TEST_P(EngineKinds, RandomPerTensorPoliciesGiveBitwiseEqualGradients) {
  const ModelConfig c = cfg();
  const BlockSpec b = make_block(c);
  const Outcome none = run(c, "none");
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 8; ++trial) {
    const std::string policy = random_policy(b, c.layers, rng);
    expect_bitwise(none, run(c, policy), policy);
  }
}

TEST_P(EngineKinds, PredictedSavedBytesEqualTheTracker) {
  const ModelConfig c = cfg();
  for (const char* p : {"none", "full", "attn", "mlp-act", "every:2", "uniform:2", "moe-act", "moe", "shared"}) {
    if (!has(p)) continue;
    const Outcome o = run(c, p);
    EXPECT_EQ(o.saved_bytes, o.predicted) << GetParam().name << " " << p;
  }
}

TEST_P(EngineKinds, BackwardLeavesNothingBehind) {
  const ModelConfig c = cfg();
  at::manual_seed(1);
  GPT model(c, Policy::parse("mlp-act"));
  auto [input, target] = random_batch(c);
  const int64_t before = MemoryTracker::live();
  model->forward(input, target).backward();
  int64_t grads = 0;
  for (at::Tensor& p : model->parameters()) {
    grads += p.grad().nbytes();
    p.mutable_grad() = at::Tensor();
  }
  EXPECT_GT(grads, 0);
  EXPECT_EQ(MemoryTracker::live(), before);
}

TEST_P(EngineKinds, VerifyPassesCorrectRecomputes) {
  ExecOptions verify;
  verify.verify = true;
  EXPECT_NO_THROW(run(cfg(), "full", verify));
  EXPECT_NO_THROW(run(cfg(), "mlp-act", verify));
}

// The kernel threads split GEMM tiles, attention products and pointwise loops in pieces that do
// not depend on their count. 2 x 15 tokens: a linear's rows split per thread would be 15-row
// pieces, which oneDNN computes with other bits (Gemm.TiledProductHasTheSameBitsOnOneThreadOrTwo).
TEST_P(EngineKinds, GradientsDoNotDependOnTheThreadCount) {
  ModelConfig c = cfg();
  c.seq = 15;
  auto on = [&](int threads) {
    const detail::KernelThreads scope(threads);
    return run(c, "full");
  };
  expect_bitwise(on(1), on(2), "1 thread against 2");
}

INSTANTIATE_TEST_SUITE_P(Kinds, EngineKinds, ::testing::ValuesIn(testing::engine_cases()),
                         [](const auto& info) { return info.param.name; });

// A batch refilled in place between the forward and the backward (a loader reusing its buffer)
// would give the embedding the new ids' gradients: the backward refuses it, as autograd refuses a
// saved tensor changed in place.
TEST(Engine, RefusesABatchChangedBetweenForwardAndBackward) {
  const ModelConfig c = tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  auto [input, target] = random_batch(c);
  const at::Tensor loss = model->forward(input, target);
  input.copy_(target);
  const std::string e = testing::error_of([&] { loss.backward(); });
  EXPECT_NE(e.find("input 0 of stage 'gpt2.stem' was changed in place"), std::string::npos) << e;
}

// Targets narrowed from a buffer of T + 1 tokens are a strided view: the chunked loss's backward
// gives the gradients of their contiguous copy, bit for bit.
TEST(Engine, AStridedTargetGivesTheGradientsOfItsCopy) {
  ModelConfig c = tiny("gpt2");
  c.loss = Loss::Chunked, c.loss_chunks = 2;
  at::manual_seed(4);
  const at::Tensor buffer = at::randint(0, c.vocab, {c.batch, c.seq + 1}, at::kLong);
  const at::Tensor input = buffer.narrow(1, 0, c.seq), target = buffer.narrow(1, 1, c.seq);
  ASSERT_FALSE(target.is_contiguous());
  auto grads = [&](const at::Tensor& t) {
    at::manual_seed(5);
    GPT model(c, Policy::parse("none"));
    model->forward(input, t).backward();
    std::vector<at::Tensor> g;
    for (const at::Tensor& p : model->parameters()) g.push_back(p.grad());
    return g;
  };
  const std::vector<at::Tensor> strided = grads(target), copied = grads(target.contiguous());
  for (size_t i = 0; i < strided.size(); ++i) EXPECT_TRUE(testing::bitwise_equal(strided[i], copied[i])) << i;
}

// Under InferenceMode nothing is kept for a backward: the logits come out as with grad off.
TEST(Engine, RunsUnderInferenceMode) {
  const ModelConfig c = tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  model->eval();
  auto [input, target] = random_batch(c);
  at::Tensor want;
  {
    at::NoGradGuard off;
    want = model->logits(input);
  }
  c10::InferenceMode inference;
  EXPECT_TRUE(at::equal(model->logits(input), want));
}

// Token ids index the embedding and the chunked loss's rows unchecked: one past the vocabulary is
// refused before any op runs.
TEST(Engine, RefusesATokenIdOutsideTheVocabulary) {
  ModelConfig c = tiny("gpt2");
  c.loss = Loss::Chunked, c.loss_chunks = 2;
  GPT model(c, Policy::parse("none"));
  auto [input, target] = random_batch(c);
  target.view(-1)[3] = c.vocab;
  EXPECT_NE(testing::error_of([&] {
              model->forward(input, target);
            }).find(fmt::format("the target holds token id {}; ids must be in [0, {})", c.vocab, c.vocab)),
            std::string::npos);
  target.view(-1)[3] = c.vocab - 1;
  EXPECT_EQ(testing::error_of([&] { model->forward(input, target); }), "");
}

// A recompute that differs by one ulp in one tensor of one layer is named, with its layer.
TEST(Engine, VerifyNamesAWrongRecomputeAndItsLayer) {
  ExecOptions verify;
  verify.verify = true;
  verify.after_recompute = [](const TensorSpec& t, int64_t layer, at::Tensor& value) {
    if (t.name != "probs" || layer != 2) return;
    value = value.clone();  // one element one ulp up: no tolerance would see it
    float* v = value.data_ptr<float>();
    v[1] = std::nextafter(v[1], 2.0f);
  };
  try {
    run(tiny("gpt2", 0.1), "attn", verify);
    FAIL() << "a perturbed recompute passed --verify";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recompute of 'probs' (layer 2) differs from its forward value"),
              std::string::npos)
        << e.what();
  }
  verify.verify = false;  // without --verify the same fault goes unnoticed: the check is what catches it
  EXPECT_NO_THROW(run(tiny("gpt2", 0.1), "attn", verify));
}

// A uniform:N segment's rerun that differs from its first forward (here: a weight changed behind
// autograd's back, between the forward and the backward) is named, with its layer.
TEST(Engine, VerifyNamesASegmentRerunThatDiffers) {
  const ModelConfig c = tiny("gpt2", 0.1);
  auto step = [&](bool verify) {
    ExecOptions o;
    o.verify = verify;
    at::manual_seed(1);
    GPT model(c, Policy::parse("uniform:2"), o);
    auto [input, target] = random_batch(c);
    at::Tensor loss = model->forward(input, target);
    model->block_params(3)[0].data().add_(1e-3);  // layer 3: the second segment's second stage
    loss.backward();
  };
  try {
    step(true);
    FAIL() << "a rerun that differs passed --verify";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 3's output differs when its uniform:N segment reruns it"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(step(false));  // without --verify it goes unnoticed
}

TEST(Engine, SeedBlockComputesTheModulePathsFunction) {
  const ModelConfig c = tiny("seed");
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
  at::manual_seed(6);
  auto [input, target] = random_batch(c);
  // The module path takes (T, B, C), as torch::nn::MultiheadAttention does.
  at::Tensor module_loss = at::mse_loss(module.forward(input.transpose(0, 1)), target.transpose(0, 1));
  at::Tensor engine_loss = engine->forward(input, target);
  module_loss.backward();
  engine_loss.backward();
  EXPECT_NEAR(module_loss.item<double>(), engine_loss.item<double>(), 1e-6);
  const auto mp = module.parameters(), ep = engine->parameters();
  for (size_t i = 0; i < mp.size(); ++i)
    EXPECT_TRUE(testing::close(ep[i].grad(), mp[i].grad(), 1e-5)) << "parameter " << i;
}

TEST(Engine, TrainsWithTorchOptim) {
  for (const std::string& kind : testing::token_kinds()) {
    const ModelConfig c = tiny(kind);
    at::manual_seed(7);
    GPT model(c, Policy::parse("attn+mlp-act"));
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto [input, target] = random_batch(c);
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      adam.zero_grad();
      at::Tensor loss = model->forward(input, target);
      loss.backward();
      adam.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, 0.5 * first) << kind;  // memorises one batch
  }
}

TEST(Engine, Gpt2EmbeddingIsTiedToTheHead) {
  const ModelConfig c = tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  size_t wte = 0;
  for (const auto& item : model->named_parameters()) wte += item.key() == "wte";
  EXPECT_EQ(wte, 1u);
  EXPECT_EQ(model->parameters().size(), 2 + 12 * static_cast<size_t>(c.layers) + 2);
}

TEST(Engine, LogitsAreTheHeadWithoutItsLoss) {
  for (const std::string& kind : testing::token_kinds()) {
    const ModelConfig c = tiny(kind);
    at::manual_seed(8);
    GPT model(c, Policy::parse("none"));
    model->eval();
    auto [input, target] = random_batch(c);
    const at::Tensor logits = model->logits(input);
    ASSERT_EQ(logits.sizes(), (at::IntArrayRef{c.batch, c.seq, c.vocab})) << kind;
    const at::Tensor loss = at::cross_entropy_loss(logits.view({-1, c.vocab}), target.view({-1}));
    at::NoGradGuard off;
    EXPECT_NEAR(loss.item<double>(), model->forward(input, target).item<double>(), 1e-5) << kind;
  }
}

TEST(Engine, RejectsPoliciesThatDoNotResolve) {
  EXPECT_THROW(GPT(tiny("seed"), Policy::parse("norm")), Error);
  EXPECT_THROW(GPT(tiny("gpt2"), Policy::parse("layers:0-9=full")), Error);
}

// ModelConfig::eager_ops plans a GPU framework's unfused ops; the engine runs its own and says so.
TEST(Engine, RejectsEagerOpsWhichArePlanningOnly) {
  ModelConfig c = tiny("llama");
  c.eager_ops = true;
  EXPECT_THROW(GPT(c, Policy::parse("none")), Error);
}

}  // namespace
}  // namespace remat
