#include "remat/blas_kernel.h"

#include <algorithm>
#include <fstream>
#include <string>

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

// What cpu_features() reads from CPUID agrees with the kernel's /proc/cpuinfo on the units the
// kernel choice depends on (AVX-512 also needs the OS to save the ZMM state, so only one way).
TEST(BlasKernel, CpuFeaturesAgreeWithProcCpuinfo) {
  std::ifstream in("/proc/cpuinfo");
  std::string line, flags, vendor;
  while (std::getline(in, line) && (flags.empty() || vendor.empty())) {
    if (line.rfind("flags", 0) == 0 && flags.empty()) flags = line.substr(line.find(':') + 1) + " ";
    if (line.rfind("vendor_id", 0) == 0 && vendor.empty()) vendor = line.substr(line.find(':') + 1);
  }
  if (flags.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo";
  const auto has = [&](const std::string& flag) { return flags.find(" " + flag + " ") != std::string::npos; };
  const CpuFeatures f = cpu_features();
  EXPECT_EQ(f.sse42, has("sse4_2"));
  EXPECT_EQ(f.avx2, has("avx2"));
  EXPECT_EQ(f.fma, has("fma"));
  if (f.avx512) {
    EXPECT_TRUE(has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq")) << flags;
  }
  if (f.avx512_bf16) {
    EXPECT_TRUE(has("avx512_bf16")) << flags;
  }
  EXPECT_EQ(f.intel, vendor.find("GenuineIntel") != std::string::npos) << vendor;
  EXPECT_EQ(f.amd, vendor.find("AuthenticAMD") != std::string::npos) << vendor;
}

TEST(BlasKernel, SelfCheckPassesTheLoadedKernelAndCatchesAWrongElement) {
  EXPECT_TRUE(sgemm_self_check());
  EXPECT_FALSE(sgemm_self_check(1e-2f));
}

}  // namespace
}  // namespace remat::blas
