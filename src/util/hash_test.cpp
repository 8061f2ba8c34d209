#include <string>

#include <gtest/gtest.h>

#include "util/hash.h"

namespace remat::detail {
namespace {

// The published FNV-1a 64 test vectors (Noll's fnv test suite): a mistyped constant fails them.
TEST(Fnv1a, MatchesThePublishedVectors) {
  auto of = [](const std::string& s) { return fnv1a(s.data(), s.size()); };
  EXPECT_EQ(of(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(of("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(of("foobar"), 0x85944171f73967e8ULL);
}

TEST(Fnv1a, ContinuesFromAPartialHash) {
  const std::string s = "foobar";
  EXPECT_EQ(fnv1a(s.data() + 3, 3, fnv1a(s.data(), 3)), fnv1a(s.data(), s.size()));
}

}  // namespace
}  // namespace remat::detail
