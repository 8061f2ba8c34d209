#include "remat/optim.h"

#include <gtest/gtest.h>

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

TEST(ShardedAdam, RefusesAGradientListOfAnotherLength) {
  ShardedAdam adam({at::zeros({4}), at::zeros({2})}, {true, false}, AdamOptions{}, 0, 6);
  EXPECT_NE(error_of([&] { adam.step({at::ones({4})}); }).find("1 gradients for 2 parameters"), std::string::npos);
  EXPECT_EQ(error_of([&] { adam.step({at::ones({4}), at::ones({2})}); }), "");
}

}  // namespace
}  // namespace remat
