#include "remat/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

std::vector<std::string> recomputed(const BlockSpec& b, const std::string& policy) {
  const Schedule s = compile_schedule(b, Policy::parse(policy).resolve(b, 1).layers[0]);
  std::vector<std::string> names;
  for (int op : s.recomputed) names.push_back(b.ops[op].name);
  return names;
}

using Names = std::vector<std::string>;

TEST(Schedule, NoneRecomputesNothing) { EXPECT_EQ(recomputed(make_block(tiny("gpt2", 0.1)), "none"), Names{}); }

TEST(Schedule, FullNeverRecomputesTheLastMatmul) {
  // The seed block's backward never reads the FFN's second linear output or the block output.
  EXPECT_EQ(recomputed(make_block(tiny("seed")), "full"),
            (Names{"qkv", "scores", "probs", "atty", "proj", "x2", "fc", "act"}));
  const Names gpt2 = recomputed(make_block(tiny("gpt2", 0.1)), "full");
  EXPECT_EQ(std::count(gpt2.begin(), gpt2.end(), "mlp"), 0);
  EXPECT_EQ(std::count(gpt2.begin(), gpt2.end(), "mlp_drop"), 0);
  EXPECT_EQ(std::count(gpt2.begin(), gpt2.end(), "mlp_mask"), 1);  // from its seed alone
}

TEST(Schedule, EachOpRecomputedAtMostOnce) {
  const BlockSpec b = make_block(tiny("gpt2", 0.1));
  for (const char* p : {"full", "attn", "norm+mlp", "save:ln2"}) {
    Names r = recomputed(b, p);
    std::sort(r.begin(), r.end());
    EXPECT_EQ(std::adjacent_find(r.begin(), r.end()), r.end()) << p;
  }
}

TEST(Schedule, AttnRecomputesOnlyTheCoreAttention) {
  EXPECT_EQ(recomputed(make_block(tiny("gpt2", 0.1)), "attn"), (Names{"scores", "probs", "probs_mask", "probs_drop"}));
}

TEST(Schedule, MlpActRecomputesOnlyTheActivation) {
  EXPECT_EQ(recomputed(make_block(tiny("gpt2")), "mlp-act"), (Names{"act"}));
}

TEST(Schedule, KeptMaskMakesDropoutRecomputeCheap) {
  // probs_drop is rebuilt from probs and the kept mask: the mask op does not rerun.
  EXPECT_EQ(recomputed(make_block(tiny("gpt2", 0.1)), "drop:probs_drop"), (Names{"probs_drop"}));
}

// The gradient plan of input `i` of op `op`'s backward step.
GradStep plan_of(const BlockSpec& b, const std::string& policy, const std::string& op, int i,
                 std::vector<bool> need = {}) {
  const Schedule s = compile_schedule(b, Policy::parse(policy).resolve(b, 1).layers[0], need);
  for (const Step& st : s.backward)
    if (st.kind == Step::Kind::Backward && b.ops[st.index].name == op) return st.grads[i];
  ADD_FAILURE() << "no backward step for " << op;
  return {};
}

bool overwrites_input0(const BlockSpec& b, const std::string& policy, const std::string& op) {
  return plan_of(b, policy, op, 0).source == GradSource::OverInput;
}

TEST(Schedule, DroppedOutProbsDieInTheValuesBackward) {
  // With dropout, attn_values reads probs_drop and nothing after it does: dprobs_drop goes over it.
  for (const char* p : {"none", "full", "attn"})
    EXPECT_TRUE(overwrites_input0(make_block(tiny("gpt2", 0.1)), p, "atty")) << p;
  // Without dropout the softmax backward still reads probs after attn_values: no overwrite.
  EXPECT_FALSE(overwrites_input0(make_block(tiny("gpt2")), "none", "atty"));
  EXPECT_FALSE(overwrites_input0(make_block(tiny("seed")), "full", "atty"));
}

// Replays a schedule on "held" flags: no step may read a tensor that is not held, a free must drop
// a held tensor, the forward must end holding exactly the saved set, the backward nothing.
TEST(Schedule, NeverReadsAFreedTensorAndEndsHoldingNothing) {
  const BlockSpec b = make_block(tiny("gpt2", 0.1));
  for (const char* p : {"none", "full", "attn+mlp-act", "norm", "save:x2", "drop:probs_drop"}) {
    const Schedule s = compile_schedule(b, Policy::parse(p).resolve(b, 1).layers[0]);
    std::vector<bool> held(b.tensors.size(), false);
    for (int in : b.inputs) held[in] = true;
    auto run = [&](const std::vector<Step>& steps) {
      for (const Step& st : steps) {
        if (st.kind == Step::Kind::Free) {
          EXPECT_TRUE(held[st.index]) << p << ": frees '" << b.tensors[st.index].name << "' twice";
          held[st.index] = false;
        } else if (st.kind == Step::Kind::Forward || st.kind == Step::Kind::Recompute) {
          for (int t : b.ops[st.index].in)
            EXPECT_TRUE(held[t]) << p << ": op '" << b.ops[st.index].name << "' reads freed '" << b.tensors[t].name
                                 << "'";
          for (int t : b.ops[st.index].out) held[t] = true;
        } else if (st.kind == Step::Kind::Backward) {
          for (int t : b.bwd_reads(st.index))
            EXPECT_TRUE(held[t]) << p << ": backward of '" << b.ops[st.index].name << "' reads freed '"
                                 << b.tensors[t].name << "'";
          // An input the gradient is written over becomes that gradient: no Free drops it.
          const OpNode& op = b.ops[st.index];
          for (size_t i = 0; i < op.in.size(); ++i)
            if (st.grads[i].source == GradSource::OverInput) held[op.in[i]] = false;
        }
      }
    };
    run(s.forward);
    held[b.output] = false;  // returned to the caller
    for (size_t t = 0; t < held.size(); ++t)
      EXPECT_EQ(held[t], s.saved[t]) << p << ": after forward, " << b.tensors[t].name;
    run(s.backward);
    for (size_t t = 0; t < held.size(); ++t) EXPECT_FALSE(held[t]) << p << ": after backward, " << b.tensors[t].name;
  }
}

TEST(GradPlan, PointwiseBackwardsWriteOverDyOnlyWhenItIsTheirs) {
  // GELU's dy is the MLP's second linear's fresh dx: GELU's dx goes over it.
  EXPECT_EQ(plan_of(make_block(tiny("gpt2")), "none", "act", 0).source, GradSource::OverDy);
  // With dropout, mlp_drop's dy is the residual add's output gradient, shared with x2: a fresh dx.
  EXPECT_EQ(plan_of(make_block(tiny("gpt2", 0.1)), "none", "mlp_drop", 0).source, GradSource::Fresh);
}

TEST(GradPlan, ResidualAddsPassDyThroughAndTheFirstFreshGradientTakesOver) {
  const BlockSpec b = make_block(tiny("gpt2"));
  EXPECT_EQ(plan_of(b, "none", "y", 0).source, GradSource::Alias);
  EXPECT_EQ(plan_of(b, "none", "y", 1).source, GradSource::Alias);
  // ln2's dx meets x2's shared gradient: dx += the shared one, and becomes x2's own.
  const GradStep ln2 = plan_of(b, "none", "ln2", 0);
  EXPECT_EQ(ln2.source, GradSource::Fresh);
  EXPECT_EQ(ln2.merge, GradMerge::AddSlotIntoIt);
}

TEST(GradPlan, AttentionAddsIntoOneSlotOfQkv) {
  const BlockSpec b = make_block(tiny("gpt2"));
  const GradStep values = plan_of(b, "none", "atty", 1), scores = plan_of(b, "none", "scores", 0);
  EXPECT_EQ(values.source, GradSource::Slot);
  EXPECT_EQ(values.prep, SlotPrep::Zeros);  // attn_values' backward runs first
  EXPECT_EQ(scores.source, GradSource::Slot);
  EXPECT_EQ(scores.prep, SlotPrep::Existing);
}

TEST(GradPlan, AnInputThatNeedsNoGradientGetsNone) {
  const BlockSpec b = make_block(tiny("seed"));
  EXPECT_EQ(plan_of(b, "none", "qkv", 0, {false}).source, GradSource::None);
  EXPECT_EQ(plan_of(b, "none", "qkv", 0, {true}).source, GradSource::Fresh);
}

TEST(Schedule, SavedBytesFollowTheTable) {
  const BlockSpec b = make_block(tiny("gpt2"));
  const Schedule none = compile_schedule(b, Policy::parse("none").resolve(b, 1).layers[0]);
  int64_t want = 0;
  for (int t : b.choosable()) want += b.tensors[t].bytes();
  EXPECT_EQ(none.saved_bytes(b), want);
  const Schedule full = compile_schedule(b, Policy::parse("full").resolve(b, 1).layers[0]);
  EXPECT_EQ(full.saved_bytes(b), 0);  // only the input, which is not counted
}

// Eager recompute (torch.utils.checkpoint's order): every recompute before the first backward, in
// forward order; lazy (remat's executor): the first backward op runs before the last recompute.
TEST(Schedule, EagerRecomputesEverythingFirstInForwardOrder) {
  ModelConfig c;
  c.arch = "llama", c.layers = 2, c.dim = 16, c.heads = 4, c.batch = 2, c.seq = 8, c.vocab = 11;
  const BlockSpec b = make_block(c);
  LayerPolicy p = Policy::parse("full").resolve(b, 1).layers[0];
  auto first_backward_and_last_recompute = [&](bool eager) {
    p.eager = eager;
    const Schedule s = compile_schedule(b, p);
    int first_bwd = -1, last_rec = -1, prev_op = -1;
    bool ordered = true;
    for (int i = 0; i < static_cast<int>(s.backward.size()); ++i) {
      const Step& st = s.backward[i];
      if (st.kind == Step::Kind::Backward && first_bwd < 0) first_bwd = i;
      if (st.kind == Step::Kind::Recompute) {
        last_rec = i;
        ordered = ordered && st.index > prev_op;
        prev_op = st.index;
      }
    }
    return std::make_tuple(first_bwd, last_rec, ordered);
  };
  const auto [eager_bwd, eager_rec, eager_ordered] = first_backward_and_last_recompute(true);
  EXPECT_LT(eager_rec, eager_bwd);
  EXPECT_TRUE(eager_ordered);
  const auto [lazy_bwd, lazy_rec, lazy_ordered] = first_backward_and_last_recompute(false);
  EXPECT_GT(lazy_rec, lazy_bwd);
}

}  // namespace
}  // namespace remat
