// Every registered op, through the executor, against the reference its own file gives (its math in
// differentiable ATen ops): forward and backward, float64 to 1e-12 and float32 to 1e-5 relative to
// the largest reference value. A new op is tested by being defined.
#include "remat/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/attention_common.h"
#include "ops/kernels.h"
#include "ops/op_env.h"
#include "ops/op_testing.h"
#include "ops/reduce.h"
#include "remat/block.h"
#include "remat/error.h"
#include "remat/executor.h"
#include "remat/memory_model.h"
#include "remat/policy.h"
#include "test_util.h"
#include "util/gemm.h"
#include "util/parallel_testing.h"

namespace remat {
namespace {

double tol(at::ScalarType t) { return t == at::kDouble ? 1e-12 : 1e-5; }

// Masked attention scores hold the lowest finite value; compare the rest, and the mask exactly.
::testing::AssertionResult close_unmasked(const at::Tensor& got, const at::Tensor& want, double t) {
  const at::Tensor masked = want.to(at::kDouble) < -1e30;
  if (!at::equal(masked, got.to(at::kDouble) < -1e30)) return ::testing::AssertionFailure() << "masks differ";
  return testing::close(got.to(at::kDouble).masked_fill(masked, 0), want.to(at::kDouble).masked_fill(masked, 0), t);
}

// An op's example stage with random inputs and parameters in `dtype`.
struct Case {
  const OpDef* def = nullptr;
  BlockSpec spec;
  std::vector<at::Tensor> inputs, params;
};

Case make_case(OpKind kind, at::ScalarType dtype, bool second = false) {
  Case c;
  c.def = &op_def(kind);
  c.spec = second ? c.def->test->example2() : c.def->test->example();
  at::manual_seed(17 + static_cast<int>(kind));
  for (int in : c.spec.inputs) {
    const TensorSpec& t = c.spec.tensors[in];
    if (t.dtype == DType::I64) {
      const detail::OpTestCase& test = *c.def->test;
      c.inputs.push_back(at::randint(test.index_low, test.index_range, t.shape, at::kLong));
      if (test.index_low < 0) c.inputs.back().view({-1})[0] = test.index_low;
    } else if (t.dtype == DType::Bool) {
      c.inputs.push_back(at::randint(0, 2, t.shape, at::kLong).to(at::kBool));
    } else {
      c.inputs.push_back(at::randn(t.shape, at::kDouble).to(dtype));
    }
  }
  for (const ParamSpec& p : c.spec.params) c.params.push_back(at::randn(p.shape, at::kDouble).to(dtype));
  return c;
}

// Every op's examples (one or two) in `dtype`; float64 only for ops that run it.
std::vector<Case> all_cases(at::ScalarType dtype) {
  std::vector<Case> cases;
  for (int k = 0; k < static_cast<int>(OpKind::Count); ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    const detail::OpTestCase* t = op_def(kind).test;
    if (!t || (dtype == at::kDouble && !t->float64)) continue;
    cases.push_back(make_case(kind, dtype));
    if (t->example2) cases.push_back(make_case(kind, dtype, true));
  }
  return cases;
}

std::vector<bool> float_inputs(const Case& c) {
  std::vector<bool> need;
  for (int in : c.spec.inputs) need.push_back(is_float(c.spec.tensors[in].dtype));
  return need;
}

class OpsTest : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(OpsTest, EveryOpMatchesItsReferenceForwardAndBackward) {
  const at::ScalarType dtype = GetParam();
  int tested = 0;
  for (Case& c : all_cases(dtype)) {
    ++tested;
    const OpNode& node = c.spec.ops[0];
    const std::string name = c.spec.kind;
    // The reference, differentiable in its float inputs and parameters.
    std::vector<at::Tensor> leaves, wrt;
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      leaves.push_back(c.inputs[i].is_floating_point() ? c.inputs[i].clone().requires_grad_() : c.inputs[i]);
      if (c.inputs[i].is_floating_point()) wrt.push_back(leaves.back());
    }
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : c.params) params.push_back(p.clone().requires_grad_());
    wrt.insert(wrt.end(), params.begin(), params.end());
    const std::vector<at::Tensor> want = c.def->test->reference(node, leaves, params);

    BlockExecutor exec(c.spec, keep_everything(c.spec));
    BlockContext ctx;
    const at::Tensor y = exec.forward(c.inputs, c.params, ctx, 0);
    EXPECT_TRUE(close_unmasked(y, want[0].detach(), tol(dtype))) << name << ": output 0";
    for (size_t i = 1; i < node.out.size(); ++i) {
      if (!ctx.tensors[node.out[i]].defined()) continue;
      EXPECT_TRUE(testing::close(ctx.tensors[node.out[i]], want[i].detach(), tol(dtype))) << name << ": output " << i;
    }

    const at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(dtype);
    const BlockExecutor::Grads g = exec.backward(dy, c.params, ctx, float_inputs(c), 0);
    const std::vector<at::Tensor> ref = torch::autograd::grad({want[0]}, wrt, {dy}, false, false, true);
    size_t r = 0;
    for (size_t i = 0; i < c.inputs.size(); ++i)
      if (c.inputs[i].is_floating_point()) {
        const at::Tensor expected = ref[r++];
        // Inputs the op gives no gradient by definition (a loss's target), or that its math does not use.
        if (!expected.defined() || !is_float(c.spec.tensors[c.spec.inputs[i]].dtype)) continue;
        bool gets_grad = false;  // some op input that is this stage input has a gradient
        for (size_t k = 0; k < node.in.size(); ++k)
          gets_grad = gets_grad || (node.in[k] == c.spec.inputs[i] &&
                                    grad_kind(*c.def, node, static_cast<int>(k)) != GradKind::None);
        if (!gets_grad) continue;
        EXPECT_TRUE(testing::close(g.inputs[i], expected, tol(dtype))) << name << ": gradient of input " << i;
      }
    for (size_t p = 0; p < c.params.size(); ++p)
      EXPECT_TRUE(testing::close(g.params[p], ref[r++], tol(dtype))) << name << ": gradient of parameter " << p;
  }
  EXPECT_GE(tested, 10);
}

// Dropping everything a one-op stage keeps makes the backward recompute the op: same bits.
TEST_P(OpsTest, EveryOpRecomputesBitwise) {
  int tested = 0;
  for (Case& c : all_cases(GetParam())) {
    auto grads = [&](const std::string& policy) {
      BlockExecutor exec(c.spec, Policy::parse(policy).resolve(c.spec, 1).layers[0]);
      BlockContext ctx;
      const at::Tensor y = exec.forward(c.inputs, c.params, ctx, 0);
      at::manual_seed(5);
      return exec.backward(at::randn(y.sizes(), at::kDouble).to(GetParam()), c.params, ctx, float_inputs(c), 0);
    };
    if (c.spec.choosable().empty()) continue;  // the op's one-op stage keeps nothing it could drop
    ++tested;
    const BlockExecutor::Grads keep = grads("none"), again = grads("full");
    for (size_t i = 0; i < keep.inputs.size(); ++i) {
      if (!keep.inputs[i].defined()) continue;
      EXPECT_TRUE(testing::bitwise_equal(again.inputs[i], keep.inputs[i])) << c.spec.kind;
    }
    for (size_t p = 0; p < keep.params.size(); ++p)
      EXPECT_TRUE(testing::bitwise_equal(again.params[p], keep.params[p])) << c.spec.kind;
  }
  // 11 ops (13 with float32's head-by-head attention cases) keep something their one-op stage can
  // drop; the rest (a linear's backward reads only its input) recompute inside whole blocks, which
  // EngineKinds.EveryPresetAndFormGivesBitwiseEqualGradients runs.
  EXPECT_GE(tested, 11);
}

// A broken invariant is an Internal error naming the file and line that found it, never a
// user's mistake.
TEST(OpRegistry, AnUnknownOpKindIsAnInternalErrorWithItsPlace) {
  try {
    op_def(OpKind::Count);
    FAIL() << "op_def accepted OpKind::Count";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Internal);
    EXPECT_EQ(std::string(e.what()).rfind("internal error at src/ops/registry.cpp:", 0), 0u) << e.what();
  }
}

// The attention ops' float32 products run head by head from compact copies of the operands
// (NOTE [The engine's GEMMs], 5), float64 and CUDA on the batched path: both paths must give the
// same bits (the example is causal, in row blocks, with two query heads per key/value head).
TEST(AttentionOps, HeadByHeadProductsHaveTheBatchedPathsBits) {
  if (!detail::gemm_available()) GTEST_SKIP() << "no oneDNN sgemm: float32 takes the batched path too";
  for (const Case& c : all_cases(at::kFloat)) {
    const OpKind kind = c.spec.ops[0].kind;
    if (kind != OpKind::Scores && kind != OpKind::AttnValues) continue;
    auto run = [&c] {
      BlockExecutor exec(c.spec, keep_everything(c.spec));
      BlockContext ctx;
      const at::Tensor y = exec.forward(c.inputs, c.params, ctx, 0);
      at::manual_seed(3);
      const at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(at::kFloat);
      std::vector<at::Tensor> out{y};
      for (const at::Tensor& g : exec.backward(dy, c.params, ctx, float_inputs(c), 0).inputs) out.push_back(g);
      return out;
    };
    const std::vector<at::Tensor> by_head = run();
    std::vector<at::Tensor> batched;
    {
      const ops::attention::BatchedPathForTests force;
      batched = run();
    }
    ASSERT_EQ(by_head.size(), batched.size());
    for (size_t i = 0; i < by_head.size(); ++i)
      EXPECT_TRUE(testing::bitwise_equal(by_head[i], batched[i])) << c.spec.kind << ": tensor " << i;
  }
}

// Runs the backward of a case's op with input 0's gradient made as `source` says (input 1, if it
// is a Slot, zeroed); returns input 0's gradient and whether it took the memory it was handed.
std::pair<at::Tensor, bool> backward_with(const Case& c, GradSource source) {
  const OpNode& node = c.spec.ops[0];
  BlockExecutor exec(c.spec, keep_everything(c.spec));
  BlockContext ctx;
  const at::Tensor y = exec.forward(c.inputs, c.params, ctx, 0);
  at::manual_seed(9);
  const at::Tensor dy = at::randn(y.sizes(), at::kDouble).to(y.scalar_type());
  std::vector<at::Tensor> tensors = ctx.tensors;
  for (int in : c.spec.inputs) tensors[in] = tensors[in].clone();  // the executor's own, unshared
  detail::OpEnv env(c.spec, tensors, ctx.seeds, nullptr, c.params, 0);
  env.grads.assign(c.spec.tensors.size(), at::Tensor());
  env.param_grads.assign(c.spec.params.size(), at::Tensor());
  env.grads[node.out[0]] = dy.clone();
  const void* handed =
      source == GradSource::OverDy ? env.grads[node.out[0]].data_ptr() : tensors[node.in[0]].data_ptr();
  Step step;
  step.kind = Step::Kind::Backward;
  step.index = 0;
  step.grads[0] = {source, SlotPrep::Zeros, GradMerge::Set};
  for (size_t i = 1; i < node.in.size(); ++i)
    if (c.def->grad_in[i] == GradKind::Slot)
      step.grads[i] = {GradSource::Slot, node.in[i] == node.in[0] ? SlotPrep::Existing : SlotPrep::Zeros,
                       GradMerge::Set};
  env.begin(step);
  c.def->backward(env, node);
  const at::Tensor g = env.grads[node.in[0]];
  return {g, g.data_ptr() == handed};
}

// The plan may write a pointwise gradient over dy, or dprobs over probs: the bits must be those
// of a fresh tensor, and the memory must be the one handed over.
TEST_P(OpsTest, WritingOverDyOrTheInputGivesTheSameBits) {
  int tested = 0;
  for (int k = 0; k < static_cast<int>(OpKind::Count); ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    const GradKind g = op_def(kind).grad_in[0];
    if (!op_def(kind).test || (g != GradKind::OverDy && g != GradKind::OverInput)) continue;
    ++tested;
    const Case c = make_case(kind, GetParam());
    const auto [fresh, fresh_reused] = backward_with(c, GradSource::Fresh);
    const auto [over, reused] = backward_with(c, g == GradKind::OverDy ? GradSource::OverDy : GradSource::OverInput);
    EXPECT_FALSE(fresh_reused) << op_def(kind).name;
    EXPECT_TRUE(reused) << op_def(kind).name << ": not written over the memory it was handed";
    EXPECT_TRUE(testing::bitwise_equal(over, fresh)) << op_def(kind).name;
  }
  EXPECT_GE(tested, 5);  // gelu, relu, dropout, softmax, attn_values
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OpsTest, ::testing::Values(at::kDouble, at::kFloat),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(OpRegistry, NamesMatchKinds) {
  for (int k = 0; k < static_cast<int>(OpKind::Count); ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    EXPECT_EQ(std::string(op_def(kind).name), std::string(op_name(kind))) << "row " << k;
    EXPECT_LE(op_def(kind).n_in, kMaxOpInputs);
    EXPECT_NE(op_def(kind).forward, nullptr);
    EXPECT_NE(op_def(kind).backward, nullptr);
  }
}

TEST(AttentionLayout, CausalBlocksStoreOnlyTheVisibleColumns) {
  AttentionLayout l;
  l.batch = 8, l.heads = 8, l.seq = 1024, l.block = 128, l.causal = true;
  EXPECT_EQ(l.blocks(), 8);
  EXPECT_EQ(l.cols(0), 128);
  EXPECT_EQ(l.cols(7), 1024);
  EXPECT_EQ(l.numel(), 8 * 8 * 128 * 128 * 36);  // 128 * 128 * (1 + 2 + ... + 8) per head
  EXPECT_EQ(l.shape(), (std::vector<int64_t>{l.numel()}));
  AttentionLayout full = l;
  full.seq = 128, full.causal = false;
  EXPECT_EQ(full.shape(), (std::vector<int64_t>{8, 8, 128, 128}));
}

// offset(r) is a closed form: it must be the sum of the blocks before r, short last block or not.
TEST(AttentionLayout, OffsetIsTheSumOfTheBlocksBefore) {
  for (const bool causal : {true, false})
    for (const int64_t seq : {5, 128, 300, 1024}) {
      AttentionLayout l;
      l.batch = 2, l.heads = 3, l.seq = seq, l.block = 128, l.causal = causal;
      if (seq == 5) l.block = 2;
      int64_t sum = 0;
      for (int64_t r = 0; r <= l.blocks(); ++r) {
        EXPECT_EQ(l.offset(r), sum) << "seq " << seq << " causal " << causal << " block " << r;
        if (r < l.blocks()) sum += l.batch * l.heads * l.rows(r) * l.cols(r);
      }
    }
}

// Rows of -100 with one entry of 200, at every position (the vector loop's lanes and the scalar
// tail of 37 columns): a row max that missed it would overflow exp (exp(300)) and give no
// probability 1 there.
TEST(SoftmaxKernel, FindsTheRowMaxInEveryLane) {
  const int64_t cols = 37;
  at::Tensor s = at::full({cols, cols}, -100.0f);
  for (int64_t i = 0; i < cols; ++i) s[i][i] = 200.0f;
  at::Tensor p = at::empty_like(s);
  ops::kernels::softmax_rows(s.data_ptr<float>(), p.data_ptr<float>(), cols, cols);
  EXPECT_TRUE(at::equal(p, at::eye(cols)));
  for (int64_t i = 0; i < cols; ++i) {  // flash attention's online softmax, from a lower running max
    float m = -1000.0f, l = 0.0f;
    at::Tensor row = p[i];
    ops::kernels::online_softmax_row(s[i].data_ptr<float>(), row.data_ptr<float>(), cols, m, l);
    EXPECT_EQ(m, 200.0f) << "row " << i;
    EXPECT_EQ(l, 1.0f) << "row " << i;
  }
}

// SwiGLU's vector loop against float64 over gates from 120 down to -120, across the clamps of
// exp's argument (at g = -80 and 87), in the vector lanes and a ragged tail (at g < -80): finite
// everywhere. act and du are products, so wherever the clamp leaves sigmoid exact (g >= -80) each
// is held to float32 rounding of its own size: a clamp any tighter (at 15, say) puts e^-15 where
// e^-30 belongs. dg, whose 1 + g (1 - s) cancels near g = -1.28, and every term below -80 (where
// sigmoid stays at e^-80 by design) are held relative to their factors' sizes.
TEST(SwigluKernel, MatchesFloat64AcrossTheClamps) {
  const int64_t n = 4803;  // g = 120 - 0.05 i, i = 0 .. n - 1: -120 at the end, a tail of 3
  at::manual_seed(4);
  const at::Tensor g = at::arange(n, at::kDouble).mul(-0.05).add(120).to(at::kFloat);
  const at::Tensor u = at::randn({n}).mul(2), dy = at::randn({n});
  at::Tensor act = at::empty({n}), dg = at::empty({n}), du = at::empty({n});
  ops::kernels::swiglu_forward(g.data_ptr<float>(), u.data_ptr<float>(), act.data_ptr<float>(), n);
  ops::kernels::swiglu_backward(dy.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(), dg.data_ptr<float>(),
                                du.data_ptr<float>(), n);
  const at::Tensor gd = g.to(at::kDouble), ud = u.to(at::kDouble), dyd = dy.to(at::kDouble);
  const at::Tensor sd = at::sigmoid(gd);
  const at::Tensor want_act = gd * sd * ud, want_du = dyd * gd * sd, want_dg = dyd * ud * sd * (1 + gd * (1 - sd));
  const at::Tensor exact = gd >= -80;  // where the clamp leaves sigmoid as it is
  const at::Tensor gs = gd.abs() + 1;
  for (const auto& [got, want, scale, product, name] : {std::tuple{act, want_act, gs * ud.abs(), true, "act"},
                                                        {du, want_du, gs * dyd.abs(), true, "du"},
                                                        {dg, want_dg, gs * ud.abs() * dyd.abs(), false, "dg"}}) {
    EXPECT_TRUE(at::isfinite(got).all().item<bool>()) << name;
    const at::Tensor err = (got.to(at::kDouble) - want).abs();
    EXPECT_LT((err / scale).max().item<double>(), 1e-6) << name;
    if (product) {  // 1e-37: below it float32 is subnormal and keeps fewer digits
      EXPECT_LT((err / (want.abs() + 1e-37)).masked_select(exact).max().item<double>(), 1e-5) << name;
    }
  }
}

// The cross-entropy's vector loops against float64: rows of 1 to 2500 columns (two and a half
// summing blocks, a ragged vector tail), logits spread over +-40 around offsets up to 1000, a row's
// maximum placed last, and a row of one large logit among ones 200 below it (their exponentials
// clamped to 0). The log-sum-exp is held to its float32 rounding, the softmax from it to float32
// rounding of its argument (x - lse, up to 87 in size), and each row's sum to one within the
// rounding of the float32 lse it is computed from. The log-softmax is x less that lse, exactly. A
// row with a NaN or an infinity gives NaN.
TEST(LogSumExpKernel, MatchesFloat64) {
  at::manual_seed(9);
  for (const int64_t cols : {1, 37, 1024, 2500}) {
    const int64_t rows = 6;
    at::Tensor x = at::randn({rows, cols}).mul(10).clamp(-40, 40) +
                   at::tensor({0.0f, 3.0f, -500.0f, 1000.0f, 0.0f, 0.0f}).unsqueeze(1);
    x[4][cols - 1] = 200.0f;  // the maximum in the last column: exp(x - 40) would overflow
    x[5].fill_(-150.0f);
    x[5][cols / 2] = 50.0f;
    at::Tensor lse = at::empty({rows});
    ops::kernels::log_sum_exp_rows(x.data_ptr<float>(), lse.data_ptr<float>(), rows, cols);
    const at::Tensor xd = x.to(at::kDouble);
    const at::Tensor want = at::logsumexp(xd, 1);
    const at::Tensor err = (lse.to(at::kDouble) - want).abs();
    EXPECT_TRUE((err <= want.abs() * 0x1p-23 + 1e-6).all().item<bool>())
        << cols << " columns: lse " << lse << " want " << want;

    const float scale = 1.0f / 3;
    at::Tensor p = x.clone();
    ops::kernels::softmax_from_lse_rows(p.data_ptr<float>(), lse.data_ptr<float>(), scale, p.data_ptr<float>(), rows,
                                        cols);
    const at::Tensor arg = xd - lse.to(at::kDouble).unsqueeze(1);
    const at::Tensor want_p = at::where(arg > -87, arg.exp(), at::zeros_like(arg)) * scale;
    const at::Tensor bound = want_p * (arg.abs() + 8) * 0x1p-23 + 1e-40;
    EXPECT_TRUE(((p.to(at::kDouble) - want_p).abs() <= bound).all().item<bool>()) << cols << " columns";
    // The log-softmax (the cross-entropy's forward) is x less the same lse, and its gradient's
    // softmax (lse null) is exp of it, as from the lse above.
    at::Tensor logp = at::empty_like(x), q = at::empty_like(x);
    ops::kernels::log_softmax_rows(x.data_ptr<float>(), logp.data_ptr<float>(), rows, cols);
    EXPECT_TRUE(at::equal(logp, x - lse.unsqueeze(1))) << cols << " columns";
    ops::kernels::softmax_from_lse_rows(logp.data_ptr<float>(), nullptr, scale, q.data_ptr<float>(), rows, cols);
    const at::Tensor arg_q = logp.to(at::kDouble);
    const at::Tensor want_q = at::where(arg_q > -87, arg_q.exp(), at::zeros_like(arg_q)) * scale;
    EXPECT_TRUE(((q.to(at::kDouble) - want_q).abs() <= want_q * (arg_q.abs() + 8) * 0x1p-23 + 1e-40).all().item<bool>())
        << cols << " columns";
    // Each row sums to exp(the lse's own error): one within it.
    const at::Tensor off_one = p.to(at::kDouble).sum(1).div(scale).sub(1).abs();
    EXPECT_TRUE((off_one <= want.abs() * 0x1p-23 + 1e-5).all().item<bool>()) << cols << " columns: " << off_one;
  }
  // A row holding a NaN or an infinity anywhere (a diverged run's logits) has a NaN lse and NaN
  // log-probabilities, so that the loss is NaN (ATen's is for a NaN or +inf; a -inf logit, which
  // only an overflowing product makes, counts as divergence too).
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()})
    for (const int64_t at_col : {0, 700, 1499}) {
      at::Tensor x = at::randn({2, 1500});
      x[1][at_col] = bad;
      at::Tensor lse = at::empty({2}), logp = at::empty_like(x);
      ops::kernels::log_sum_exp_rows(x.data_ptr<float>(), lse.data_ptr<float>(), 2, 1500);
      ops::kernels::log_softmax_rows(x.data_ptr<float>(), logp.data_ptr<float>(), 2, 1500);
      EXPECT_TRUE(std::isfinite(lse[0].item<float>()));
      EXPECT_TRUE(std::isnan(lse[1].item<float>())) << bad << " at column " << at_col;
      EXPECT_TRUE(at::isnan(logp[1]).all().item<bool>()) << bad << " at column " << at_col;
    }
}

// The norms' row loops (-ffast-math) against float64: a row 100 deviations from zero keeps its
// variance (taken about the mean in a second pass; E[x^2] - mean^2 would lose it), and the weight gradients' chunk
// sums add up; a row holding a NaN or an infinity, in x or in dy, gives outputs that are not all
// finite (a diverged run stays diverged).
TEST(NormKernels, MatchFloat64AndKeepNonFinite) {
  at::manual_seed(4);
  const int64_t rows = 130, cols = 300;  // three chunks of partial sums, a partial one
  const at::Tensor x = at::randn({rows, cols}) + at::arange(rows).remainder(3).sub(1).mul(100).unsqueeze(1);
  const at::Tensor dy = at::randn({rows, cols}), w = at::randn({cols}), b = at::randn({cols});
  const at::Tensor xd = x.to(at::kDouble), dyd = dy.to(at::kDouble), wd = w.to(at::kDouble);
  auto close = [](const at::Tensor& got, const at::Tensor& want) {
    return ((got.to(at::kDouble) - want).abs() <= want.abs() * 1e-4 + 1e-4).all().item<bool>();
  };
  const int64_t chunks = ops::kernels::norm_chunks(rows);
  {
    at::Tensor y = at::empty_like(x), mean = at::empty({rows}), rstd = at::empty({rows}), dx = at::empty_like(x);
    at::Tensor part = at::empty({2, chunks, cols});
    ops::kernels::layer_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), 1e-5f,
                                  y.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols);
    ops::kernels::layer_norm_rows_backward(dy.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(),
                                           rstd.data_ptr<float>(), w.data_ptr<float>(), dx.data_ptr<float>(),
                                           part.data_ptr<float>(), part.data_ptr<float>() + chunks * cols, rows, cols);
    // The mean is a float sum, off by at most (C - 1) u sum|x| / C whatever its order (a row 100 from
    // zero: ~2e-3 of a deviation); the rest is held to float64 from the mean the kernel took.
    const at::Tensor m = mean.to(at::kDouble).unsqueeze(1);
    EXPECT_TRUE(((m - xd.mean(1, true)).abs() <= xd.abs().amax(1, true) * (cols * 0x1p-24)).all().item<bool>());
    const at::Tensor r = (xd - m).pow(2).mean(1, true).add(1e-5).rsqrt(), xh = (xd - m) * r;
    const at::Tensor g = dyd * wd;
    EXPECT_TRUE(close(rstd, r.squeeze(1))) << rstd.slice(0, 0, 3) << r.slice(0, 0, 3);
    EXPECT_TRUE(close(y, xh * wd + b.to(at::kDouble)));
    EXPECT_TRUE(close(dx, r * (g - g.mean(1, true) - xh * (g * xh).mean(1, true))));
    EXPECT_TRUE(close(part[0].sum(0), (dyd * xh).sum(0)));
    EXPECT_TRUE(close(part[1].sum(0), dyd.sum(0)));
    // Without dx (an input that needs no gradient) the partial sums are the same bits.
    at::Tensor again = at::empty_like(part);
    ops::kernels::layer_norm_rows_backward(
        dy.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), w.data_ptr<float>(),
        nullptr, again.data_ptr<float>(), again.data_ptr<float>() + chunks * cols, rows, cols);
    EXPECT_TRUE(at::equal(again, part));
  }
  {
    at::Tensor y = at::empty_like(x), rstd = at::empty({rows}), dx = at::empty_like(x),
               part = at::empty({chunks, cols});
    ops::kernels::rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), 1e-5f, y.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, cols);
    ops::kernels::rms_norm_rows_backward(dy.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(),
                                         w.data_ptr<float>(), dx.data_ptr<float>(), part.data_ptr<float>(), rows, cols);
    const at::Tensor r = xd.pow(2).mean(1, true).add(1e-5).rsqrt(), xh = xd * r, g = dyd * wd;
    EXPECT_TRUE(close(rstd, r.squeeze(1)));
    EXPECT_TRUE(close(y, xh * wd));
    EXPECT_TRUE(close(dx, r * (g - xh * (g * xh).mean(1, true))));
    EXPECT_TRUE(close(part.sum(0), (dyd * xh).sum(0)));
    at::Tensor again = at::empty_like(part);
    ops::kernels::rms_norm_rows_backward(dy.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(),
                                         w.data_ptr<float>(), nullptr, again.data_ptr<float>(), rows, cols);
    EXPECT_TRUE(at::equal(again, part));
  }
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()})
    for (const bool in_dy : {false, true}) {
      at::Tensor x2 = at::randn({2, cols}), dy2 = at::randn({2, cols});
      (in_dy ? dy2 : x2)[1][cols - 1] = bad;
      at::Tensor y = at::empty_like(x2), mean = at::empty({2}), rstd = at::empty({2}), dx = at::empty_like(x2);
      at::Tensor part = at::empty({2, 1, cols});
      ops::kernels::layer_norm_rows(x2.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), 1e-5f,
                                    y.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), 2, cols);
      ops::kernels::layer_norm_rows_backward(dy2.data_ptr<float>(), x2.data_ptr<float>(), mean.data_ptr<float>(),
                                             rstd.data_ptr<float>(), w.data_ptr<float>(), dx.data_ptr<float>(),
                                             part.data_ptr<float>(), part.data_ptr<float>() + cols, 2, cols);
      EXPECT_TRUE(at::isfinite(dx[0]).all().item<bool>());
      EXPECT_FALSE(at::isfinite(dx[1]).all().item<bool>()) << "layer norm, " << bad << (in_dy ? " in dy" : " in x");
      if (!in_dy) {
        EXPECT_FALSE(at::isfinite(y[1]).all().item<bool>()) << "layer norm, " << bad;
      }
      at::Tensor rpart = at::empty({1, cols});
      ops::kernels::rms_norm_rows(x2.data_ptr<float>(), w.data_ptr<float>(), 1e-5f, y.data_ptr<float>(),
                                  rstd.data_ptr<float>(), 2, cols);
      ops::kernels::rms_norm_rows_backward(dy2.data_ptr<float>(), x2.data_ptr<float>(), rstd.data_ptr<float>(),
                                           w.data_ptr<float>(), dx.data_ptr<float>(), rpart.data_ptr<float>(), 2, cols);
      EXPECT_TRUE(at::isfinite(dx[0]).all().item<bool>());
      EXPECT_FALSE(at::isfinite(dx[1]).all().item<bool>()) << "rms norm, " << bad << (in_dy ? " in dy" : " in x");
      if (!in_dy) {
        EXPECT_FALSE(at::isfinite(y[1]).all().item<bool>()) << "rms norm, " << bad;
      }
    }
}

// A linear's bias gradient, summed in column chunks on the kernel threads, has the bits of ATen's
// one sum over every column: over ragged chunks, on one kernel thread or two, in float and double.
// With one ATen thread, as the engine runs, so that the chunks are what runs.
// A NaN pre-activation stays NaN through ReLU, as at::relu keeps it (a diverged MLP must not come
// out finite); its gradient is 0, as ATen's.
TEST(ReluKernel, KeepsNaNAsATenDoes) {
  const at::Tensor x = at::tensor({-1.0f, 0.0f, 2.0f, std::numeric_limits<float>::quiet_NaN(), -0.0f});
  at::Tensor y = at::empty_like(x);
  ops::kernels::relu_forward(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  EXPECT_TRUE(at::equal(y.isnan(), at::relu(x).isnan())) << y;
  EXPECT_TRUE(at::equal(at::nan_to_num(y, 7.0), at::nan_to_num(at::relu(x), 7.0))) << y;
}

// A row whose log-sum-exp is NaN (its logits overflowed) gets a NaN gradient, as its loss is NaN.
TEST(LogSumExpKernel, ARowWhoseLossIsNaNGetsANaNGradient) {
  const at::Tensor x = at::zeros({2, 4});
  const at::Tensor lse = at::tensor({std::log(4.0f), std::numeric_limits<float>::quiet_NaN()});
  at::Tensor y = at::empty_like(x);
  ops::kernels::softmax_from_lse_rows(x.data_ptr<float>(), lse.data_ptr<float>(), 1.0f, y.data_ptr<float>(), 2, 4);
  EXPECT_TRUE(at::allclose(y[0], at::full({4}, 0.25f)));
  EXPECT_TRUE(y[1].isnan().all().item<bool>()) << y;
}

TEST(ColumnSums, HaveTheBitsOfOneSum) {
  const testing::AtenThreads one(1);
  ASSERT_EQ(at::get_num_threads(), 1);
  at::manual_seed(8);
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{1000, 300}, {1024, 2048}, {7, 5}, {129, 513}})
    for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor x = (at::randn({rows, cols}) * 3 + 1).to(dtype);
      for (int threads : {1, 2}) {
        const detail::KernelThreads pool(threads);
        EXPECT_TRUE(testing::bitwise_equal(ops::column_sums(x), x.sum(0)))
            << rows << " x " << cols << ", " << threads << " threads";
      }
    }
}

// kernels::zeros writes every byte, over ragged chunks of its 256 KiB grain, on one kernel thread
// or two. Each call follows a tensor of the same size, filled with ones and freed, so that the
// allocator hands back memory that is not zero already.
TEST(ZerosKernel, WritesEveryByte) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{3}, {1024, 1536}, {7, 65537}, {2, 3, 5}})
    for (const at::ScalarType dtype : {at::kFloat, at::kDouble})
      for (int threads : {1, 2}) {
        const detail::KernelThreads pool(threads);
        const at::TensorOptions options = at::TensorOptions().dtype(dtype);
        at::ones(shape, options);  // freed at once
        const at::Tensor z = ops::kernels::zeros(shape, options);
        EXPECT_TRUE(testing::bitwise_equal(z, at::zeros(shape, options)))
            << at::IntArrayRef(shape) << " " << dtype << ", " << threads << " threads";
      }
}

at::Tensor mask(int64_t n, double p, uint64_t seed) {
  at::Tensor m = at::empty({n}, at::kBool);
  ops::kernels::dropout_mask(m.data_ptr<bool>(), n, p, seed);
  return m;
}

TEST(DropoutMask, SameSeedSameMask) { EXPECT_TRUE(at::equal(mask(1000, 0.3, 5), mask(1000, 0.3, 5))); }

TEST(DropoutMask, DifferentSeedsDiffer) { EXPECT_FALSE(at::equal(mask(1000, 0.3, 5), mask(1000, 0.3, 6))); }

TEST(DropoutMask, KeepsAboutOneMinusP) {
  EXPECT_NEAR(mask(200000, 0.3, 11).to(at::kDouble).mean().item<double>(), 0.7, 0.005);
}

TEST(DropoutMask, NeighbouringSeedsAreNotShiftedCopies) {
  const at::Tensor a = mask(4096, 0.5, 1).to(at::kFloat), b = mask(4096, 0.5, 2).to(at::kFloat);
  for (int shift : {0, 1, 2, 7}) {
    const double agree = (a.narrow(0, shift, 4000) == b.narrow(0, 0, 4000)).to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(agree, 0.5, 0.05) << "shift " << shift;
  }
}

// Eager PyTorch's extra saved bytes (OpDef::eager_saved), by hand on a bf16 llama block (B 2, T 16,
// C 64, 4 heads of 16, 2 key/value heads, FFN 96): each RMSNorm 4 bytes an element of its input,
// SwiGLU silu(gate) in bf16, attention the keys and values repeated to the other 2 heads (bf16);
// nothing without ModelConfig::eager_ops.
TEST(EagerOps, SavedBytesByHand) {
  ModelConfig c;
  c.arch = "llama", c.layers = 1, c.dim = 64, c.heads = 4, c.kv_heads = 2, c.ffn = 96, c.batch = 2, c.seq = 16;
  c.dtype = DType::BF16, c.attention = AttentionImpl::Flash;
  auto bytes = [](const BlockSpec& b, OpKind kind) {
    int64_t n = 0;
    for (size_t i = 0; i < b.ops.size(); ++i)
      if (b.ops[i].kind == kind) n += b.eager_saved(static_cast<int>(i));
    return n;
  };
  const BlockSpec fused = make_model(c).block;
  c.eager_ops = true;
  const BlockSpec eager = make_model(c).block;
  const int64_t tokens = 2 * 16;
  EXPECT_EQ(bytes(eager, OpKind::RmsNorm), 2 * tokens * 64 * 4);
  EXPECT_EQ(bytes(eager, OpKind::Swiglu), tokens * 96 * 2);
  EXPECT_EQ(bytes(eager, OpKind::FlashAttention), 2 * tokens * (4 - 2) * 16 * 2);
  for (OpKind k : {OpKind::RmsNorm, OpKind::Swiglu, OpKind::FlashAttention}) EXPECT_EQ(bytes(fused, k), 0);
}

// PyTorch's cross-entropy of bf16 logits cast to fp32 (Loss::Upcast), by hand on the head of a bf16
// llama (B 2, T 16, V 512): the forward's scratch is the fp32 copy (4 bytes a logit) and nll_loss's
// 4-byte total weight; the backward's peaks with both fp32 gradients (8 bytes a logit) beside the
// (tokens, 1) column; the first is freed before the op's own bf16 gradient is made. The model's
// own loss keeps only the column and the scalar.
TEST(CrossEntropy, UpcastScratchByHand) {
  ModelConfig c;
  c.arch = "llama", c.layers = 1, c.dim = 64, c.heads = 4, c.batch = 2, c.seq = 16, c.vocab = 512;
  c.dtype = DType::BF16, c.loss = Loss::Upcast;
  const int64_t tokens = 2 * 16, logits = tokens * 512;
  auto scratch = [](const ModelConfig& cfg, bool backward) {
    const BlockSpec head = make_model(cfg).head;
    for (size_t i = 0; i < head.ops.size(); ++i)
      if (head.ops[i].kind == OpKind::CrossEntropy)
        return backward ? head.backward_scratch(static_cast<int>(i), {1, 1})
                        : head.forward_scratch(static_cast<int>(i), {1, 1});
    return int64_t{-1};
  };
  EXPECT_EQ(scratch(c, false), 4 + 4 * logits);
  EXPECT_EQ(scratch(c, true), 4 * tokens + 8 * logits);
  const BlockSpec head = make_model(c).head;
  for (size_t i = 0; i < head.ops.size(); ++i) {
    if (head.ops[i].kind == OpKind::CrossEntropy) {
      EXPECT_EQ(op_def(OpKind::CrossEntropy).scratch_tensors(head, head.ops[i], true),
                (std::vector<int64_t>{4 * tokens, 4 * logits, 4 * logits, -4 * logits}));
    }
  }
  c.loss = Loss::Model;
  EXPECT_EQ(scratch(c, false), 4);
  EXPECT_EQ(scratch(c, true), 4 * tokens);
}

// Megatron-LM's fused cross-entropy under torch.compile (Loss::Fused), by hand on the same head:
// the fp32 log-probabilities kept as Fp32's are, and one more fp32 logits tensor in the forward
// (beside nll_loss's scalar) and in the backward (beside the column, alive while the op's bf16
// gradient is made: the replay's peak, one fp32 logits tensor above Fp32's). Only bf16 models run it.
TEST(CrossEntropy, FusedScratchByHand) {
  ModelConfig c;
  c.arch = "llama", c.layers = 1, c.dim = 64, c.heads = 4, c.batch = 2, c.seq = 16, c.vocab = 512;
  c.dtype = DType::BF16, c.loss = Loss::Fused;
  const int64_t tokens = 2 * 16, logits = tokens * 512;
  const BlockSpec head = make_model(c).head;
  int found = 0;
  for (size_t i = 0; i < head.ops.size(); ++i) {
    if (head.ops[i].kind != OpKind::CrossEntropy) continue;
    ++found;
    EXPECT_EQ(head.tensors[head.ops[i].out[1]].bytes(), 4 * logits);
    EXPECT_EQ(op_def(OpKind::CrossEntropy).scratch_tensors(head, head.ops[i], false),
              (std::vector<int64_t>{4, 4 * logits}));
    EXPECT_EQ(op_def(OpKind::CrossEntropy).scratch_tensors(head, head.ops[i], true),
              (std::vector<int64_t>{4 * tokens, 4 * logits}));
  }
  EXPECT_EQ(found, 1);
  auto peak = [](const ModelConfig& cfg) {
    auto spec = std::make_shared<const ModelSpec>(make_model(cfg));
    const StepMemory m = simulate_memory(compile_step(spec, Policy::parse("none").resolve(spec->block, cfg.layers)),
                                         {1, 1}, nullptr, StepShape{});
    EXPECT_NE(m.peak_at.find("'loss'"), std::string::npos) << m.peak_at;
    return m.peak;
  };
  c.batch = 8, c.seq = 32;  // more tokens: the loss's tensors outweigh the weights' gradients
  ModelConfig plain = c;
  plain.loss = Loss::Fp32;
  EXPECT_EQ(peak(c) - peak(plain), 4 * 8 * 32 * 512);
  c.dtype = DType::F16;
  EXPECT_THROW(make_model(c), Error);
}

}  // namespace
}  // namespace remat
