#include "remat/executor.h"

#include <gtest/gtest.h>

#include <string>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "remat/model.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::error_of;

struct SeedStage {
  BlockSpec spec = make_block(testing::tiny("seed"));
  BlockExecutor exec{spec, keep_everything(spec)};
  std::vector<at::Tensor> params;
  SeedStage() {
    for (const ParamSpec& p : spec.params) params.push_back(at::randn(p.shape));
  }
  at::Tensor input() const { return at::randn(spec.tensors[spec.inputs[0]].shape); }
};

TEST(Executor, RefusesAnInputOfAnotherShape) {
  SeedStage s;
  BlockContext ctx;
  const at::Tensor wide = at::randn({2, 3, 1000});
  EXPECT_NE(error_of([&] { s.exec.forward({wide}, s.params, ctx, 0); }).find("input 'x' is Float [2, 3, 1000]"),
            std::string::npos);
  EXPECT_NO_THROW(s.exec.forward({s.input()}, s.params, ctx, 0));
}

TEST(Executor, RefusesAnUndefinedParameter) {
  SeedStage s;
  BlockContext ctx;
  std::vector<at::Tensor> params = s.params;
  params[1] = at::Tensor();
  EXPECT_NE(error_of([&] {
              s.exec.forward({s.input()}, params, ctx, 0);
            }).find("parameter '" + s.spec.params[1].name + "' is an undefined tensor"),
            std::string::npos);
}

// A schedule indexes its block's ops and tensors: a null one, or one made for another block, is
// refused before it is read.
TEST(Executor, RefusesAScheduleOfAnotherBlock) {
  const BlockSpec seed = make_block(testing::tiny("seed")), gpt2 = make_block(testing::tiny("gpt2"));
  const auto other = std::make_shared<const Schedule>(compile_schedule(gpt2, keep_everything(gpt2)));
  EXPECT_NE(error_of([&] { BlockExecutor(seed, nullptr); }).find("the schedule is null"), std::string::npos);
  EXPECT_NE(error_of([&] { BlockExecutor(seed, other); }).find("the schedule was compiled for another block"),
            std::string::npos);
}

// A backward frees the stage's tensors: a second one (retain_graph) would read freed slots.
TEST(Executor, RefusesASecondBackward) {
  SeedStage s;
  BlockContext ctx;
  const at::Tensor y = s.exec.forward({s.input()}, s.params, ctx, 0);
  s.exec.backward(at::ones_like(y), s.params, ctx, {true}, 0);
  EXPECT_NE(error_of([&] {
              s.exec.backward(at::ones_like(y), s.params, ctx, {true}, 0);
            }).find("its backward already ran (retain_graph is not supported)"),
            std::string::npos);
}

// The same through autograd: a model's loss backward twice with retain_graph.
TEST(Executor, AModelsSecondBackwardIsRefused) {
  const ModelConfig c = testing::tiny("gpt2");
  GPT model(c, Policy::parse("none"));
  auto [input, target] = random_batch(c);
  const at::Tensor loss = model->forward(input, target);
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_NE(error_of([&] { loss.backward(); }).find("its backward already ran"), std::string::npos);
}

}  // namespace
}  // namespace remat
