// The memory model against the tracker: a real training step (forward, backward, Adam) measured
// byte for byte, for every block kind and policy, with dropout where the kind has it.
#include "remat/memory_model.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "core/shard.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

using Measured = testing::MeasuredStep;

Measured measure(const ModelConfig& c, const ResolvedPolicy& policy) { return testing::measure_step(c, policy); }

void expect_equal(const ModelConfig& c, const std::string& p) {
  const ResolvedPolicy policy = Policy::parse(p).resolve(make_block(c), c.layers);
  const StepMemory predicted = simulate_memory(c, policy, current_threads());
  const Measured m = measure(c, policy);
  EXPECT_EQ(predicted.base(), m.base) << c.arch << " " << p;
  EXPECT_EQ(predicted.saved, m.saved) << c.arch << " " << p;
  EXPECT_EQ(predicted.peak, m.peak) << c.arch << " " << p << " (peak at " << predicted.peak_at << ")";
}

class MemoryModelKinds : public ::testing::TestWithParam<testing::EngineCase> {
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

TEST_P(MemoryModelKinds, EqualsTheTrackerToTheByte) {
  for (const char* p : {"none", "full", "mlp-act", "mlp", "every:2", "layers:0=full,3=mlp-act"}) expect_equal(cfg(), p);
  // uniform:N segments: whole, one short one at the end, and one holding every layer.
  for (const char* p : {"uniform:2", "uniform:3", "uniform:4"}) expect_equal(cfg(), p);
  // The presets a kind has only when it has the tensors they name (attention's, the experts').
  for (const char* p : {"attn", "layers:0=full,3=attn", "norm", "norm+mlp", "moe-act", "moe", "shared", "moe-act+attn"})
    if (has(p)) expect_equal(cfg(), p);
}

// The same with every recompute at the start of a layer's backward (GPU frameworks' order) and
// with torchtitan's op mode, which holds outputs no backward reads until the backward begins.
TEST_P(MemoryModelKinds, EqualsTheTrackerWithEagerRecomputeAndHeldTensors) {
  const ModelConfig c = cfg();
  for (const char* p : {"full", "mlp", "torchtitan-op"}) {
    ResolvedPolicy policy = Policy::parse(p).resolve(make_block(c), c.layers);
    for (bool eager : {false, true}) {
      for (LayerPolicy& l : policy.layers) l.eager = eager;
      const StepMemory predicted =
          simulate_memory(compile_step(std::make_shared<const ModelSpec>(make_model(c)), policy), current_threads());
      const Measured m = measure(c, policy);
      EXPECT_EQ(predicted.saved, m.saved) << GetParam().name << " " << p << (eager ? " eager" : "");
      EXPECT_EQ(predicted.peak, m.peak) << GetParam().name << " " << p << (eager ? " eager" : "");
    }
  }
}

TEST_P(MemoryModelKinds, EqualsTheTrackerForRandomPerTensorPolicies) {
  const ModelConfig c = cfg();
  const BlockSpec b = make_block(c);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 6; ++trial) {
    std::string p = "layers:";
    for (int64_t l = 0; l < c.layers; ++l) {
      std::string names;
      for (int t : b.choosable())
        if (rng() % 2) names += (names.empty() ? "" : ",") + b.tensors[t].name;
      p += fmt::format("{}{}={}", l ? "," : "", l, names.empty() ? "none" : "drop:" + names);
    }
    expect_equal(c, p);
  }
}

// A wide vocabulary and few layers put the step's peak in the loss backward, where the
// cross-entropy's temporaries are; an odd length makes the causal row blocks uneven.
TEST_P(MemoryModelKinds, EqualsTheTrackerWhenThePeakIsInTheLoss) {
  if (GetParam().name == "seed") GTEST_SKIP() << "the seed head is an MSE of the block output";
  ModelConfig c = cfg();
  c.layers = 2;
  c.vocab = 512;
  c.seq = 33;
  if (c.arch == "moe") c.experts = 2, c.top_k = 1, c.ffn = 16;  // else the experts' weight gradients outweigh it
  const StepMemory m = simulate_memory(c, Policy::parse("full").resolve(make_block(c), c.layers), current_threads());
  // (Flash attention's tiles of 128 x 128 outweigh a model this small: there the peak is theirs;
  // the chunked loss never holds a whole logits tensor: that is what it is for.)
  if (c.attention == AttentionImpl::Math && resolved_loss(c) != Loss::Chunked) {
    EXPECT_NE(m.peak_at.find("backward of the head, op 'loss'"), std::string::npos) << m.peak_at;
  }
  for (const char* p : {"none", "full", "uniform:2"}) expect_equal(c, p);
}

// A wide vocabulary and a short batch put it where autograd sums the tied embedding's gradients.
TEST_P(MemoryModelKinds, EqualsTheTrackerWhenThePeakIsTheTiedGradientSum) {
  ModelConfig c = cfg();
  c.layers = 2;
  c.vocab = 512;
  c.seq = 9;
  bool tied = false;
  for (const ParamSpec& p : make_model(c).head.params) tied = tied || !p.tied_to.empty();
  if (!tied) GTEST_SKIP() << GetParam().name << " has no tied parameter";
  const StepMemory m = simulate_memory(c, Policy::parse("full").resolve(make_block(c), c.layers), current_threads());
  if (c.attention == AttentionImpl::Math) {
    EXPECT_NE(m.peak_at.find("summing a tied parameter's gradients"), std::string::npos) << m.peak_at;
  }
  for (const char* p : {"none", "full"}) expect_equal(c, p);
}

INSTANTIATE_TEST_SUITE_P(Kinds, MemoryModelKinds, ::testing::ValuesIn(testing::engine_cases()),
                         [](const auto& info) { return info.param.name; });

// The trainer's step with gradient accumulation: micro-batches after the first add into .grad (a
// uniform:N segment hands autograd its layers' gradients together, as it returns).
TEST_P(MemoryModelKinds, EqualsTheTrackerWithGradientAccumulation) {
  const ModelConfig c = cfg();
  for (const char* p : {"none", "full", "uniform:2"}) {
    if (!has(p)) continue;
    const ResolvedPolicy policy = Policy::parse(p).resolve(make_block(c), c.layers);
    at::manual_seed(1);
    GPT model(c, policy);
    std::vector<at::Tensor> params = model->parameters();
    ShardedAdam adam(params, model->decays(), AdamOptions{1e-3}, 0, [&] {
      int64_t n = 0;
      for (const at::Tensor& t : params) n += t.numel();
      return n;
    }());
    const int64_t before = MemoryTracker::live();
    MemoryTracker::reset_peak();
    for (int micro = 0; micro < 3; ++micro) {
      at::manual_seed(2 + micro);
      auto [input, target] = random_batch(c);
      at::Tensor loss = model->forward(input, target) / 3.0;
      loss.backward();
    }
    std::vector<at::Tensor> grads;
    for (const at::Tensor& t : params) grads.push_back(t.grad());
    adam.step(grads);
    const int64_t measured = MemoryTracker::peak() - before;
    StepShape shape;
    shape.micro = 3;
    shape.scaled_loss = true;
    const StepMemory predicted = simulate_memory(model->compiled_step(), current_threads(), nullptr, shape);
    // `before` holds weights and moments; the data of each micro-batch comes within the step.
    EXPECT_EQ(predicted.peak + predicted.data, measured)
        << GetParam().name << " " << p << " (peak at " << predicted.peak_at << ")";
  }
}

TEST(MemoryModel, Gpt2SpecificPins) {
  expect_equal(tiny("gpt2", 0.1), "save:x2");
  expect_equal(tiny("gpt2", 0.1), "drop:probs_drop,ln1_rstd");
}

// FSDP2 (StepShape::fsdp, NOTE [FSDP2]) on one rank of a two-layer bf16 llama, replayed as the
// planner does (gradients handed to FSDP, not kept as .grad).
ModelConfig fsdp_llama(int64_t dim, int64_t seq, int64_t vocab) {
  ModelConfig c;
  c.arch = "llama", c.layers = 2, c.dim = dim, c.heads = 4, c.batch = 1, c.seq = seq, c.vocab = vocab;
  c.dtype = DType::BF16;
  c.loss = Loss::Upcast;  // torchtitan's: the bf16 logits cast to fp32 for the loss
  return c;
}

StepMemory fsdp_step(const ModelConfig& c, bool fsdp, void (*set)(StepShape&) = nullptr) {
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  StepShape s;
  s.fsdp = fsdp;
  s.grad_buffers = true;
  if (set) set(s);
  return simulate_memory(compile_step(spec, Policy::parse("none").resolve(spec->block, c.layers)), {1, 1}, nullptr, s);
}

int64_t half_weights(const BlockSpec& b) {  // a stage's bf16 weights, as FSDP2 gathers them
  int64_t n = 0;
  for (size_t k = 0; k < b.params.size(); ++k) n += b.param_bytes(static_cast<int>(k));
  return n;
}

// When the forward returns, only the activations are alive: every block resharded after its
// forward, the root (embedding, final norm, head) resharded by its post-forward, and the last
// all-gather buffer freed there. torchtitan's last block stays gathered; before PyTorch 2.8 the
// root did too.
TEST(Fsdp, AfterTheForwardOnlyWhatTheHooksKeepIsGathered) {
  const ModelConfig c = fsdp_llama(64, 16, 512);
  const ModelSpec spec = make_model(c);
  const int64_t activations = fsdp_step(c, false).saved;
  EXPECT_EQ(fsdp_step(c, true).saved, activations);
  EXPECT_EQ(fsdp_step(c, true, [](StepShape& s) { s.fsdp_keep_last = true; }).saved,
            activations + half_weights(spec.block));
  EXPECT_EQ(fsdp_step(c, true, [](StepShape& s) { s.fsdp_root_reshard = false; }).saved,
            activations + half_weights(spec.stem) + half_weights(spec.head));
}

// The root gathers a weight the embedding and the head share (a tied head) once.
TEST(Fsdp, TheRootGathersATiedWeightOnce) {
  ModelConfig c = fsdp_llama(64, 16, 512);
  c.tied = Switch::On;
  const ModelSpec spec = make_model(c);
  const int64_t activations = fsdp_step(c, false).saved;
  EXPECT_EQ(fsdp_step(c, true, [](StepShape& s) { s.fsdp_root_reshard = false; }).saved,
            activations + half_weights(spec.stem) + half_weights(spec.head) - 512 * 64 * 2);
}

// A resharded root is gathered again for the head's backward once the loss's backward is done:
// at the loss's peak (a large vocabulary makes it the step's) the root's weights are not alive,
// and a kept root adds exactly its bytes there.
TEST(Fsdp, TheRootIsGatheredForTheHeadAfterTheLossBackward) {
  const ModelConfig c = fsdp_llama(64, 256, 4096);
  const ModelSpec spec = make_model(c);
  const StepMemory resharded = fsdp_step(c, true);
  const StepMemory kept = fsdp_step(c, true, [](StepShape& s) { s.fsdp_root_reshard = false; });
  EXPECT_EQ(resharded.peak_at, "backward of the head, op 'loss'");
  EXPECT_EQ(kept.peak_at, resharded.peak_at);
  EXPECT_EQ(kept.peak - resharded.peak, half_weights(spec.stem) + half_weights(spec.head));
}

// foreach Adam's step (torch.optim.AdamW as torchtitan runs it) holds, above what a step starts
// with, the fp32 sharded gradients (4 bytes a parameter on one rank) and sqrt(v) of every
// parameter (4 more): with small activations and eight units it is the step's peak (a unit's
// backward holds about 8 bytes for each of its parameters), 8 bytes a parameter.
TEST(Fsdp, ForeachAdamHoldsTheGradientsAndSqrtVOfEveryParameter) {
  ModelConfig c = fsdp_llama(256, 4, 256);
  c.layers = 8;
  const int64_t n = make_model(c).param_numel();
  const StepMemory m = fsdp_step(c, true, [](StepShape& s) { s.foreach_adam = true; });
  EXPECT_EQ(m.peak, 8 * n);
  EXPECT_EQ(m.peak_at, "optimizer step (foreach Adam's sqrt(v) of every parameter)");
  EXPECT_LT(fsdp_step(c, true).peak, 8 * n);
}

// Micro-batches accumulated under FSDP2: the first backward makes the sharded gradients, and every
// later micro-batch's forward and backward run beside them. The replay keeps enough micro-batches
// to see that: the same peak as replaying every op of every micro-batch.
TEST(MemoryModel, FsdpAccumulationPeaksAsReplayingEveryMicroBatch) {
  const ModelConfig c = fsdp_llama(64, 16, 512);
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  const CompiledStep plan = compile_step(spec, Policy::parse("none").resolve(spec->block, c.layers));
  for (int micro : {2, 3, 6}) {
    StepShape s;
    s.fsdp = true, s.grad_buffers = true, s.world = 2, s.micro = micro, s.scaled_loss = true;
    const StepMemory folded = simulate_memory(plan, {1, 1}, nullptr, s);
    s.op_by_op = true;
    const StepMemory all = simulate_memory(plan, {1, 1}, nullptr, s);
    EXPECT_EQ(folded.total_peak(), all.total_peak()) << micro << " micro-batches";
    EXPECT_EQ(folded.peak_at, all.peak_at) << micro << " micro-batches";
  }
}

// Adam's traffic is adam_bytes_per_param of each parameter the rank updates: fp32 28 bytes; bf16
// with fp32 gradient buffers and master weights 30 (the bf16 copy written too), over this rank's
// share under ZeRO-1; pure bf16 (weights, gradients and moments in bf16) 14; FSDP's fp32 shards 28.
TEST(MemoryModel, AdamMovesItsBytesPerParameterOfWhatTheRankUpdates) {
  ModelConfig c = fsdp_llama(64, 16, 512);
  auto step = [&](DType dtype, const std::function<void(StepShape&)>& set) {
    c.dtype = dtype;
    auto spec = std::make_shared<const ModelSpec>(make_model(c));
    StepShape s;
    set(s);
    return simulate_memory(compile_step(spec, Policy::parse("none").resolve(spec->block, c.layers)), {1, 1}, nullptr,
                           s);
  };
  const int64_t n = make_model(c).param_numel();
  const int64_t first_share = shard_first(n, 1, 4);  // rank 0's of 4
  EXPECT_EQ(step(DType::F32, [](StepShape&) {}).optimizer_traffic, 28 * n);
  auto megatron = [](StepShape& s) { s.grad_buffers = true, s.grad_bytes = 4; };
  EXPECT_EQ(step(DType::BF16, megatron).optimizer_traffic, 30 * n);
  EXPECT_EQ(step(DType::BF16, [&](StepShape& s) { megatron(s), s.world = 4, s.zero = 1; }).optimizer_traffic,
            30 * first_share);
  EXPECT_EQ(step(DType::BF16, [](StepShape& s) { s.pure_dtype = true; }).optimizer_traffic, 14 * n);
  EXPECT_EQ(step(DType::BF16, [](StepShape& s) { s.fsdp = true, s.world = 4; }).optimizer_traffic, 28 * first_share);
}

// The allocator replay (StepShape::cuda) keeps the optimizer state persistent_memory counts: a
// routed expert's fp32 master copy and Adam moments sharded over the ranks that hold the expert
// (expert_world), the rest over the world. ZeRO-1 on 4 ranks: with 2 ranks per expert instead of
// 4, the replay's allocated peak grows by what the optimizer state grows, to the byte.
TEST(MemoryModel, TheAllocatorReplayShardsExpertStateOverTheirRanks) {
  ModelConfig c;
  c.arch = "moe", c.layers = 2, c.dim = 64, c.heads = 4, c.batch = 2, c.seq = 64, c.vocab = 256, c.ffn = 128;
  c.experts = 4, c.top_k = 2, c.dtype = DType::BF16;
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  const CompiledStep plan = compile_step(spec, Policy::parse("none").resolve(spec->block, c.layers));
  auto step = [&](int expert_world) {
    StepShape s;
    s.world = 4, s.zero = 1, s.expert_world = expert_world, s.grad_buffers = true, s.cuda = true;
    return simulate_memory(plan, {1, 1}, nullptr, s);
  };
  const StepMemory all = step(4), pairs = step(2);
  ASSERT_GT(pairs.optimizer, all.optimizer);
  EXPECT_EQ(pairs.allocated_peak - all.allocated_peak, pairs.optimizer - all.optimizer);
}

}  // namespace
}  // namespace remat
