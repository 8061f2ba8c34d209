#include "app/bench.h"

#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace remat {
namespace {

TEST(GradDifference, IsTheLargestAbsoluteDifference) {
  const at::Tensor a = at::tensor({1.0f, 2.0f, 3.0f});
  EXPECT_EQ(grad_difference({a}, {a.clone()}), 0.0);
  EXPECT_FLOAT_EQ(grad_difference({a}, {a + at::tensor({0.0f, -0.37f, 0.1f})}), 0.37f);
}

// std::max(worst, NaN) keeps `worst`: a NaN gradient once read as a difference of 0.
TEST(GradDifference, ANanGradientIsNanNotZero) {
  const at::Tensor a = at::tensor({1.0f, 2.0f});
  EXPECT_TRUE(std::isnan(grad_difference({a, a}, {a, at::tensor({1.0f, NAN})})));
  EXPECT_TRUE(std::isnan(grad_difference({at::tensor({NAN})}, {at::tensor({0.0f})})));
}

TEST(GradDifference, AMissingGradientIsInfinite) {
  const at::Tensor a = at::tensor({1.0f});
  EXPECT_TRUE(std::isinf(grad_difference({a}, {at::Tensor()})));
  EXPECT_TRUE(std::isinf(grad_difference({a, a}, {a})));
}

}  // namespace
}  // namespace remat
