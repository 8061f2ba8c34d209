#include "remat/block.h"

#include <gtest/gtest.h>

#include "remat/error.h"
#include "remat/policy.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

std::vector<std::string> names(const BlockSpec& b, const std::vector<int>& ids) {
  std::vector<std::string> out;
  for (int t : ids) out.push_back(b.tensors[t].name);
  return out;
}

TEST(Block, SeedKeepsWhatItsBackwardsRead) {
  const BlockSpec b = make_block(tiny("seed"));
  EXPECT_EQ(b.kind, "seed");
  // scores (softmax backward reads its output), fc (ReLU backward reads its output), proj and mlp
  // (nobody reads them) are transient.
  EXPECT_EQ(names(b, b.choosable()), (std::vector<std::string>{"qkv", "probs", "atty", "x2", "act"}));
  EXPECT_EQ(b.tensors[b.output].name, "y");
  ASSERT_EQ(b.inputs.size(), 1u);
  EXPECT_EQ(b.tensors[b.inputs[0]].name, "x");
}

TEST(Block, Gpt2WithDropoutHasMasks) {
  const BlockSpec b = make_block(tiny("gpt2", 0.1));
  EXPECT_EQ(names(b, b.choosable()),
            (std::vector<std::string>{"ln1", "ln1_mean", "ln1_rstd", "qkv", "probs", "probs_mask", "probs_drop", "atty",
                                      "proj_mask", "x2", "ln2", "ln2_mean", "ln2_rstd", "fc", "act", "mlp_mask"}));
  EXPECT_EQ(b.tensors[b.find("probs_mask")].dtype, DType::Bool);
  EXPECT_EQ(b.tensors[b.find("ln1_mean")].dtype, DType::F32);
}

TEST(Block, ShapesAndBytesFollowTheConfig) {
  ModelConfig c = tiny("gpt2", 0.1);
  c.attn_block = 128;  // T <= attn_block: one block
  const BlockSpec b = make_block(c);
  const TensorSpec& probs = b.tensors[b.find("probs")];
  EXPECT_EQ(probs.shape, (std::vector<int64_t>{2, 4, 8, 8}));
  EXPECT_EQ(probs.bytes(), 2 * 4 * 8 * 8 * 4);
  EXPECT_EQ(b.tensors[b.find("probs_mask")].bytes(), 2 * 4 * 8 * 8);
  EXPECT_EQ(b.tensors[b.find("fc")].shape, (std::vector<int64_t>{2, 8, 64}));
  EXPECT_EQ(b.tensors[b.find("qkv")].shape, (std::vector<int64_t>{2, 8, 48}));
}

TEST(Block, CausalProbsArePackedInRowBlocks) {
  const BlockSpec b = make_block(tiny("gpt2"));  // T = 8: blocks of 4 rows keep 4 and 8 columns
  EXPECT_EQ(b.tensors[b.find("probs")].shape, (std::vector<int64_t>{2 * 4 * (4 * 4 + 4 * 8)}));
}

TEST(Block, FlashAttentionStoresNoTxTTensor) {
  ModelConfig c = tiny("gpt2", 0.1);
  c.attention = AttentionImpl::Flash;
  const BlockSpec b = make_block(c);
  EXPECT_EQ(b.find("probs"), -1);
  EXPECT_EQ(b.find("probs_mask"), -1);
  EXPECT_EQ(b.tensors[b.find("lse")].shape, (std::vector<int64_t>{2, 4, 8}));
  EXPECT_EQ(names(b, b.bwd_reads(b.tensors[b.find("atty")].producer)),
            (std::vector<std::string>{"qkv", "atty", "lse"}));
}

// attends_causally is what decides the flash default (remat plan): it must name exactly the kinds
// whose blocks build under flash attention.
TEST(Block, FlashAttentionBuildsForTheCausalKindsOnly) {
  for (const std::string& kind : block_kinds()) {
    ModelConfig cfg = tiny(kind);
    cfg.attention = AttentionImpl::Flash;
    if (attends_causally(kind))
      EXPECT_NO_THROW(make_block(cfg)) << kind;
    else
      EXPECT_THROW(make_block(cfg), Error) << kind;
  }
}

TEST(Block, MatmulFlopsOfTheSeedBlock) {
  ModelConfig c = tiny("seed");
  const BlockSpec b = make_block(c);
  const int64_t m = c.batch * c.seq, C = c.dim, F = c.hidden();
  // Linears: qkv, proj, fc, mlp; attention: two (B,H,T,T)x(B,H,T,D) products.
  const int64_t linear = 2 * m * (3 * C * C + C * C + 2 * C * F);
  const int64_t attention = 2 * 2 * c.batch * c.heads * c.seq * c.seq * c.head_dim();
  EXPECT_EQ(b.flops().forward, linear + attention);
  EXPECT_EQ(b.flops().backward, 2 * (linear + attention));
}

// Without a stem the first block reads the data, which needs no gradient: a step computes every
// block's FLOPs but the first one's qkv dx.
TEST(Block, SeedStepSkipsTheFirstBlocksInputGradient) {
  ModelConfig c = tiny("seed");
  const ModelSpec m = make_model(c);
  ASSERT_FALSE(m.has_stem);
  const OpFlops b = m.block.flops(), h = m.head.flops();
  const int64_t qkv_dx = 2 * c.batch * c.seq * c.dim * 3 * c.dim;
  EXPECT_EQ(m.step_flops(), m.layers * (b.forward + b.backward) + h.forward + h.backward - qkv_dx);
}

TEST(Block, ParamsInModuleOrder) {
  const BlockSpec b = make_block(tiny("seed"));
  std::vector<std::string> p;
  for (const ParamSpec& s : b.params) p.push_back(s.name);
  EXPECT_EQ(p, (std::vector<std::string>{"qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc.weight", "fc.bias",
                                         "mlp.weight", "mlp.bias"}));
  EXPECT_EQ(b.param_numel(), 12 * 16 * 16 + 3 * 16 + 16 + 64 + 16);
}

// Roles, not names: every kind's parameters say how they start and whether they decay, and norms
// start at one (an RMSNorm weight not named "ln*" must not get N(0, 0.02)).
TEST(Block, EveryKindGivesItsParametersRoles) {
  for (const std::string& kind : testing::all_kinds()) {
    const ModelSpec m = make_model(tiny(kind));
    for (const BlockSpec* s : {&m.stem, &m.block, &m.head})
      for (const OpNode& op : s->ops)
        for (int p : op.params) {
          const ParamSpec& ps = s->params[p];
          const bool norm = s->tensors[op.out[0]].tags & tag::kNormOut;
          if (norm && p == op.params[0]) {
            EXPECT_EQ(ps.init, Init::Ones) << kind << " " << ps.name;
          }
          if (ps.shape.size() == 1) {
            EXPECT_FALSE(ps.decay) << kind << " " << ps.name;  // biases, norms
          }
        }
  }
}

TEST(Block, EveryKindBuildsItsStagesAndTheTiedHeadPointsBack) {
  for (const std::string& kind : testing::all_kinds()) {
    const ModelSpec m = make_model(tiny(kind));
    EXPECT_EQ(m.arch, kind);
    EXPECT_FALSE(m.block.choosable().empty()) << kind;
    for (const ParamSpec& p : m.head.params)
      if (!p.tied_to.empty()) {
        bool found = false;
        for (const ParamSpec& s : m.stem.params) found = found || s.name == p.tied_to;
        EXPECT_TRUE(found) << kind << ": " << p.name << " is tied to '" << p.tied_to << "', which the stem lacks";
      }
  }
}

// LLaMA-2's published parameter counts, from the tensor table alone (nothing is allocated).
TEST(Block, LlamaParameterCountsArePublished) {
  ModelConfig c;
  c.arch = "llama";
  c.dtype = DType::BF16;
  c.batch = 1;
  c.seq = 4096;
  c.vocab = 32000;
  c.layers = 32, c.dim = 4096, c.heads = 32, c.ffn = 11008;
  EXPECT_EQ(make_model(c).param_numel(), 6'738'415'616);
  c.layers = 80, c.dim = 8192, c.heads = 64, c.kv_heads = 8, c.ffn = 28672;
  EXPECT_EQ(make_model(c).param_numel(), 68'976'648'192);
}

TEST(Block, LlamaSharesKeysAndValuesAcrossQueryHeads) {
  ModelConfig c = tiny("llama");
  c.kv_heads = 2;
  const BlockSpec b = make_block(c);
  EXPECT_EQ(b.tensors[b.find("q_rot")].shape, (std::vector<int64_t>{2, 8, 16}));  // 4 q heads of 4
  EXPECT_EQ(b.tensors[b.find("k_rot")].shape, (std::vector<int64_t>{2, 8, 8}));   // 2 k heads
  EXPECT_EQ(b.tensors[b.find("v")].shape, (std::vector<int64_t>{2, 8, 8}));
  EXPECT_EQ(b.tensors[b.find("q")].read_by_backward, false);  // rope's backward reads nothing
  EXPECT_EQ(b.tensors[b.find("k")].read_by_backward, false);
  c.kv_heads = 3;
  EXPECT_THROW(make_block(c), Error);
}

}  // namespace
}  // namespace remat
