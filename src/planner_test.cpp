#include "remat/planner.h"

#include <gtest/gtest.h>

#include <random>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/optim.h"

namespace remat {
namespace {

ModelConfig tiny(Arch arch, double dropout = 0.0) {
  ModelConfig c;
  c.arch = arch;
  c.layers = 4; c.dim = 16; c.heads = 4; c.batch = 2; c.seq = 8; c.vocab = 11; c.dropout = dropout;
  c.attn_block = 4;
  return c;
}

// A cost model where every op costs its matmul FLOPs plus one unit per tensor byte: deterministic.
CostModel unit_costs(const ModelSpec& spec) { return estimate_costs(spec, MachineRates{1.0, 1.0}); }

struct Measured {
  int64_t base = 0, saved = 0, peak = 0;
};

// One real training step (forward, backward, Adam) measured by the tracker.
Measured measure(const ModelConfig& c, const std::string& policy) {
  Measured m;
  const int64_t empty = MemoryTracker::live();
  at::manual_seed(1);
  GPT model(c, Policy::parse(policy));
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

TEST(MemoryModel, EqualsTheTrackerToTheByte) {
  for (Arch arch : {Arch::Gpt2, Arch::Seed}) {
    const ModelConfig c = tiny(arch, arch == Arch::Gpt2 ? 0.1 : 0.0);
    const ModelSpec spec = make_model(c);
    std::vector<std::string> policies = {"none", "full", "attn", "mlp-act", "every:2", "layers:0=full,3=attn"};
    if (arch == Arch::Gpt2) policies.insert(policies.end(), {"norm+mlp", "save:x2", "drop:probs_drop,ln1_rstd"});
    for (const std::string& p : policies) {
      const StepMemory predicted = simulate_memory(c, spec, Policy::parse(p).resolve(spec.block, c.layers));
      const Measured m = measure(c, p);
      EXPECT_EQ(predicted.base(), m.base) << to_string(arch) << " " << p;
      EXPECT_EQ(predicted.saved, m.saved) << to_string(arch) << " " << p;
      EXPECT_EQ(predicted.peak, m.peak) << to_string(arch) << " " << p << " (peak at " << predicted.peak_at << ")";
    }
  }
}

TEST(MemoryModel, EqualsTheTrackerForRandomPerTensorPolicies) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 6; ++trial) {
    std::string p = "layers:";
    for (int64_t l = 0; l < c.layers; ++l) {
      std::string names;
      for (int t : spec.block.choosable())
        if (rng() % 2) names += (names.empty() ? "" : ",") + spec.block.tensors[t].name;
      p += fmt::format("{}{}={}", l ? "," : "", l, names.empty() ? "none" : "drop:" + names);
    }
    const StepMemory predicted = simulate_memory(c, spec, Policy::parse(p).resolve(spec.block, c.layers));
    const Measured m = measure(c, p);
    EXPECT_EQ(predicted.peak, m.peak) << p;
    EXPECT_EQ(predicted.saved, m.saved) << p;
  }
}

TEST(Frontier, EqualsBruteForce) {
  for (double dropout : {0.0, 0.1}) {
    const ModelConfig c = tiny(Arch::Gpt2, dropout);
    const ModelSpec spec = make_model(c);
    const CostModel costs = unit_costs(spec);
    const LayerPolicy pins = Policy::parse("none").resolve(spec.block, 1).layers[0];
    const auto fast = block_frontier(spec.block, costs, pins);
    const auto brute = block_frontier_brute_force(spec.block, costs, pins);
    ASSERT_EQ(fast.size(), brute.size()) << "dropout " << dropout;
    for (size_t i = 0; i < fast.size(); ++i) {
      EXPECT_EQ(fast[i].saved, brute[i].saved);
      EXPECT_EQ(fast[i].recompute_ms, brute[i].recompute_ms);
      EXPECT_EQ(fast[i].backward_extra, brute[i].backward_extra);
    }
  }
}

TEST(Frontier, SpansNoneToTheLeastMemory) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  const LayerPolicy pins = Policy::parse("none").resolve(spec.block, 1).layers[0];
  const auto front = block_frontier(spec.block, unit_costs(spec), pins);
  EXPECT_EQ(front.front().text, "none");
  EXPECT_EQ(front.front().recompute_ms, 0.0);
  for (size_t i = 1; i < front.size(); ++i) EXPECT_LE(front[i].saved, front[i - 1].saved);
}

TEST(Plan, FitsTheBudgetOrNamesTheMinimum) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const LayerPolicy pins = Policy::parse("none").resolve(spec.block, 1).layers[0];
  const Plan none = make_plan(c, Budget{0, 100.0}, costs, pins);
  ASSERT_TRUE(none.fits);
  EXPECT_EQ(none.step_ms, none.none_step_ms);  // 100% of none's peak: nothing to recompute
  for (double pct : {95.0, 85.0, 75.0}) {
    const Plan p = make_plan(c, Budget{0, pct}, costs, pins);
    if (!p.fits) continue;
    EXPECT_LE(p.memory.total_peak(), p.budget) << pct;
    const StepMemory check = simulate_memory(c, spec, p.policy);
    EXPECT_EQ(check.total_peak(), p.memory.total_peak());
  }
  const Plan tight = make_plan(c, Budget{none.none_memory.base() + 1, 0}, costs, pins);
  EXPECT_FALSE(tight.fits);
  EXPECT_GT(tight.min_budget, tight.budget);
  EXPECT_TRUE(make_plan(c, Budget{tight.min_budget, 0}, costs, pins).fits);
}

TEST(Plan, StepTimeNeverGrowsWithTheBudget) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const LayerPolicy pins = Policy::parse("none").resolve(spec.block, 1).layers[0];
  const Planner planner(c, costs, pins);
  const Plan least = planner.plan(Budget{planner.none_memory().base() + 1, 0});
  double last = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= 20; ++i) {
    const int64_t b = least.min_budget + (planner.none_memory().total_peak() - least.min_budget) * i / 20;
    const Plan p = planner.plan(Budget{b, 0});
    ASSERT_TRUE(p.fits) << b;
    EXPECT_LE(p.step_ms, last) << b;
    last = p.step_ms;
  }
}

TEST(Plan, PinsAreKept) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  Plan plan;
  const ResolvedPolicy r = resolve_policy(c, Policy::parse("budget:90%+keep:probs+drop:fc"), costs, &plan);
  for (const LayerPolicy& lp : r.layers) {
    EXPECT_TRUE(lp.saves(spec.block.find("probs")));
    EXPECT_FALSE(lp.saves(spec.block.find("fc")));
  }
  EXPECT_LE(plan.memory.total_peak(), plan.budget);
}

TEST(Plan, PercentagesAreOfNoneWithoutThePins) {
  const ModelConfig c = tiny(Arch::Gpt2, 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const Planner plain(c, costs, Policy::parse("none").resolve(spec.block, 1).layers[0]);
  const Planner pinned(c, costs, Policy::parse("drop:probs,fc").resolve(spec.block, 1).layers[0]);
  EXPECT_EQ(pinned.none_memory().total_peak(), plain.none_memory().total_peak());
  EXPECT_EQ(pinned.plan(Budget{0, 80.0}).budget, plain.plan(Budget{0, 80.0}).budget);
}

TEST(Plan, RefusesWithTheSmallestBudget) {
  const ModelConfig c = tiny(Arch::Gpt2);
  try {
    resolve_policy(c, Policy::parse("budget:1KiB"), unit_costs(make_model(c)));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("budget 1KiB (1.0 KiB) cannot be met: the smallest peak any policy reaches is"),
              std::string::npos)
        << e.what();
  }
}

// Korthikanti et al. 2022, Table 2: activation bytes per layer of a GPT block in fp16 with
// dropout and unfused attention: sbh(34 + 5as/h) with nothing recomputed, 34sbh with selective
// (core attention) recompute, 2sbh with full recompute. The paper leaves out the LayerNorm
// statistics (two fp32 numbers per token per norm); they are subtracted here.
TEST(Table2, ReproducesKorthikanti) {
  ModelConfig c;
  c.arch = Arch::Gpt2;
  c.dtype = DType::F16;
  c.dropout = 0.1;
  c.layers = 2; c.dim = 64; c.heads = 4; c.batch = 3; c.seq = 32;
  c.attn_block = c.seq;  // unfused attention: the full T x T
  const BlockSpec b = make_block(c);
  const int64_t s = c.seq, bt = c.batch, h = c.dim, a = c.heads;
  const int64_t stats = 2 * 2 * s * bt * 4;
  const int64_t x = b.tensors[b.inputs[0]].bytes();  // the layer input, kept by every policy
  auto per_layer = [&](const char* policy) {
    const Schedule sch = compile_schedule(b, Policy::parse(policy).resolve(b, 1).layers[0]);
    return sch.saved_bytes(b) + x - (sch.saved[b.find("ln1_mean")] ? stats : 0);
  };
  EXPECT_EQ(per_layer("none"), s * bt * h * 34 + 5 * a * s * s * bt);
  EXPECT_EQ(per_layer("attn"), 34 * s * bt * h);
  EXPECT_EQ(per_layer("full"), 2 * s * bt * h);
}

TEST(Budget, ParsesSizesAndPercentages) {
  EXPECT_EQ(parse_budget("300MiB").bytes, 300LL << 20);
  EXPECT_EQ(parse_budget("2GB").bytes, 2000000000LL);
  EXPECT_EQ(parse_budget("1.5GiB").bytes, 3LL << 29);
  EXPECT_EQ(parse_budget("4096").bytes, 4096);
  EXPECT_EQ(parse_budget("60%").percent, 60.0);
  for (const char* bad : {"", "300XB", "-5MB", "abc", "0GB", "1.2.3GB"}) EXPECT_THROW(parse_budget(bad), Error) << bad;
}

TEST(Budget, PolicyTakesOnlyPins) {
  EXPECT_EQ(Policy::parse("budget:300MiB+keep:qkv").budget(), "300MiB");
  EXPECT_THROW(Policy::parse("budget:"), Error);
  EXPECT_THROW(Policy::parse("budget:1GB+attn"), Error);
  EXPECT_THROW(Policy::parse("budget:1GB").resolve(make_block(tiny(Arch::Gpt2)), 4), Error);
}

TEST(Plan, AnswersForGpt3Shapes) {
  ModelConfig c;
  c.arch = Arch::Gpt2;
  c.layers = 96; c.dim = 12288; c.heads = 96; c.batch = 1; c.seq = 2048; c.vocab = 50257;
  c.dtype = DType::F16; c.dropout = 0.1;
  const ModelSpec spec = make_model(c);
  const CostModel costs = estimate_costs(spec, MachineRates{180, 20});
  const LayerPolicy pins = Policy::parse("none").resolve(spec.block, 1).layers[0];
  const Plan p = make_plan(c, parse_budget("80GB"), costs, pins);
  EXPECT_FALSE(p.fits);                         // 175B parameters do not fit one 80 GB device
  EXPECT_GT(p.min_budget, 170'000'000'000LL * 16);  // 174.6B parameters at 16 B (weights, grads, Adam)
}

}  // namespace
}  // namespace remat
