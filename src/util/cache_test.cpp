// The machine's identity that keys every cached calibration.
#include "util/cache.h"

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace remat::detail {
namespace {

std::string with_cpuinfo(const std::string& text) {
  const std::string path = (std::filesystem::temp_directory_path() / "remat-cpuinfo-test").string();
  std::ofstream(path) << text;
  const std::string model = cpu_model(path);
  std::filesystem::remove(path);
  return model;
}

// Two VMs whose model name is the vendor's line alone differ in family, model and the vector units
// they show; the first processor speaks for the machine.
TEST(CpuModel, NamesFamilyModelSteppingAndVectorUnits) {
  const std::string zen =
      "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
      "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu sse avx fma avx2 bmi2\n\n"
      "processor\t: 1\nmodel\t\t: 99\n";
  EXPECT_EQ(with_cpuinfo(zen), "AMD EPYC (family 25, model 17, stepping 1; avx2 fma)");
  const std::string xeon =
      "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
      "stepping\t: 8\nflags\t\t: avx2 fma avx512f amx_tile avx512_bf16\n";
  EXPECT_EQ(with_cpuinfo(xeon),
            "Intel(R) Xeon(R) Platinum 8481C (family 6, model 143, stepping 8; avx2 fma avx512f amx_tile)");
}

TEST(CpuModel, WithoutAFamilyIsTheModelName) {
  EXPECT_EQ(with_cpuinfo("processor\t: 0\nmodel name\t: ARMv8 Processor rev 1\n"), "ARMv8 Processor rev 1");
  EXPECT_EQ(cpu_model("/nonexistent/cpuinfo"), "unknown cpu");
}

}  // namespace
}  // namespace remat::detail
