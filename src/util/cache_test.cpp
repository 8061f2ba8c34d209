// The machine's identity that keys every cached calibration.
#include "util/cache.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace remat::detail {
namespace {

std::string with_cpuinfo(const std::string& text, const blas::CpuFeatures& cpu = {}) {
  const std::string path = (std::filesystem::temp_directory_path() / "remat-cpuinfo-test").string();
  std::ofstream(path) << text;
  const std::string model = cpu_model(path, cpu);
  std::filesystem::remove(path);
  return model;
}

// Two VMs whose model name is the vendor's line alone differ in family, model and the vector units
// they have; the first processor speaks for the machine.
TEST(CpuModel, NamesFamilyModelSteppingAndVectorUnits) {
  const std::string zen =
      "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
      "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel\t\t: 99\n";
  blas::CpuFeatures avx2;
  avx2.avx2 = avx2.fma = true;
  EXPECT_EQ(with_cpuinfo(zen, avx2), "AMD EPYC (family 25, model 17, stepping 1; avx2 fma)");
  blas::CpuFeatures avx512 = avx2;
  avx512.avx512 = avx512.avx512_bf16 = true;
  EXPECT_EQ(with_cpuinfo(zen, avx512), "AMD EPYC (family 25, model 17, stepping 1; avx2 fma avx512 avx512_bf16)");
  EXPECT_EQ(with_cpuinfo("cpu family\t: 6\nmodel name\t: Intel(R) Xeon(R)\n"),
            "Intel(R) Xeon(R) (family 6, model ?, stepping ?; no avx2)");
}

TEST(CpuModel, WithoutAFamilyIsTheModelName) {
  EXPECT_EQ(with_cpuinfo("processor\t: 0\nmodel name\t: ARMv8 Processor rev 1\n"), "ARMv8 Processor rev 1");
  EXPECT_EQ(cpu_model("/nonexistent/cpuinfo"), "unknown cpu");
}

}  // namespace
}  // namespace remat::detail
