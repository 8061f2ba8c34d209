#include "remat/memory.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "remat/error.h"

namespace remat {
namespace {

TEST(Memory, InstalledByTheTestMain) { EXPECT_TRUE(MemoryTracker::installed()); }

TEST(Memory, CountsExactBytesOfKnownAllocations) {
  const int64_t before = MemoryTracker::live();
  {
    at::Tensor a = at::empty({1000}, at::kFloat);
    EXPECT_EQ(MemoryTracker::live() - before, 4000);
    at::Tensor b = at::empty({3, 7}, at::kDouble);
    EXPECT_EQ(MemoryTracker::live() - before, 4000 + 21 * 8);
    at::Tensor c = at::empty({5}, at::kBool);
    EXPECT_EQ(MemoryTracker::live() - before, 4000 + 168 + 5);
  }
  EXPECT_EQ(MemoryTracker::live(), before);
}

TEST(Memory, ViewsShareTheirStorage) {
  at::Tensor a = at::zeros({64, 64});
  const int64_t before = MemoryTracker::live();
  at::Tensor v = a.transpose(0, 1).narrow(0, 0, 8);
  EXPECT_EQ(MemoryTracker::live(), before);
  at::Tensor c = v.contiguous();  // a copy
  EXPECT_EQ(MemoryTracker::live() - before, 8 * 64 * 4);
}

TEST(Memory, OpOutputsAreCounted) {
  const at::Tensor a = at::randn({32, 16});
  const at::Tensor b = at::randn({16, 8});
  const int64_t before = MemoryTracker::live();
  at::Tensor c = at::mm(a, b);
  EXPECT_EQ(MemoryTracker::live() - before, 32 * 8 * 4);
}

TEST(Memory, ScopePeakSeesATransientAllocation) {
  MemoryScope scope;
  {
    at::Tensor t = at::empty({1 << 18}, at::kFloat);  // 1 MiB
  }
  EXPECT_EQ(scope.delta(), 0);
  EXPECT_EQ(scope.peak(), 1 << 20);
}

TEST(Memory, ScopesNest) {
  MemoryScope outer;
  at::Tensor a = at::empty({1024}, at::kFloat);
  {
    MemoryScope inner;
    at::Tensor b = at::empty({2048}, at::kFloat);
    EXPECT_EQ(inner.peak(), 8192);
  }
  EXPECT_EQ(outer.peak(), 4096 + 8192);
  EXPECT_EQ(outer.delta(), 4096);
}

TEST(Memory, CacheServesTheSameSizeAgain) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the free-block cache is off under AddressSanitizer";
#endif
  { at::Tensor warm = at::empty({12345}, at::kFloat); }
  const int64_t reserved = MemoryTracker::reserved();
  EXPECT_GE(reserved - MemoryTracker::live(), 12345 * 4) << "the freed block is cached";
  { at::Tensor again = at::empty({12345}, at::kFloat); }
  EXPECT_EQ(MemoryTracker::reserved(), reserved);  // no new block
  MemoryTracker::release_cache();
  EXPECT_EQ(MemoryTracker::reserved(), MemoryTracker::live());
}

TEST(Memory, CountsAllocationsIncludingEmptyTensors) {
  const int64_t n = MemoryTracker::allocations();
  const int64_t before = MemoryTracker::live();
  at::Tensor e = at::empty({0}, at::kFloat);
  at::Tensor f = at::empty({4}, at::kFloat);
  EXPECT_EQ(MemoryTracker::allocations() - n, 2);  // the empty tensor's storage is allocated too
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(MemoryTracker::live() - before, 16);
}

// A negative limit would otherwise mean no limit (or no cache) to a caller who computed it wrong.
TEST(Memory, ANegativeLimitIsRefused) {
  EXPECT_THROW(MemoryTracker::set_limit(-1), Error);
  EXPECT_THROW(MemoryTracker::set_cache_limit(-1), Error);
  EXPECT_EQ(MemoryTracker::limit(), 0);
}

TEST(Memory, ALimitRefusesWhatWouldPassIt) {
  const int64_t live = MemoryTracker::live();
  MemoryTracker::set_limit(live + 4096);
  at::Tensor fits = at::empty({1024}, at::kFloat);  // exactly at the limit
  try {
    at::Tensor over = at::empty({1}, at::kFloat);
    MemoryTracker::set_limit(0);
    FAIL() << "an allocation over the limit was made";
  } catch (const OutOfMemory& e) {
    MemoryTracker::set_limit(0);
    EXPECT_EQ(e.requested(), 4);
    EXPECT_EQ(e.live(), live + 4096);
    EXPECT_EQ(e.limit(), live + 4096);
  }
  EXPECT_EQ(MemoryTracker::live(), live + 4096);  // the refused one was never counted
}

}  // namespace
}  // namespace remat
