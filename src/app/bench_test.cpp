// remat bench as a library call: what a row of the engine carries besides its times.
#include "app/bench.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/memory.h"
#include "remat/version.h"
#include "test_util.h"
#include "util/cache.h"
#include "util/gemm.h"
#include "util/gemm_testing.h"
#include "util/timing.h"

namespace remat {
namespace {

// The predictions beside the rows come from one layer timed in the same rounds as the rows (a
// shared machine drifts by tens of percent between runs), not from costs taken before the run:
// one step of the layer per layer of the rows, in every round.
TEST(Bench, PredictsEveryEngineRowFromCostsTimedInItsRounds) {
  BenchOptions o;
  o.model = testing::tiny("gpt2", 0.1);
  o.engines = {Engine::Ops};
  o.policies = {"none", "full", "budget:90%"};
  o.steps = 2;
  o.warmup = 0;
  const BenchResult r = run_bench(o);
  const std::string probed = fmt::format("median of {} steps", o.steps * o.model.layers);
  EXPECT_NE(r.costs_in_run.find(probed), std::string::npos) << r.costs_in_run;
  ASSERT_EQ(r.rows.size(), 3u);
  for (const BenchRow& row : r.rows) EXPECT_GT(row.predicted_step_ms, 0) << row.policy;
  EXPECT_NE(r.markdown().find("taken in the same rounds as the rows"), std::string::npos);
}

// A tiny GPT-2 on the engine, `rounds` timed rounds and no warm-up.
BenchResult run_rounds(int rounds, std::vector<std::string> policies = {"none"}) {
  BenchOptions o;
  o.model = testing::tiny("gpt2", 0.0);
  o.engines = {Engine::Ops};
  o.policies = std::move(policies);
  o.steps = rounds;
  o.warmup = 0;
  return run_bench(o);
}

// The floor's rate is sampled before every timed step of every row: a round's rate is the median
// of its rows' samples, the floor's the median of all samples.
TEST(Bench, SamplesTheMatmulRateBesideEveryStep) {
  const BenchResult r = run_rounds(3, {"none", "full", "attn"});
  ASSERT_EQ(r.rows.size(), 3u);
  ASSERT_EQ(r.round_gflops.size(), 3u);
  ASSERT_EQ(r.sampled_gflops.size(), 9u);
  for (const BenchRow& row : r.rows) ASSERT_EQ(row.step_gflops.size(), 3u) << row.policy;
  for (size_t i = 0; i < 3; ++i) {
    std::vector<double> round;
    for (const BenchRow& row : r.rows) round.push_back(row.step_gflops[i]);
    EXPECT_EQ(r.round_gflops[i], detail::median(round)) << "round " << i;
  }
  EXPECT_EQ(r.matmul_gflops, detail::median(r.sampled_gflops));
  EXPECT_NE(r.json().find("\"round_gflops\""), std::string::npos);
  EXPECT_NE(r.json().find("\"step_gflops\""), std::string::npos);
}

// A NaN gradient never reads as "no difference": the bench fails a row unless the difference is 0.
TEST(GradDifference, ANanCounts) {
  const at::Tensor x = at::ones({3}), y = at::ones({2});
  at::Tensor bad = y.clone();
  bad[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(grad_difference({x, y}, {x, y}), 0);
  EXPECT_TRUE(std::isnan(grad_difference({x, bad}, {x, y})));
}

// A gradient on one side only is an infinite difference.
TEST(GradDifference, AMissingGradientIsInfinite) {
  const at::Tensor x = at::ones({3});
  EXPECT_TRUE(std::isinf(grad_difference({x, at::Tensor()}, {x, x})));
  EXPECT_TRUE(std::isinf(grad_difference({x}, {x, x})));
}

// The floor is measured on the fastest GEMM the build has, whatever the engine runs: here the
// engine is held to the GEMM a first run measured slower, and the floor is still the fastest's
// (a floor that followed the engine's GEMM would name the slower one).
TEST(Bench, TheFloorIsAtTheFastestGemm) {
  if (!detail::available(detail::GemmImpl::OneDnn)) GTEST_SKIP() << "one GEMM only: nothing to choose between";
  const BenchResult first = run_rounds(1);
  auto rate = [&](const char* gemm) {
    for (const auto& [name, gflops] : first.floor_gemm_rates)
      if (name == gemm) return gflops;
    return 0.0;
  };
  const char* slower = rate("onednn") < rate("blas") ? "onednn" : "blas";
  const detail::GemmTableScope engine_on(slower);
  const BenchResult r = run_rounds(1);
  EXPECT_GE(r.floor_gemm_rates.size(), 2u) << "every GEMM is sampled for the floor";
  const auto best = std::max_element(r.floor_gemm_rates.begin(), r.floor_gemm_rates.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  EXPECT_EQ(r.floor_gemm, best->first);
  EXPECT_DOUBLE_EQ(r.floor_ms, static_cast<double>(r.flops_per_step) / (r.matmul_gflops * 1e9) * 1e3);
  EXPECT_GT(r.peak.gflops, 0);
  EXPECT_NE(r.json().find("\"floor_gemm\""), std::string::npos);
  EXPECT_NE(r.json().find("\"gemm_record\""), std::string::npos);
}

// The floor beside a step is the fastest GEMM there, whichever was ranked first before the steps:
// OpenBLAS's own threads are sampled first (their workers then sleep), and the fastest rate wins.
TEST(Bench, TheFloorBesideAStepIsTheFastestGemmThere) {
  std::vector<std::string> order;
  const std::map<std::string, double> rates = {{"onednn", 210.0}, {"blas", 150.0}, {"blas-threads", 180.0}};
  auto sample = [&](const std::string& g) {
    order.push_back(g);
    return rates.at(g);
  };
  EXPECT_EQ(detail::fastest_gemm_rate({"onednn", "blas", "blas-threads"}, sample), 210.0);
  EXPECT_EQ(order, (std::vector<std::string>{"blas-threads", "onednn", "blas"}));
  order.clear();
  EXPECT_EQ(detail::fastest_gemm_rate({"blas", "blas-threads"}, sample), 180.0);
}

// A results file names what produced it: the remat release and the CPU it ran on.
TEST(Bench, JsonNamesTheReleaseAndTheCpu) {
  const nlohmann::json config = nlohmann::json::parse(run_rounds(1).json())["config"];
  EXPECT_EQ(config.at("remat").get<std::string>(), std::string(version()));
  EXPECT_EQ(config.at("cpu").get<std::string>(), detail::cpu_model());
}

// Beside the median step over the median floor, a row gives the least and greatest ratio of one
// round's step to the floor at that round's rate: the spread a floor target is read against.
TEST(Bench, GivesTheFloorRatioOfEveryRound) {
  const BenchResult r = run_rounds(3);
  ASSERT_EQ(r.rows.size(), 1u);
  const BenchRow& row = r.rows[0];
  ASSERT_EQ(row.step_ms.size(), r.round_gflops.size());
  std::vector<double> ratios;
  for (size_t i = 0; i < row.step_ms.size(); ++i)
    ratios.push_back(row.step_ms[i] / (static_cast<double>(r.flops_per_step) / (r.round_gflops[i] * 1e9) * 1e3));
  EXPECT_DOUBLE_EQ(row.floor_ratio_min, *std::min_element(ratios.begin(), ratios.end()));
  EXPECT_DOUBLE_EQ(row.floor_ratio_max, *std::max_element(ratios.begin(), ratios.end()));
  EXPECT_NE(r.markdown().find(fmt::format("{:.2f}-{:.2f}", row.floor_ratio_min, row.floor_ratio_max)),
            std::string::npos);
  EXPECT_NE(r.json().find("\"floor_ratio_max\""), std::string::npos);
}

// The CLI refuses bad options with check_bench_options before it may start itself again for the
// BLAS kernel: the check must find what run_bench would refuse, without computing anything.
TEST(Bench, CheckRefusesABadPolicyWithoutComputing) {
  MemoryTracker::install();
  BenchOptions o;
  o.model = testing::tiny("gpt2", 0.1);
  o.engines = {Engine::Ops};
  o.policies = {"none", "budget:90%", "attn+mlp-act"};
  MemoryTracker::reset_peak();
  const int64_t live = MemoryTracker::live();
  EXPECT_NO_THROW(check_bench_options(o));
  EXPECT_EQ(MemoryTracker::peak(), live) << "check_bench_options allocated a tensor";
  o.policies = {"none", "bogus"};
  try {
    check_bench_options(o);
    ADD_FAILURE() << "policy 'bogus' accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bogus"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace remat
