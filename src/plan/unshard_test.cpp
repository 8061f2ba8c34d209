// FSDP2's unshard of one unit, request by request, by hand.
#include "plan/unshard.h"

#include <gtest/gtest.h>

namespace remat::detail {
namespace {

std::vector<std::vector<int64_t>> rows(const std::vector<UnshardRequest>& r) {
  std::vector<std::vector<int64_t>> out;
  for (const UnshardRequest& x : r) out.push_back({x.bytes, x.stream, x.frees});
  return out;
}

// On one rank (PyTorch 2.11's requests in validation/allocator/): each parameter cast, then copied;
// a cast goes once the next is made, the last at the end. No all-gather buffer.
TEST(Unshard, OneRankCastsEachParameterAndGathersNothing) {
  EXPECT_EQ(
      rows(unshard_requests({4, 2, 2}, 1, true, 1)),
      (std::vector<std::vector<int64_t>>{
          {4, 0, -1}, {4, 0, -1}, {2, 0, -1}, {0, 0, 0}, {2, 0, -1}, {2, 0, -1}, {0, 0, 2}, {2, 0, -1}, {0, 0, 5}}));
  EXPECT_EQ(rows(unshard_requests({4, 2, 2}, 1, false, 1)),
            (std::vector<std::vector<int64_t>>{{4, 0, -1}, {2, 0, -1}, {2, 0, -1}}));
}

// Across ranks: the flat buffer of the whole unit on the all-gather stream, then the parameters.
TEST(Unshard, AcrossRanksTheFlatBufferComesFirstOnItsStream) {
  EXPECT_EQ(rows(unshard_requests({4, 2, 2}, 8, true, 1)),
            (std::vector<std::vector<int64_t>>{{8, 1, -1}, {4, 0, -1}, {2, 0, -1}, {2, 0, -1}}));
}

}  // namespace
}  // namespace remat::detail
