// Flash attention on the engine: the same function as math attention, its own promise (every
// policy gives flash none's bits), bits that do not depend on the thread count, and masks that are
// math attention's.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "ops/kernels.h"
#include "remat/memory.h"
#include "remat/memory_model.h"
#include "remat/model.h"
#include "test_util.h"
#include "util/parallel_testing.h"

namespace remat {
namespace {

// Three tiles of 128 query rows, the last one ragged; dropout on.
ModelConfig config(const std::string& kind, AttentionImpl attention) {
  ModelConfig c = testing::tiny(kind, 0.1);
  c.layers = 2;
  c.dim = 32;
  c.heads = 4;
  c.seq = 300;
  c.attn_block = 128;
  c.attention = attention;
  if (kind == "llama") c.kv_heads = 2;
  return c;
}

struct Outcome {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
  int64_t saved = 0, peak = 0;
  StepMemory predicted;
};

Outcome run(const ModelConfig& c, const std::string& policy) {
  at::manual_seed(1);
  GPT model(c, Policy::parse(policy));
  at::manual_seed(2);
  auto [input, target] = random_batch(c);
  at::manual_seed(3);
  Outcome r;
  const int64_t before = MemoryTracker::live();
  MemoryTracker::reset_peak();
  r.loss = model->forward(input, target);
  r.saved = MemoryTracker::live() - before;
  r.loss.backward();
  r.peak = MemoryTracker::peak() - before;
  for (const at::Tensor& p : model->parameters()) r.grads.push_back(p.grad());
  if (model->compiled_step().segment == 0) r.predicted = simulate_memory(model->compiled_step(), current_threads());
  return r;
}

// Flash sums in another order (an online softmax over tiles of 128 keys, rescaled as the row
// maximum grows): float32 results differ from math attention's by rounding, a few ulps per tile
// and per layer. 2e-5 of the largest value bounds that here with room; a wrong mask, scale or
// causal edge is off by orders of magnitude more.
TEST(Flash, ComputesMathAttentionsFunctionUnderDropout) {
  for (const char* kind : {"gpt2", "llama"}) {
    const Outcome math = run(config(kind, AttentionImpl::Math), "none");
    const Outcome flash = run(config(kind, AttentionImpl::Flash), "none");
    EXPECT_TRUE(testing::close(flash.loss, math.loss, 2e-5)) << kind;
    ASSERT_EQ(flash.grads.size(), math.grads.size());
    for (size_t i = 0; i < math.grads.size(); ++i)
      EXPECT_TRUE(testing::close(flash.grads[i], math.grads[i], 2e-5)) << kind << ": parameter " << i;
  }
}

TEST(Flash, RecomputeGivesFlashNonesBits) {
  for (const char* kind : {"gpt2", "llama"}) {
    const ModelConfig c = config(kind, AttentionImpl::Flash);
    const Outcome none = run(c, "none");
    for (const char* p : {"full", "mlp-act", "norm", "every:2", "uniform:2"}) {
      const Outcome r = run(c, p);
      ASSERT_EQ(r.grads.size(), none.grads.size()) << kind << " " << p;
      for (size_t i = 0; i < none.grads.size(); ++i)
        EXPECT_TRUE(testing::bitwise_equal(r.grads[i], none.grads[i])) << kind << " " << p << ": parameter " << i;
    }
  }
}

TEST(Flash, KeepsNoTxTTensorAndPredictsItsTilesToTheByte) {
  for (const char* kind : {"gpt2", "llama"}) {
    const Outcome math = run(config(kind, AttentionImpl::Math), "none");
    const Outcome flash = run(config(kind, AttentionImpl::Flash), "none");
    EXPECT_EQ(flash.saved, flash.predicted.saved) << kind;
    EXPECT_EQ(flash.peak, flash.predicted.peak) << kind << " (peak at " << flash.predicted.peak_at << ")";
    EXPECT_LT(flash.saved, math.saved / 2) << kind;
  }
}

TEST(Flash, BitsDoNotDependOnTheThreadCount) {
  const ModelConfig c = config("llama", AttentionImpl::Flash);
  auto on = [&](int threads) {
    const detail::KernelThreads scope(threads);
    return run(c, "none");
  };
  const Outcome one = on(1), two = on(2);
  for (size_t i = 0; i < one.grads.size(); ++i)
    EXPECT_TRUE(testing::bitwise_equal(two.grads[i], one.grads[i])) << "parameter " << i;
}

// A tile's mask, regenerated in the forward, the backward and any recompute, is the slice of the
// whole mask that dropout_mask would have stored, across the 2^32-element re-keying boundary too.
TEST(Flash, TileMasksAreSlicesOfTheWholeMask) {
  const int64_t n = 300000;
  at::Tensor whole = at::empty({n}, at::kBool);
  ops::kernels::dropout_mask(whole.data_ptr<bool>(), n, 0.1, 42);
  for (int64_t first : {0, 1, 4095, 65535, 123457}) {
    at::Tensor tile = at::empty({200}, at::kByte);
    ops::kernels::dropout_keep(tile.data_ptr<uint8_t>(), first, 200, 0.1, 42);
    EXPECT_TRUE(at::equal(tile.to(at::kBool), whole.narrow(0, first, 200))) << first;
  }
  const int64_t edge = int64_t{1} << 32;
  at::Tensor across = at::empty({20}, at::kByte), halves = at::empty({20}, at::kByte);
  ops::kernels::dropout_keep(across.data_ptr<uint8_t>(), edge - 10, 20, 0.5, 7);
  ops::kernels::dropout_keep(halves.data_ptr<uint8_t>(), edge - 10, 10, 0.5, 7);
  ops::kernels::dropout_keep(halves.data_ptr<uint8_t>() + 10, edge, 10, 0.5, 7);
  EXPECT_TRUE(at::equal(across, halves));
}

}  // namespace
}  // namespace remat
