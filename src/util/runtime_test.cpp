#include "remat/runtime.h"

#include <gtest/gtest.h>

#include "remat/error.h"

namespace remat {
namespace {

TEST(Threads, ParsesBothForms) {
  const ThreadConfig t = parse_threads("1/2");
  EXPECT_EQ(t.aten, 1);
  EXPECT_EQ(t.blas, 2);
  EXPECT_EQ(parse_threads("2").aten, 2);
}

// fuzz_sizes found a signed overflow here ("3456123456"); under make sanitize (UBSan) the old
// parser aborts on these.
TEST(Threads, LongCountsAreRefusedWithoutOverflow) {
  for (const char* text :
       {"3456123456", "1000000000000000000000", "1/100000000000000000000", "00000000000000000000001"})
    EXPECT_THROW(parse_threads(text), Error) << text;
}

TEST(Threads, MoreThanFourPerCoreAreRefused) {
  EXPECT_THROW(parse_threads("999/1"), Error);
  EXPECT_THROW(parse_threads("1/999"), Error);
}

}  // namespace
}  // namespace remat
