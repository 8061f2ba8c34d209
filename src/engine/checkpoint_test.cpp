#include "remat/checkpoint.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include "remat/error.h"
#include "remat/memory.h"
#include "test_util.h"

namespace remat {
namespace {

// A two-layer MLP with dropout: enough to exercise params, RNG and several saved tensors.
struct Mlp {
  at::Tensor w1, b1, w2;
  explicit Mlp(uint64_t seed) {
    at::manual_seed(seed);
    w1 = at::randn({16, 8}).requires_grad_();
    b1 = at::randn({16}).requires_grad_();
    w2 = at::randn({8, 16}).requires_grad_();
  }
  at::Tensor operator()(const at::Tensor& x, double p) const {
    at::Tensor h = at::gelu(at::linear(x, w1, b1));
    h = at::dropout(h, p, /*train=*/p > 0);
    return at::linear(h, w2);
  }
  std::vector<at::Tensor> params() const { return {w1, b1, w2}; }
};

struct Grads {
  std::vector<at::Tensor> g;
  at::Tensor next_random;  // a draw after backward: the outer RNG stream
};

Grads run(bool checkpointed, bool x_requires_grad, double p) {
  Mlp mlp(7);
  at::manual_seed(11);
  at::Tensor x = at::randn({4, 8});
  if (x_requires_grad) x.requires_grad_();
  auto fn = [&](const at::Tensor& in) { return mlp(in, p); };
  at::Tensor y = checkpointed ? checkpoint(fn, x, mlp.params()) : fn(x);
  y.pow(2).sum().backward();
  Grads out;
  for (const at::Tensor& t : mlp.params()) out.g.push_back(t.grad());
  if (x_requires_grad) out.g.push_back(x.grad());
  out.next_random = at::rand({4});
  return out;
}

void expect_bitwise_equal(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.g.size(), b.g.size());
  for (size_t i = 0; i < a.g.size(); ++i) {
    ASSERT_TRUE(a.g[i].defined()) << "plain grad " << i << " missing";
    ASSERT_TRUE(b.g[i].defined()) << "checkpointed grad " << i << " missing";
    EXPECT_TRUE(testing::bitwise_equal(a.g[i], b.g[i])) << "grad " << i;
  }
  EXPECT_TRUE(at::equal(a.next_random, b.next_random)) << "outer RNG stream moved";
}

TEST(Checkpoint, RefusesAnUndefinedInput) {
  const auto twice = [](const at::Tensor& x) { return x * 2; };
  EXPECT_NE(testing::error_of([&] { checkpoint(twice, at::Tensor(), {}); }).find("input 0 is an undefined tensor"),
            std::string::npos);
  EXPECT_EQ(testing::error_of([&] { checkpoint(twice, at::ones({2}), {}); }), "");
}

TEST(Checkpoint, GradientsBitwiseEqualWhenInputRequiresGrad) {
  expect_bitwise_equal(run(false, true, 0.0), run(true, true, 0.0));
}

TEST(Checkpoint, ParamsGetGradientsWhenNoInputRequiresGrad) {
  expect_bitwise_equal(run(false, false, 0.0), run(true, false, 0.0));
}

TEST(Checkpoint, DropoutReplaysTheSameMasks) {
  const Grads plain = run(false, true, 0.5);
  const Grads ckpt = run(true, true, 0.5);
  expect_bitwise_equal(plain, ckpt);
}

TEST(Checkpoint, WithoutRngPreservationDropoutMasksDiffer) {
  Mlp mlp(7);
  at::manual_seed(11);
  at::Tensor x = at::randn({4, 8}).requires_grad_();
  auto fn = [&](const at::Tensor& in) { return mlp(in, 0.5); };
  CheckpointOptions no_rng;
  no_rng.preserve_rng_state = false;
  checkpoint(fn, x, mlp.params(), no_rng).pow(2).sum().backward();
  const at::Tensor g_ckpt = mlp.w1.grad().clone();
  mlp.w1.mutable_grad() = at::Tensor();
  at::manual_seed(11);
  at::Tensor x2 = at::randn({4, 8}).requires_grad_();
  fn(x2).pow(2).sum().backward();
  EXPECT_FALSE(at::equal(g_ckpt, mlp.w1.grad()));  // the option matters
}

TEST(Checkpoint, KeepsOnlyItsOutputAndTheRngStateDuringForward) {
  Mlp mlp(3);
  at::Tensor x = at::randn({64, 8});
  const int64_t rng_bytes = static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
  auto fn = [&](const at::Tensor& in) { return mlp(in, 0.0); };
  const int64_t before = MemoryTracker::live();
  at::Tensor y = checkpoint(fn, x, mlp.params());
  EXPECT_EQ(MemoryTracker::live() - before, 64 * 8 * 4 + rng_bytes);
  // The plain run keeps the (64, 16) linear output, the GELU output and the output.
  y = at::Tensor();
  const int64_t before_plain = MemoryTracker::live();
  at::Tensor y2 = fn(x);
  EXPECT_GT(MemoryTracker::live() - before_plain, 64 * 8 * 4 + 2 * 64 * 16 * 4 - 1);
}

// A callable that throws during the backward's rerun leaves the generator where the caller had
// it: the fork back to the forward's state is undone however the rerun ends.
TEST(Checkpoint, AThrowingRerunLeavesTheGeneratorAsItWas) {
  at::manual_seed(7);
  int calls = 0;
  const at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  const at::Tensor y = checkpoint(
      [&](const at::Tensor& in) {
        if (++calls == 2) throw std::runtime_error("rerun failed");
        return at::dropout(in, 0.5, /*train=*/true);
      },
      x, {});
  at::randn({3});  // move the generator past the forward's state
  const at::Tensor before = at::detail::getDefaultCPUGenerator().get_state();
  EXPECT_THROW(y.sum().backward(), std::exception);
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
}

TEST(Checkpoint, RefusesDoubleBackward) {
  Mlp mlp(5);
  at::Tensor x = at::randn({4, 8}).requires_grad_();
  at::Tensor y = checkpoint([&](const at::Tensor& in) { return mlp(in, 0.0); }, x, mlp.params()).sum();
  try {
    torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "double backward was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("does not support double backward"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, MultipleOutputsWithOneUnused) {
  Mlp mlp(9);
  at::Tensor x = at::randn({4, 8}).requires_grad_();
  CheckpointFn fn = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = mlp(in[0], 0.0);
    return std::vector<at::Tensor>{h * 2, h.sum()};
  };
  auto outs = checkpoint(fn, {x}, mlp.params());
  outs[0].sum().backward();  // outs[1] unused
  const at::Tensor g = mlp.w2.grad().clone();
  mlp.w2.mutable_grad() = at::Tensor();
  (mlp(x, 0.0) * 2).sum().backward();
  EXPECT_TRUE(testing::bitwise_equal(g, mlp.w2.grad()));
}

TEST(Checkpoint, SequentialEqualsThePlainStack) {
  std::vector<Mlp> mlps = {Mlp(1), Mlp(2), Mlp(3), Mlp(4), Mlp(5)};
  std::vector<Layer> layers;
  for (const Mlp& m : mlps) layers.push_back({[m](const at::Tensor& x) { return at::tanh(m(x, 0.0)); }, m.params()});
  at::Tensor x = at::randn({4, 8});
  checkpoint_sequential(layers, 2, x).sum().backward();
  std::vector<at::Tensor> ckpt;
  for (const Mlp& m : mlps)
    for (const at::Tensor& p : m.params()) {
      ckpt.push_back(p.grad().clone());
      p.mutable_grad() = at::Tensor();
    }
  at::Tensor h = x;
  for (const Layer& l : layers) h = l.fn(h);
  h.sum().backward();
  size_t i = 0;
  for (const Mlp& m : mlps)
    for (const at::Tensor& p : m.params()) EXPECT_TRUE(testing::bitwise_equal(ckpt[i++], p.grad()));
}

// A layer used twice in a segment lists its parameters twice: they get its gradient once, as in
// the plain stack.
TEST(Checkpoint, ALayerUsedTwiceInASegmentGetsItsGradientOnce) {
  const Mlp a(1), b(2);
  auto layer = [](const Mlp& m) { return Layer{[m](const at::Tensor& x) { return at::tanh(m(x, 0.0)); }, m.params()}; };
  const std::vector<Layer> layers = {layer(a), layer(a), layer(b), layer(b)};
  const at::Tensor x = at::randn({4, 8});
  checkpoint_sequential(layers, 2, x).sum().backward();  // the first segment is a, a
  const at::Tensor ckpt = a.w1.grad().clone();
  a.w1.mutable_grad() = at::Tensor();
  at::Tensor h = x;
  for (const Layer& l : layers) h = l.fn(h);
  h.sum().backward();
  EXPECT_TRUE(testing::bitwise_equal(ckpt, a.w1.grad()));
}

// A recompute starts from the inputs as the backward finds them: fn must not change them.
TEST(Checkpoint, RefusesAnFnThatChangesItsInputInPlace) {
  const Mlp m(3);
  const at::Tensor x = at::randn({4, 8});
  const std::string e =
      testing::error_of([&] { checkpoint([&](const at::Tensor& in) { return m(in.mul_(0.5), 0.0); }, x, m.params()); });
  EXPECT_NE(e.find("fn changed input 0 in place"), std::string::npos) << e;
}

TEST(Checkpoint, SequentialRejectsBadSegmentCounts) {
  std::vector<Layer> layers(3, Layer{[](const at::Tensor& x) { return x * 2; }, {}});
  EXPECT_THROW(checkpoint_sequential(layers, 0, at::ones({2})), Error);
  EXPECT_THROW(checkpoint_sequential(layers, 4, at::ones({2})), Error);
}

TEST(Checkpoint, Nests) {
  Mlp inner(21), outer(22);
  at::Tensor x = at::randn({4, 8}).requires_grad_();
  auto f = [&](const at::Tensor& in) {
    at::Tensor h = checkpoint([&](const at::Tensor& t) { return inner(t, 0.0); }, in, inner.params());
    return outer(at::tanh(h), 0.0);
  };
  std::vector<at::Tensor> params = inner.params();
  for (const at::Tensor& p : outer.params()) params.push_back(p);
  checkpoint(f, x, params).sum().backward();
  const at::Tensor g = inner.w1.grad().clone();
  inner.w1.mutable_grad() = at::Tensor();
  outer(at::tanh(inner(x, 0.0)), 0.0).sum().backward();
  EXPECT_TRUE(testing::bitwise_equal(g, inner.w1.grad()));
}

}  // namespace
}  // namespace remat
