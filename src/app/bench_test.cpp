// remat bench as a library call: what a row of the engine carries besides its times.
#include "app/bench.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace remat {
namespace {

// The predictions beside the rows come from one layer timed in the same rounds as the rows (a
// shared machine drifts by tens of percent between runs), not from costs taken before the run.
TEST(Bench, PredictsEveryEngineRowFromCostsTimedInItsRounds) {
  BenchOptions o;
  o.model = testing::tiny("gpt2", 0.1);
  o.engines = {Engine::Ops};
  o.policies = {"none", "full", "budget:90%"};
  o.steps = 2;
  o.warmup = 0;
  const BenchResult r = run_bench(o);
  EXPECT_NE(r.costs_in_run.find("median of 2 steps"), std::string::npos) << r.costs_in_run;
  ASSERT_EQ(r.rows.size(), 3u);
  for (const BenchRow& row : r.rows) EXPECT_GT(row.predicted_step_ms, 0) << row.policy;
  EXPECT_NE(r.markdown().find("taken in the same rounds as the rows"), std::string::npos);
}

}  // namespace
}  // namespace remat
