// Each op pair against LibTorch autograd on the same math: float64 to 1e-12, float32 to 1e-5
// (relative to the largest reference value).
#include "remat/ops.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

namespace remat::ops {
namespace {

double tol(at::ScalarType t) { return t == at::kDouble ? 1e-12 : 1e-5; }

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(1.0, want.abs().max().item<double>());
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, tol(got.scalar_type()) * scale) << what << ": max abs diff " << diff;
}

std::vector<at::Tensor> grads(const at::Tensor& y, const at::Tensor& dy, const std::vector<at::Tensor>& wrt) {
  return torch::autograd::grad({y}, wrt, {dy}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
}

at::Tensor leaf(at::IntArrayRef shape, at::ScalarType t) { return at::randn(shape, at::kDouble).to(t).requires_grad_(); }

class OpsTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override { at::manual_seed(17); }
  at::ScalarType t() const { return GetParam(); }
};

TEST_P(OpsTest, Linear) {
  at::Tensor x = leaf({3, 4, 5}, t()), w = leaf({6, 5}, t()), b = leaf({6}, t());
  at::Tensor dy = at::randn({3, 4, 6}, at::kDouble).to(t());
  at::Tensor ref = at::linear(x, w, b);
  auto g = grads(ref, dy, {x, w, b});
  at::NoGradGuard off;
  expect_close(linear_forward(x, w, b), ref, "y");
  LinearGrads lg = linear_backward(dy, x, w, true, true);
  expect_close(lg.dx, g[0], "dx");
  expect_close(lg.dw, g[1], "dw");
  expect_close(lg.db, g[2], "db");
  EXPECT_FALSE(linear_backward(dy, x, w, true, /*need_dx=*/false).dx.defined());
}

TEST_P(OpsTest, LayerNorm) {
  at::Tensor x = leaf({2, 3, 8}, t()), w = leaf({8}, t()), b = leaf({8}, t());
  at::Tensor dy = at::randn({2, 3, 8}, at::kDouble).to(t());
  at::Tensor ref = at::layer_norm(x, {8}, w, b, 1e-5);
  auto g = grads(ref, dy, {x, w, b});
  at::NoGradGuard off;
  LayerNormOut out = layer_norm_forward(x, w, b);
  expect_close(out.y, ref, "y");
  EXPECT_EQ(out.mean.sizes(), (at::IntArrayRef{2, 3, 1}));
  LayerNormGrads lg = layer_norm_backward(dy, x, out.mean, out.rstd, w, b, true);
  expect_close(lg.dx, g[0], "dx");
  expect_close(lg.dw, g[1], "dw");
  expect_close(lg.db, g[2], "db");
}

TEST_P(OpsTest, GeluTanh) {
  at::Tensor x = leaf({4, 7}, t());
  at::Tensor dy = at::randn({4, 7}, at::kDouble).to(t());
  // GPT-2's formula, written out.
  at::Tensor ref = 0.5 * x * (1 + at::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
  auto g = grads(ref, dy, {x});
  at::NoGradGuard off;
  expect_close(remat::ops::gelu_forward(x), ref, "y");
  expect_close(remat::ops::gelu_backward(dy, x), g[0], "dx");
}

TEST_P(OpsTest, ReluReadsItsOutput) {
  at::Tensor x = leaf({5, 6}, t());
  at::Tensor dy = at::randn({5, 6}, at::kDouble).to(t());
  at::Tensor ref = at::clamp_min(x, 0);
  auto g = grads(ref, dy, {x});
  at::NoGradGuard off;
  const at::Tensor y = relu_forward(x);
  expect_close(y, ref, "y");
  expect_close(relu_backward(dy, y), g[0], "dx");
}

TEST_P(OpsTest, Dropout) {
  at::Tensor x = leaf({64, 32}, t());
  at::Tensor dy = at::randn({64, 32}, at::kDouble).to(t());
  const at::Tensor mask = dropout_mask({64, 32}, 0.25, 99, at::kCPU);
  at::Tensor ref = x * mask.to(t()) / 0.75;
  auto g = grads(ref, dy, {x});
  at::NoGradGuard off;
  expect_close(dropout_forward(x, mask, 0.25), ref, "y");
  expect_close(dropout_backward(dy, mask, 0.25), g[0], "dx");
}

// Attention: scores -> softmax -> probs x V against the same math on permuted copies.
void attention_case(at::ScalarType t, bool causal, int64_t block) {
  const int64_t B = 2, T = 5, H = 3, D = 4, C = H * D;
  const AttentionLayout l{B, H, T, causal ? block : T, causal};
  at::Tensor qkv = leaf({B, T, 3 * C}, t);
  at::Tensor datty = at::randn({B, T, C}, at::kDouble).to(t);
  auto split = [&](int i) { return qkv.narrow(2, i * C, C).reshape({B, T, H, D}).permute({0, 2, 1, 3}); };
  at::Tensor s = at::matmul(split(0), split(1).transpose(-1, -2)) / std::sqrt(double(D));
  if (causal) s = s.masked_fill(at::ones({T, T}, at::kBool).triu(1), -INFINITY);
  at::Tensor p = at::softmax(s, -1);
  at::Tensor ref = at::matmul(p, split(2)).permute({0, 2, 1, 3}).reshape({B, T, C});
  auto g = grads(ref, datty, {qkv});
  at::NoGradGuard off;
  const at::Tensor scores = scores_forward(qkv, l);
  EXPECT_EQ(scores.numel(), l.numel());
  const at::Tensor probs = softmax_forward(scores, l);
  expect_close(unpack_attention(probs, l, 0.0), p, "probs");
  expect_close(attn_values_forward(probs, qkv, l), ref, "atty");
  at::Tensor dqkv;
  const at::Tensor dprobs = attn_values_backward(datty, probs, qkv, l, dqkv);
  scores_backward(softmax_backward(dprobs, probs, l), qkv, l, dqkv);
  expect_close(dqkv, g[0], "dqkv");
}

TEST_P(OpsTest, Attention) { attention_case(t(), /*causal=*/false, 5); }
TEST_P(OpsTest, CausalAttentionOneBlock) { attention_case(t(), /*causal=*/true, 5); }
TEST_P(OpsTest, CausalAttentionRowBlocks) { attention_case(t(), /*causal=*/true, 2); }  // blocks of 2, 2, 1 rows

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0;
}

// The engine writes pointwise gradients over dy, and dprobs over probs, when it can: the bits must
// be those of the out-of-place call.
TEST_P(OpsTest, WritingOverDyGivesTheSameBits) {
  const int64_t n = 29;  // square, so that softmax reads it as one (1, 1, n, n) attention block
  const at::Tensor x = at::randn({n, n}, at::kDouble).to(t()), dy = at::randn({n, n}, at::kDouble).to(t());
  const at::Tensor mask = dropout_mask({n, n}, 0.25, 5, at::kCPU), y = relu_forward(x);
  const AttentionLayout rows{1, 1, n, n, false};
  const at::Tensor probs = softmax_forward(x.view({1, 1, n, n}), rows).view({n, n});
  struct Case {
    const char* name;
    std::function<at::Tensor(const at::Tensor&, at::Tensor)> backward;
  };
  for (const Case& c : std::vector<Case>{
           {"gelu", [&](const at::Tensor& g, at::Tensor dx) { return gelu_backward(g, x, dx); }},
           {"relu", [&](const at::Tensor& g, at::Tensor dx) { return relu_backward(g, y, dx); }},
           {"dropout", [&](const at::Tensor& g, at::Tensor dx) { return dropout_backward(g, mask, 0.25, dx); }},
           {"softmax", [&](const at::Tensor& g, at::Tensor dx) { return softmax_backward(g, probs, rows, dx); }},
       }) {
    const at::Tensor fresh = c.backward(dy, at::Tensor());
    const at::Tensor over = dy.clone();
    const at::Tensor got = c.backward(over, over);
    EXPECT_EQ(got.data_ptr(), over.data_ptr()) << c.name << ": not written over dy";
    EXPECT_TRUE(same_bits(got, fresh)) << c.name;
  }
}

TEST_P(OpsTest, WritingDprobsOverProbsGivesTheSameBits) {
  const int64_t B = 2, T = 7, H = 3, D = 4, C = H * D;
  const AttentionLayout l{B, H, T, 3, true};  // causal row blocks of 3, 3, 1
  const at::Tensor qkv = at::randn({B, T, 3 * C}, at::kDouble).to(t());
  const at::Tensor datty = at::randn({B, T, C}, at::kDouble).to(t());
  const at::Tensor probs = softmax_forward(scores_forward(qkv, l), l);
  at::Tensor dqkv_fresh, dqkv_over;
  const at::Tensor fresh = attn_values_backward(datty, probs, qkv, l, dqkv_fresh);
  const at::Tensor mine = probs.clone();
  const at::Tensor over = attn_values_backward(datty, mine, qkv, l, dqkv_over, /*over_probs=*/true);
  EXPECT_EQ(over.data_ptr(), mine.data_ptr());
  EXPECT_TRUE(same_bits(over, fresh));
  EXPECT_TRUE(same_bits(dqkv_over, dqkv_fresh));
}

TEST_P(OpsTest, Embedding) {
  const at::Tensor tokens = at::randint(0, 7, {3, 4}, at::kLong);
  at::Tensor wte = leaf({7, 5}, t()), wpe = leaf({6, 5}, t());
  at::Tensor dx = at::randn({3, 4, 5}, at::kDouble).to(t());
  at::Tensor ref = at::embedding(wte, tokens) + wpe.narrow(0, 0, 4);
  auto g = grads(ref, dx, {wte, wpe});
  at::NoGradGuard off;
  expect_close(embedding_forward(tokens, wte, wpe), ref, "x");
  EmbeddingGrads eg = embedding_backward(dx, tokens, wte, wpe);
  expect_close(eg.dwte, g[0], "dwte");
  expect_close(eg.dwpe, g[1], "dwpe");
}

TEST_P(OpsTest, CrossEntropy) {
  at::Tensor logits = leaf({2, 3, 11}, t());
  const at::Tensor targets = at::randint(0, 11, {2, 3}, at::kLong);
  at::Tensor ref = at::cross_entropy_loss(logits.view({-1, 11}), targets.view({-1}));
  const at::Tensor dloss = at::full({}, 1.5, at::TensorOptions().dtype(t()));
  auto g = grads(ref, dloss, {logits});
  at::NoGradGuard off;
  CrossEntropyOut out = cross_entropy_forward(logits, targets);
  expect_close(out.loss, ref, "loss");
  expect_close(cross_entropy_backward(dloss, out.logp, targets), g[0], "dlogits");
}

TEST_P(OpsTest, Mse) {
  at::Tensor y = leaf({3, 4}, t());
  const at::Tensor target = at::randn({3, 4}, at::kDouble).to(t());
  at::Tensor ref = (y - target).pow(2).mean();
  const at::Tensor dloss = at::full({}, 0.5, at::TensorOptions().dtype(t()));
  auto g = grads(ref, dloss, {y});
  at::NoGradGuard off;
  expect_close(mse_forward(y, target), ref, "loss");
  expect_close(mse_backward(dloss, y, target), g[0], "dy");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OpsTest, ::testing::Values(at::kDouble, at::kFloat),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(AttentionLayout, CausalBlocksStoreOnlyTheVisibleColumns) {
  const AttentionLayout l{8, 8, 1024, 128, true};
  EXPECT_EQ(l.blocks(), 8);
  EXPECT_EQ(l.cols(0), 128);
  EXPECT_EQ(l.cols(7), 1024);
  EXPECT_EQ(l.numel(), 8 * 8 * 128 * 128 * 36);  // 128 * 128 * (1 + 2 + ... + 8) per head
  EXPECT_EQ(l.shape(), (std::vector<int64_t>{l.numel()}));
  const AttentionLayout full{8, 8, 128, 128, false};
  EXPECT_EQ(full.shape(), (std::vector<int64_t>{8, 8, 128, 128}));
}

TEST(DropoutMask, SameSeedSameMask) {
  EXPECT_TRUE(at::equal(dropout_mask({1000}, 0.3, 5, at::kCPU), dropout_mask({1000}, 0.3, 5, at::kCPU)));
}

TEST(DropoutMask, DifferentSeedsDiffer) {
  EXPECT_FALSE(at::equal(dropout_mask({1000}, 0.3, 5, at::kCPU), dropout_mask({1000}, 0.3, 6, at::kCPU)));
}

TEST(DropoutMask, KeepsAboutOneMinusP) {
  const double kept = dropout_mask({200000}, 0.3, 11, at::kCPU).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.7, 0.005);
}

TEST(DropoutMask, NeighbouringSeedsAreNotShiftedCopies) {
  const at::Tensor a = dropout_mask({4096}, 0.5, 1, at::kCPU).to(at::kFloat);
  const at::Tensor b = dropout_mask({4096}, 0.5, 2, at::kCPU).to(at::kFloat);
  for (int shift : {0, 1, 2, 7}) {
    const double agree = (a.narrow(0, shift, 4000) == b.narrow(0, 0, 4000)).to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(agree, 0.5, 0.05) << "shift " << shift;
  }
}

}  // namespace
}  // namespace remat::ops
