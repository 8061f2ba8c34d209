#include <gtest/gtest.h>

#include "remat/units.h"

namespace remat {
namespace {

TEST(Units, BinarySizes) {
  EXPECT_EQ(bytes_str(512), "512 B");
  EXPECT_EQ(bytes_str(3 << 20), "3.0 MiB");
  EXPECT_EQ(bytes_str(int64_t{3} << 39), "1.50 TiB");
}

// Near a minimum both sizes are printed with the digits that tell them apart.
TEST(Units, PairsShowTheDifference) {
  EXPECT_EQ(bytes_str(925163520), bytes_str(925171712));  // the defect: "882.3 MiB ... is 882.3 MiB"
  const auto [a, b] = bytes_pair_str(925163520, 925171712);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, "882.30 MiB");
  const auto [c, d] = bytes_pair_str(925163520, 925163521);
  EXPECT_EQ(c, "925163520 B");
  EXPECT_EQ(d, "925163521 B");
  EXPECT_EQ(bytes_pair_str(1 << 20, 1 << 20).first, "1.0 MiB");
}

TEST(Units, TimesInTheUnitPeopleUse) {
  EXPECT_EQ(seconds_str(0.0421), "42 ms");
  EXPECT_EQ(seconds_str(12.44), "12.4 s");
  EXPECT_EQ(seconds_str(1538880.9529), "17.8 days");
  EXPECT_EQ(seconds_str(5400), "1.5 h");
}

}  // namespace
}  // namespace remat
