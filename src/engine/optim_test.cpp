#include "remat/optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::error_of;

// beta1 = 1 would divide the step by 1 - beta1^t = 0.
TEST(Adam, RefusesABetaOfOne) {
  AdamOptions o;
  o.beta1 = 1.0;
  EXPECT_NE(error_of([&] { Adam({at::zeros({4})}, o); }).find("beta1 and beta2 must be in [0, 1), got 1 and 0.999"),
            std::string::npos);
  o.beta1 = 0.9;
  EXPECT_EQ(error_of([&] { Adam({at::zeros({4})}, o); }), "");
}

// A gradient with fewer elements than its parameter would be read past its end.
TEST(Adam, RefusesAGradientOfAnotherSize) {
  at::Tensor p = at::zeros({4});
  Adam adam({p}, AdamOptions{});
  p.mutable_grad() = at::ones({3});
  EXPECT_NE(error_of([&] { adam.step(); }).find("the gradient of parameter 0 is Float [3]"), std::string::npos);
  p.mutable_grad() = at::ones({4});
  EXPECT_EQ(error_of([&] { adam.step(); }), "");
}

// eps = 0 would divide 0 by 0 where a parameter's gradient and moments are all 0 (a token row no
// batch has used): the weight would turn NaN.
TEST(Adam, RefusesAnEpsOfZero) {
  AdamOptions o;
  o.eps = 0.0;
  EXPECT_NE(error_of([&] { Adam({at::zeros({4})}, o); }).find("eps must be finite and > 0 in float32, got 0"),
            std::string::npos);
  o.eps = 1e-50;  // 0 in float32, where the update runs
  EXPECT_NE(error_of([&] { Adam({at::zeros({4})}, o); }).find("got 1e-50"), std::string::npos);
  o.eps = 1e-8;
  at::Tensor p = at::ones({4});
  Adam adam({p}, o);
  p.mutable_grad() = at::zeros({4});
  adam.step();
  EXPECT_TRUE(at::equal(p, at::ones({4})));
}

// A parameter whose first gradient comes at the second step is updated as a fresh Adam's first
// step (torch.optim.Adam counts steps per parameter): its bias corrections use t = 1, not 2.
TEST(Adam, AParameterFirstUpdatedLateStartsAsAFreshAdam) {
  at::manual_seed(3);
  const at::Tensor w1 = at::randn({4}), w2 = at::randn({4}), g = at::randn({4});
  const at::Tensor fresh = w2.clone();
  Adam adam({w1, w2}, AdamOptions{});
  w1.mutable_grad() = at::randn({4});
  adam.step();  // w2 has no gradient yet
  w1.mutable_grad() = at::randn({4});
  w2.mutable_grad() = g;
  adam.step();
  Adam alone({fresh}, AdamOptions{});
  fresh.mutable_grad() = g;
  alone.step();
  EXPECT_TRUE(testing::bitwise_equal(w2, fresh));
}

// A learning rate or a step count a schedule or a saved state could give wrong is refused: a
// negative count's next step would divide by 1 - beta^0 = 0.
TEST(Adam, RefusesABadLearningRateOrStepCount) {
  Adam adam({at::zeros({4})}, AdamOptions{});
  EXPECT_NE(error_of([&] { adam.set_lr(std::nan("")); }).find("lr must be finite and >= 0, got nan"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adam.set_steps(-1); }).find("steps must be >= 0"), std::string::npos);
  EXPECT_EQ(error_of([&] { adam.set_steps(3), adam.set_lr(0.5); }), "");
}

// Two shards of the parameters' flat range, stepped on the same gradients, end at Adam's weights
// bit for bit (the update is elementwise; weight decay on the parameters whose flag says so).
TEST(ShardedAdam, TwoShardsHaveTheBitsOfAdam) {
  AdamOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  const at::Tensor w0 = at::randn({5}, at::TensorOptions().dtype(at::kFloat)), w1 = at::randn({3});
  std::vector<at::Tensor> whole = {w0.clone(), w1.clone()}, sharded = {w0.clone(), w1.clone()};
  Adam adam(whole, o);
  ShardedAdam low(sharded, {true, true}, o, 0, 4), high(sharded, {true, true}, o, 4, 8);
  for (int step = 0; step < 3; ++step) {
    const std::vector<at::Tensor> grads = {at::randn({5}), at::randn({3})};
    whole[0].mutable_grad() = grads[0].clone(), whole[1].mutable_grad() = grads[1].clone();
    adam.step();
    low.step(grads), high.step(grads);
  }
  EXPECT_TRUE(at::equal(whole[0], sharded[0]));
  EXPECT_TRUE(at::equal(whole[1], sharded[1]));
  EXPECT_FALSE(at::equal(whole[0], w0)) << "the weights moved";
}

TEST(ShardedAdam, RefusesAGradientListOfAnotherLength) {
  ShardedAdam adam({at::zeros({4}), at::zeros({2})}, {true, false}, AdamOptions{}, 0, 6);
  EXPECT_NE(error_of([&] { adam.step({at::ones({4})}); }).find("1 gradients for 2 parameters"), std::string::npos);
  EXPECT_EQ(error_of([&] { adam.step({at::ones({4}), at::ones({2})}); }), "");
}

}  // namespace
}  // namespace remat
