#include "remat/blas_kernel.h"

#include <algorithm>

#include <gtest/gtest.h>

namespace remat::blas {
namespace {

CpuFeatures intel_avx512(bool bf16) {
  CpuFeatures f;
  f.intel = f.sse42 = f.avx = f.avx2 = f.fma = f.avx512 = true;
  f.avx512_bf16 = bf16;
  return f;
}

// A machine seen in practice: an Intel Xeon (model 207, AVX-512 with bf16) that Debian's OpenBLAS
// 0.3.21 does not know, so it loads its SSE3 kernels.
TEST(BlasKernel, AutoUpgradesAKernelBelowTheCpu) {
  EXPECT_EQ(upgrade(intel_avx512(true), "Prescott"), "Cooperlake");
  EXPECT_EQ(upgrade(intel_avx512(false), "Prescott"), "SkylakeX");
  EXPECT_EQ(upgrade(intel_avx512(false), "Haswell"), "SkylakeX");
}

TEST(BlasKernel, AutoKeepsWhatOpenBlasChoseForACpuItKnows) {
  CpuFeatures zen3;
  zen3.amd = zen3.sse42 = zen3.avx = zen3.avx2 = zen3.fma = true;
  EXPECT_EQ(best_kernel(zen3), "Zen");
  EXPECT_EQ(upgrade(zen3, "Zen"), "");
  EXPECT_EQ(upgrade(zen3, "Haswell"), "");  // the same instruction set: no reason to move
  EXPECT_EQ(upgrade(intel_avx512(true), "Cooperlake"), "");
  EXPECT_EQ(upgrade(intel_avx512(true), "SomethingNew"), "");  // unknown to remat: OpenBLAS knows better
}

TEST(BlasKernel, BestKernelFollowsTheInstructionSet) {
  CpuFeatures f;
  EXPECT_EQ(best_kernel(f), "Prescott");
  f.sse42 = true;
  EXPECT_EQ(best_kernel(f), "Nehalem");
  f.avx = true;
  EXPECT_EQ(best_kernel(f), "Sandybridge");
  f.avx2 = f.fma = f.intel = true;
  EXPECT_EQ(best_kernel(f), "Haswell");
}

// The kernel remat would pick here is one OpenBLAS has and this CPU can run.
TEST(BlasKernel, ThisCpuRunsTheKernelRematWouldPick) {
  const CpuFeatures f = cpu_features();
  const std::string best = best_kernel(f);
  const auto& known = known_kernels();
  EXPECT_NE(std::find(known.begin(), known.end(), best), known.end()) << best;
  EXPECT_TRUE(can_run(f, best)) << best;
}

TEST(BlasKernel, SelfCheckPassesTheLoadedKernelAndCatchesAWrongElement) {
  EXPECT_TRUE(sgemm_self_check());
  EXPECT_FALSE(sgemm_self_check(1e-2f));
}

}  // namespace
}  // namespace remat::blas
