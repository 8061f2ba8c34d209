#include "remat/config.h"

#include <gtest/gtest.h>

#include "remat/block.h"
#include "remat/error.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

std::string error_of(const ModelConfig& c) {
  try {
    validate(c);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Usage);
    return e.what();
  }
  return "";
}

TEST(Config, DefaultIsTheSeedExperiment) {
  const ModelConfig c;
  EXPECT_EQ(c.arch, "seed");
  EXPECT_EQ(c.layers, 6);
  EXPECT_EQ(c.dim, 512);
  EXPECT_EQ(c.heads, 8);
  EXPECT_EQ(c.batch, 8);
  EXPECT_EQ(c.seq, 128);
  EXPECT_EQ(c.hidden(), 2048);
  EXPECT_NO_THROW(validate(c));
}

// Under expert parallelism each rank rounds its own capacity up and an expert takes that from every
// rank (Megatron-LM): 4 ranks of 10 tokens, top-2 of 8 experts at c = 1 give 4 x ceil(2.5) = 12
// rows, not ceil(10) over the group's tokens.
TEST(Config, ExpertCapacityIsRoundedPerSendingRank) {
  ModelConfig c = tiny("moe");
  c.batch = 1, c.seq = 10, c.experts = 8, c.top_k = 2, c.capacity_factor = 1.0;
  EXPECT_EQ(c.expert_capacity(), 3);
  c.ep = 4;
  EXPECT_EQ(c.expert_capacity(), 12);
  EXPECT_EQ(c.dispatch_rows(), c.rank_experts() * 12 * c.etp);
}

TEST(Config, RejectsDimNotDivisibleByHeadsNamingTheFields) {
  ModelConfig c = tiny("seed");
  c.heads = 3;
  EXPECT_EQ(error_of(c).find("ModelConfig.dim 16 is not divisible by ModelConfig.heads 3"), 0u) << error_of(c);
}

TEST(Config, RejectsNonPositiveSizes) {
  for (int field = 0; field < 5; ++field) {
    ModelConfig c = tiny("seed");
    int64_t* f[] = {&c.layers, &c.dim, &c.heads, &c.batch, &c.seq};
    *f[field] = field % 2 ? 0 : -3;
    EXPECT_NE(error_of(c).find("must be a positive integer"), std::string::npos) << "field " << field;
  }
}

// A seed block's heads are dim / heads wide (its q, k and v sit at columns 0, dim and 2 dim): a head
// size of its own would read past its qkv rows.
TEST(Config, TheSeedBlockRefusesAHeadSize) {
  ModelConfig c = tiny("seed");
  c.head_size = 8;
  EXPECT_NE(error_of(c).find("this model sets ModelConfig.head_size"), std::string::npos) << error_of(c);
}

// A chunked loss of 0 chunks would run as one and print as chunked:0.
TEST(Config, RejectsAChunkedLossOfNoChunks) {
  ModelConfig c = tiny("gpt2");
  c.loss = Loss::Chunked;
  c.loss_chunks = 0;
  EXPECT_NE(error_of(c).find("ModelConfig.loss_chunks must be in 1..999999 for the chunked loss (chunked:N), got 0"),
            std::string::npos)
      << error_of(c);
  c.loss_chunks = 4;
  EXPECT_EQ(error_of(c), "");
}

TEST(Config, RejectsDropoutOutsideRangeOrOnSeed) {
  ModelConfig c = tiny("gpt2");
  c.dropout = 1.0;
  EXPECT_NE(error_of(c), "");
  c.dropout = 0.1;
  EXPECT_EQ(error_of(c), "");
  c.arch = "seed";
  EXPECT_NE(error_of(c).find("not available for arch seed"), std::string::npos) << error_of(c);
}

TEST(Config, UnknownKindListsTheRegisteredOnes) {
  ModelConfig c = tiny("gpt5");
  std::string allowed;
  for (const std::string& k : block_kinds()) allowed += (allowed.empty() ? "" : ", ") + k;
  EXPECT_EQ(error_of(c), "unknown ModelConfig.arch 'gpt5'; allowed: " + allowed);
}

TEST(Config, KvHeadsMustDivideHeads) {
  ModelConfig c = tiny("gpt2");
  c.kv_heads = 3;
  EXPECT_NE(error_of(c).find("ModelConfig.heads 4 is not divisible by ModelConfig.kv_heads 3"), std::string::npos)
      << error_of(c);
}

TEST(Config, ParsersNameTheAllowedValues) {
  EXPECT_EQ(parse_dtype("bf16"), DType::BF16);
  try {
    parse_dtype("fp8");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "unknown ModelConfig.dtype 'fp8'; allowed: fp32, bf16, fp16");
  }
  EXPECT_THROW(parse_attention("sdpa"), Error);
}

}  // namespace
}  // namespace remat
