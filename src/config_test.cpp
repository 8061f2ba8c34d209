#include "remat/config.h"

#include <gtest/gtest.h>

#include "remat/error.h"

namespace remat {
namespace {

ModelConfig tiny() {
  ModelConfig c;
  c.layers = 2; c.dim = 16; c.heads = 4; c.batch = 2; c.seq = 8;
  return c;
}

TEST(Config, DefaultIsTheSeedExperiment) {
  const ModelConfig c;
  EXPECT_EQ(c.arch, Arch::Seed);
  EXPECT_EQ(c.layers, 6);
  EXPECT_EQ(c.dim, 512);
  EXPECT_EQ(c.heads, 8);
  EXPECT_EQ(c.batch, 8);
  EXPECT_EQ(c.seq, 128);
  EXPECT_EQ(c.hidden(), 2048);
  EXPECT_NO_THROW(validate(c));
}

TEST(Config, RejectsDimNotDivisibleByHeads) {
  ModelConfig c = tiny();
  c.heads = 3;
  try {
    validate(c);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--dim 16 is not divisible by --heads 3"), std::string::npos) << e.what();
    EXPECT_EQ(e.kind(), Error::Kind::Usage);
  }
}

TEST(Config, RejectsNonPositiveSizes) {
  for (int field = 0; field < 5; ++field) {
    ModelConfig c = tiny();
    int64_t* f[] = {&c.layers, &c.dim, &c.heads, &c.batch, &c.seq};
    *f[field] = field % 2 ? 0 : -3;
    EXPECT_THROW(validate(c), Error) << "field " << field;
  }
}

TEST(Config, RejectsDropoutOutsideRangeOrOnSeed) {
  ModelConfig c = tiny();
  c.arch = Arch::Gpt2;
  c.dropout = 1.0;
  EXPECT_THROW(validate(c), Error);
  c.dropout = 0.1;
  EXPECT_NO_THROW(validate(c));
  c.arch = Arch::Seed;
  EXPECT_THROW(validate(c), Error);
}

TEST(Config, ParsersNameTheAllowedValues) {
  EXPECT_EQ(parse_arch("gpt2"), Arch::Gpt2);
  EXPECT_EQ(parse_dtype("bf16"), DType::BF16);
  try {
    parse_arch("llama");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "unknown --arch 'llama'; allowed: seed, gpt2");
  }
  EXPECT_THROW(parse_dtype("fp8"), Error);
  EXPECT_THROW(parse_attention("sdpa"), Error);
}

}  // namespace
}  // namespace remat
