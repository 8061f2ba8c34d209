#include "remat/module_model.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "remat/memory.h"
#include "test_util.h"

namespace remat {
namespace {

// Six layers, for every:2 and every:3.
ModelConfig tiny() {
  ModelConfig c = testing::tiny("seed");
  c.layers = 6;
  return c;
}

struct Outcome {
  std::vector<at::Tensor> grads;
  int64_t saved_bytes = 0;
};

Outcome run(const std::string& policy) {
  const ModelConfig c = tiny();
  at::manual_seed(42);
  ModuleModel model(c, Policy::parse(policy));
  at::manual_seed(43);
  const at::Tensor x = at::randn({c.seq, c.batch, c.dim});
  const at::Tensor target = at::randn({c.seq, c.batch, c.dim});
  Outcome r;
  const int64_t before = MemoryTracker::live();
  at::Tensor loss = at::mse_loss(model.forward(x), target);
  r.saved_bytes = MemoryTracker::live() - before;
  loss.backward();
  for (const at::Tensor& p : model.parameters()) r.grads.push_back(p.grad());
  return r;
}

TEST(ModuleModel, EveryStrategyGivesGradientsBitwiseEqualToNone) {
  const Outcome none = run("none");
  for (const char* policy : {"full", "every:2", "every:3", "uniform:2", "uniform:4", "block:2", "layers:1-2=full"}) {
    const Outcome r = run(policy);
    ASSERT_EQ(r.grads.size(), none.grads.size());
    for (size_t i = 0; i < r.grads.size(); ++i) {
      ASSERT_TRUE(r.grads[i].defined()) << policy << ": parameter " << i << " got no gradient";
      EXPECT_TRUE(testing::bitwise_equal(r.grads[i], none.grads[i])) << policy << ": parameter " << i;
    }
  }
}

TEST(ModuleModel, SavedBytesOrderFullEvery3Every2None) {
  const int64_t full = run("full").saved_bytes, every3 = run("every:3").saved_bytes,
                every2 = run("every:2").saved_bytes, none = run("none").saved_bytes;
  EXPECT_LT(full, every3);
  EXPECT_LT(every3, every2);
  EXPECT_LT(every2, none);
}

TEST(ModuleModel, StrategiesCheckpointTheSeedNotesLayers) {
  const ModelConfig c = tiny();
  using Flags = std::vector<bool>;
  EXPECT_EQ(ModuleModel(c, Policy::parse("none")).checkpointed(), Flags(6, false));
  EXPECT_EQ(ModuleModel(c, Policy::parse("full")).checkpointed(), Flags(6, true));
  EXPECT_EQ(ModuleModel(c, Policy::parse("every:2")).checkpointed(), (Flags{false, true, false, true, false, true}));
  EXPECT_EQ(ModuleModel(c, Policy::parse("every:3")).checkpointed(), (Flags{false, true, true, false, true, true}));
  EXPECT_EQ(ModuleModel(c, Policy::parse("block:2")).checkpointed(), (Flags{true, true, false, false, false, false}));
  EXPECT_EQ(ModuleModel(c, Policy::parse("uniform:4")).checkpointed(), Flags(6, true));
}

TEST(ModuleModel, RejectsPerTensorPolicies) {
  try {
    ModuleModel::check(tiny(), Policy::parse("attn"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recomputes only some tensors of layer 0 (probs)"), std::string::npos)
        << e.what();
  }
}

TEST(ModuleModel, RejectsGpt2) {
  ModelConfig c = tiny();
  c.arch = "gpt2";
  EXPECT_THROW(ModuleModel::check(c, Policy::parse("none")), Error);
}

}  // namespace
}  // namespace remat
