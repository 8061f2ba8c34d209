#include "remat/planner.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "remat/costs.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "remat/resolve.h"
#include "remat/runtime.h"
#include "remat/schedule.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

// A cost model where every op costs its matmul FLOPs plus one unit per tensor byte: deterministic.
CostModel unit_costs(const ModelSpec& spec) { return estimate_costs(spec, MachineRates{1.0, 1.0}); }

TEST(Frontier, EqualsBruteForce) {
  for (double dropout : {0.0, 0.1}) {
    const ModelConfig c = tiny("gpt2", dropout);
    const ModelSpec spec = make_model(c);
    const CostModel costs = unit_costs(spec);
    const LayerPolicy pins = keep_everything(spec.block);
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
  const ModelConfig c = tiny("gpt2", 0.1);
  const ModelSpec spec = make_model(c);
  const LayerPolicy pins = keep_everything(spec.block);
  const auto front = block_frontier(spec.block, unit_costs(spec), pins);
  EXPECT_EQ(front.front().text, "none");
  EXPECT_EQ(front.front().recompute_ms, 0.0);
  for (size_t i = 1; i < front.size(); ++i) EXPECT_LE(front[i].saved, front[i - 1].saved);
  // The other end: the least bytes any subset of the searched tensors saves (brute force over
  // every subset) is the frontier's last option.
  int64_t least = front.front().saved;
  for (const BlockOption& o : block_frontier_brute_force(spec.block, unit_costs(spec), pins))
    least = std::min(least, o.saved);
  EXPECT_EQ(front.back().saved, least);
  EXPECT_LT(least, front.front().saved / 4);  // and it is far below none
}

// The per-op times --profile prints are what the step time adds up: each op's forward and
// backward once per layer, and a recompute's forward once per layer that reruns it.
TEST(CostModel, PerOpTimesAreWhatTheStepTimeAddsUp) {
  const ModelConfig c = tiny("gpt2", 0.1);
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  const CostModel costs = unit_costs(*spec);
  const ResolvedPolicy policy = Policy::parse("layers:0=full").resolve(spec->block, c.layers);
  const CompiledStep plan = compile_step(spec, policy);
  const CostModel::OpStepMs t = costs.op_ms(plan);
  ASSERT_EQ(t.forward.size(), costs.block.size());
  double sum = costs.other_ms;
  int recomputed = 0;
  for (size_t op = 0; op < costs.block.size(); ++op) {
    EXPECT_DOUBLE_EQ(t.forward[op], c.layers * costs.block[op].forward_ms) << op;
    EXPECT_DOUBLE_EQ(t.backward[op], c.layers * costs.block[op].backward_ms) << op;
    EXPECT_TRUE(t.recompute[op] == 0.0 || t.recompute[op] == costs.block[op].forward_ms) << op;  // layer 0 only
    recomputed += t.recompute[op] > 0;
    sum += t.forward[op] + t.recompute[op] + t.backward[op];
  }
  EXPECT_GT(recomputed, 0);
  EXPECT_NEAR(costs.step_ms(plan), sum, 1e-9 * sum);
  EXPECT_GT(costs.step_ms(plan), costs.none_step_ms(c.layers));
}

TEST(Plan, FitsTheBudgetOrNamesTheMinimum) {
  const ModelConfig c = tiny("gpt2", 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const LayerPolicy pins = keep_everything(spec.block);
  const Plan none = make_plan(c, Budget{0, 100.0}, costs, pins);
  ASSERT_TRUE(none.fits);
  EXPECT_EQ(none.step_ms, none.none_step_ms);  // 100% of none's peak: nothing to recompute
  for (double pct : {95.0, 85.0, 75.0}) {
    const Plan p = make_plan(c, Budget{0, pct}, costs, pins);
    ASSERT_TRUE(p.fits) << pct;                 // a tiny GPT-2 with dropout has plans well below these
    EXPECT_GT(p.step_ms, none.step_ms) << pct;  // something is recomputed
    // The plan's peak is what a real step under it measures, and within the budget.
    const testing::MeasuredStep m = testing::measure_step(c, p.policy);
    EXPECT_EQ(m.base + m.peak, p.memory.total_peak()) << pct;
    EXPECT_LE(m.base + m.peak, p.budget) << pct;
  }
  const Plan tight = make_plan(c, Budget{none.none_memory.base() + 1, 0}, costs, pins);
  EXPECT_FALSE(tight.fits);
  EXPECT_GT(tight.min_budget, tight.budget);
  EXPECT_TRUE(make_plan(c, Budget{tight.min_budget, 0}, costs, pins).fits);
}

TEST(Plan, StepTimeNeverGrowsWithTheBudget) {
  const ModelConfig c = tiny("gpt2", 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const LayerPolicy pins = keep_everything(spec.block);
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

// The same on the README's GPT-2 (T = 1024, dropout) with fixed rates, where the improvement step
// once stopped after 400 simulations and more budget gave a slower plan.
TEST(Plan, StepTimeNeverGrowsWithTheBudgetOnGpt2) {
  ModelConfig c;
  c.arch = "gpt2", c.layers = 6, c.dim = 512, c.heads = 8, c.seq = 1024, c.batch = 8, c.vocab = 256;
  c.dropout = 0.1;
  MachineRates rates;
  rates.matmul_gflops = 300, rates.memory_gbps = 20;
  const CostModel costs = estimate_costs(make_model(c), rates);
  const Planner planner(c, costs, keep_everything(make_model(c).block));
  const Plan least = planner.plan(Budget{planner.none_memory().base() + 1, 0});
  // Near the minimum, where most moves do not fit, in steps of 64 KiB; then across the range.
  std::vector<int64_t> budgets;
  for (int i = 0; i <= 24; ++i) budgets.push_back(least.min_budget + i * (int64_t{64} << 10));
  for (int i = 1; i <= 16; ++i)
    budgets.push_back(budgets[24] + (planner.none_memory().total_peak() - budgets[24]) * i / 16);
  double last = std::numeric_limits<double>::infinity();
  for (int64_t b : budgets) {
    const Plan p = planner.plan(Budget{b, 0});
    ASSERT_TRUE(p.fits) << b;
    EXPECT_LE(p.step_ms, last) << "budget " << b;
    last = p.step_ms;
  }
}

// A probe's first step warms up and is not counted; the costs it gives are per op of the block,
// and other_ms scales Adam's share to the config's layers.
TEST(LayerProbe, TimesEveryOpAfterItsWarmUp) {
  const ModelConfig c = tiny("gpt2", 0.1);
  LayerProbe probe(c);
  probe.step();
  EXPECT_EQ(probe.rounds(), 0);
  EXPECT_THROW(probe.costs(), Error);
  probe.step();
  probe.step();
  EXPECT_EQ(probe.rounds(), 2);
  const CostModel costs = probe.costs();
  EXPECT_TRUE(costs.measured);
  ASSERT_EQ(costs.block.size(), make_block(c).ops.size());
  for (size_t i = 0; i < costs.block.size(); ++i) EXPECT_GT(costs.block[i].forward_ms, 0) << "op " << i;
  EXPECT_DOUBLE_EQ(costs.other_ms,
                   probe.other_one_layer_ms() + static_cast<double>(c.layers - 1) * probe.adam_block_ms());
}

// Estimated costs come from a calibration measured once per (CPU, BLAS, threads) and reused, so
// one command gives one answer under load; an unreadable calibration is measured again.
TEST(Calibration, IsMeasuredOnceAndReused) {
  const std::string dir = testing::temp_dir("rates");
  const ThreadConfig threads{1, 1};
  const MachineRates first = calibrated_rates(threads, dir);
  EXPECT_GT(first.matmul_gflops, 0);
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  // Planted rates come back: the second call read the file and measured nothing.
  nlohmann::json j = nlohmann::json::parse(std::ifstream(files[0]));
  j["matmul_gflops"] = 123.5;
  j["memory_gbps"] = 4.25;
  std::ofstream(files[0]) << j.dump();
  const MachineRates again = calibrated_rates(threads, dir);
  EXPECT_EQ(again.matmul_gflops, 123.5);
  EXPECT_EQ(again.memory_gbps, 4.25);
  std::ofstream(files[0]) << "{ not json";
  EXPECT_NE(calibrated_rates(threads, dir).matmul_gflops, 123.5);
  EXPECT_EQ(nlohmann::json::accept(std::ifstream(files[0])), true);  // replaced by a good one
  std::filesystem::remove_all(dir);
}

// A cached op profile anyone edited (its op list emptied, a negative time) is measured again, with
// a note in the costs' source; it is never used as it is.
TEST(Calibration, AnEditedProfileIsMeasuredAgain) {
  const std::string dir = testing::temp_dir("costs");
  ModelConfig c;
  c.layers = 2, c.dim = 16, c.heads = 2, c.batch = 2, c.seq = 8;
  const ThreadConfig threads{1, 1};
  const size_t ops = make_model(c).block.ops.size();
  measure_costs(c, threads, 1, dir);
  std::filesystem::path file;
  for (const auto& e : std::filesystem::directory_iterator(dir)) file = e.path();
  for (const char* edit : {"empty", "negative"}) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(file));
    if (std::string(edit) == "empty")
      j["costs"]["block"] = nlohmann::json::array();
    else
      j["costs"]["block"][0][0] = -5.0;
    std::ofstream(file) << j.dump();
    const CostModel again = measure_costs(c, threads, 1, dir);
    EXPECT_EQ(again.block.size(), ops) << edit;
    EXPECT_GE(again.block[0].forward_ms, 0) << edit;
    EXPECT_NE(again.source.find("was unusable"), std::string::npos) << edit << ": " << again.source;
  }
  std::filesystem::remove_all(dir);
}

// When the engine's GEMM is not OpenBLAS, the OpenBLAS kernel remat chose (bench re-executes for
// it, plan does not) does not make another calibration: one machine, one set of rates.
TEST(Calibration, IsSharedAcrossBlasKernelsWhenTheGemmIsNotBlas) {
  if (gemm_uses_blas()) GTEST_SKIP() << "the engine's GEMM is OpenBLAS here: its kernel is part of the rates";
  const std::string dir = testing::temp_dir("rates-kernel");
  const ThreadConfig threads{1, 1};
  const char* was = std::getenv("REMAT_BLAS_NOTE");
  const std::string before = was ? was : "";
  calibrated_rates(threads, dir);
  setenv("REMAT_BLAS_NOTE", "chosen by remat: a test", 1);  // what blas_name() says after a re-exec
  calibrated_rates(threads, dir);
  if (was)
    setenv("REMAT_BLAS_NOTE", before.c_str(), 1);
  else
    unsetenv("REMAT_BLAS_NOTE");
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1u);
  std::filesystem::remove_all(dir);
}

TEST(Plan, PinsAreKept) {
  const ModelConfig c = tiny("gpt2", 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  ResolveOptions o;
  o.given = &costs;
  const Resolution res = resolve_policy(Policy::parse("budget:90%+keep:probs+drop:fc"), c, o);
  const ResolvedPolicy& r = res.policy;
  const Plan& plan = *res.plan;
  for (const LayerPolicy& lp : r.layers) {
    EXPECT_TRUE(lp.saves(spec.block.find("probs")));
    EXPECT_FALSE(lp.saves(spec.block.find("fc")));
  }
  EXPECT_LE(plan.memory.total_peak(), plan.budget);
}

TEST(Plan, PercentagesAreOfNoneWithoutThePins) {
  const ModelConfig c = tiny("gpt2", 0.1);
  const ModelSpec spec = make_model(c);
  const CostModel costs = unit_costs(spec);
  const Planner plain(c, costs, keep_everything(spec.block));
  const Planner pinned(c, costs, Policy::parse("drop:probs,fc").resolve(spec.block, 1).layers[0]);
  EXPECT_EQ(pinned.none_memory().total_peak(), plain.none_memory().total_peak());
  EXPECT_EQ(pinned.plan(Budget{0, 80.0}).budget, plain.plan(Budget{0, 80.0}).budget);
}

TEST(Plan, RefusesWithTheSmallestBudget) {
  const ModelConfig c = tiny("gpt2");
  try {
    const CostModel costs = unit_costs(make_model(c));
    ResolveOptions o;
    o.given = &costs;
    resolve_policy(Policy::parse("budget:1KiB"), c, o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("budget 1.0 KiB cannot be met: the smallest peak any policy reaches is"),
              std::string::npos)
        << e.what();
  }
}

// check_policy refuses exactly what resolve_policy refuses, with its message, and touches no cache
// (it measures nothing).
TEST(Plan, CheckPolicyRefusesWhatResolvingRefuses) {
  const std::string dir = testing::temp_dir("check-policy");
  const char* was = std::getenv("REMAT_CACHE");
  const std::string before = was ? was : "";
  setenv("REMAT_CACHE", dir.c_str(), 1);
  auto error_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  ModelConfig flash = tiny("gpt2");
  flash.attention = AttentionImpl::Flash;
  const std::vector<std::pair<ModelConfig, std::vector<const char*>>> cases = {
      {tiny("gpt2"), {"budget:1KiB", "budget:90%", "budget:90%+drop:nope", "save:nope", "block:9", "none", "attn"}},
      {flash, {"attn", "mlp-act", "budget:1KiB"}}};
  for (const auto& [c, texts] : cases) {
    CostModel costs = unit_costs(make_model(c));
    costs.threads = ThreadConfig{1, 2};  // not the default: flash attention's scratch grows with the threads
    ResolveOptions o;
    o.given = &costs;
    o.threads = costs.threads;
    for (const char* text : texts) {
      const Policy p = Policy::parse(text);
      const std::string resolving = error_of([&] { resolve_policy(p, c, o); });
      EXPECT_EQ(error_of([&] { check_policy(p, c, o.threads); }), resolving) << text;
    }
  }
  if (was)
    setenv("REMAT_CACHE", before.c_str(), 1);
  else
    unsetenv("REMAT_CACHE");
  EXPECT_TRUE(!std::filesystem::exists(dir) || std::filesystem::is_empty(dir));
  std::filesystem::remove_all(dir);
}

TEST(Plan, AnswersForGpt3Shapes) {
  ModelConfig c;
  c.arch = "gpt2";
  c.layers = 96;
  c.dim = 12288;
  c.heads = 96;
  c.batch = 1;
  c.seq = 2048;
  c.vocab = 50257;
  c.dtype = DType::F16;
  c.dropout = 0.1;
  const ModelSpec spec = make_model(c);
  const CostModel costs = estimate_costs(spec, MachineRates{180, 20});
  const LayerPolicy pins = keep_everything(spec.block);
  const Plan p = make_plan(c, parse_budget("80GB"), costs, pins);
  EXPECT_FALSE(p.fits);                             // 175B parameters do not fit one 80 GB device
  EXPECT_GT(p.min_budget, 170'000'000'000LL * 16);  // 174.6B parameters at 16 B (weights, grads, Adam)
}

// Costs are measured only for what the engine runs: a config it refuses (here one that plans a
// GPU framework's unfused ops) is estimated under auto, and refused by name under measured.
TEST(ChooseCosts, AConfigTheEngineDoesNotRunIsEstimated) {
  ModelConfig c = tiny("gpt2");
  c.eager_ops = true;
  const CostModel auto_costs = choose_costs(c, CostSource::Auto, ThreadConfig{1, 1});
  EXPECT_FALSE(auto_costs.measured) << auto_costs.source;
  EXPECT_NE(testing::error_of([&] {
              choose_costs(c, CostSource::Measured, ThreadConfig{1, 1});
            }).find("measured costs need a config the engine runs here: ModelConfig.eager_ops"),
            std::string::npos);
}

}  // namespace
}  // namespace remat
