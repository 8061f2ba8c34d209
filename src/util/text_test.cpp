#include "util/text.h"

#include <gtest/gtest.h>

namespace remat {
namespace {

using Fields = std::vector<std::string>;

TEST(SplitFields, KeepsEveryFieldEmptyOnesIncluded) {
  EXPECT_EQ(split_fields("a,bc,d", ','), (Fields{"a", "bc", "d"}));
  EXPECT_EQ(split_fields("a,,b", ','), (Fields{"a", "", "b"}));
  EXPECT_EQ(split_fields("a,", ','), (Fields{"a", ""}));
  EXPECT_EQ(split_fields(",a", ','), (Fields{"", "a"}));
  EXPECT_EQ(split_fields("", ','), (Fields{""}));
}

}  // namespace
}  // namespace remat
