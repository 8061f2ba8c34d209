// The test binary's main: the tracking allocator must be LibTorch's CPU allocator before any tensor
// exists, or the memory tests could not be exact.
#include <gtest/gtest.h>

#include "remat/memory.h"

int main(int argc, char** argv) {
  remat::MemoryTracker::install();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
