// The machine's identity that keys every cached calibration.
#include "util/cache.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "remat/error.h"
#include "test_util.h"

namespace remat::detail {
namespace {

// A /proc/cpuinfo holding `text`, removed when it goes.
struct CpuInfoFile {
  std::string path = testing::temp_dir("cpuinfo") + "/cpuinfo";
  explicit CpuInfoFile(const std::string& text) { std::ofstream(path) << text; }
  ~CpuInfoFile() { std::filesystem::remove_all(std::filesystem::path(path).parent_path()); }
};

std::string with_cpuinfo(const std::string& text, const blas::CpuFeatures& cpu = {}) {
  return cpu_model(CpuInfoFile(text).path, cpu);
}

// The kind a machine with this first processor (then a second one that must not be read), these
// vector units and architecture is filed under.
std::string kind_of(const std::string& first, const blas::CpuFeatures& cpu = {}, const std::string& arch = "x86_64") {
  const CpuInfoFile file(first + "\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 99\nmodel\t\t: 99\n");
  return cpu_kind(file.path, cpu, arch);
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

TEST(CpuModel, WithoutAFamilyIsTheModelNameAndTheArmCoresFields) {
  EXPECT_EQ(with_cpuinfo("processor\t: 0\nmodel name\t: ARMv8 Processor rev 1\n"), "ARMv8 Processor rev 1");
  // An Arm core without a model name: told apart by implementer, part, variant and revision.
  EXPECT_EQ(with_cpuinfo("processor\t: 0\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n"
                         "CPU part\t: 0xd0c\nCPU revision\t: 1\n"),
            "unknown cpu (implementer 0x41, part 0xd0c, variant 0x1, revision 1)");
  EXPECT_EQ(cpu_model("/nonexistent/cpuinfo"), "unknown cpu");
}

// On x86 the kind is the vendor, family, model and widest vector unit, whatever the model name says.
TEST(CpuKind, X86IsVendorFamilyModelAndWidestVectorUnit) {
  blas::CpuFeatures avx2;
  avx2.avx2 = avx2.fma = true;
  blas::CpuFeatures avx512 = avx2;
  avx512.avx512 = true;
  EXPECT_EQ(kind_of("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
                    "model name\t: Intel(R) Xeon(R) Platinum 8480+",
                    avx512),
            "intel-6-143-avx512");
  EXPECT_EQ(kind_of("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC", avx2),
            "amd-25-17-avx2");
  EXPECT_EQ(kind_of("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85"), "intel-6-85-sse");
}

// A name is a folder name: any other character becomes '_', another vendor keeps its own name.
TEST(CpuKind, KeepsOnlyLettersDigitsDashesAndUnderscores) {
  blas::CpuFeatures avx2;
  avx2.avx2 = true;
  EXPECT_EQ(kind_of("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85 ../x"), "intel-6-85____x-sse");
  EXPECT_EQ(kind_of("vendor_id\t: HygonGenuine\ncpu family\t: 24\nmodel\t\t: 0", avx2), "x86_HygonGenuine-24-0-avx2");
}

// Elsewhere: the architecture, the CPU's implementer and part; "x" for what the file lacks.
TEST(CpuKind, ElsewhereIsArchitectureImplementerAndPart) {
  EXPECT_EQ(kind_of("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c", {}, "aarch64"),
            "aarch64-0x41-0xd0c");
  EXPECT_EQ(kind_of("processor\t: 0\nCPU part\t:", {}, "aarch64"), "aarch64-x-x");
  EXPECT_THROW(cpu_kind("/nonexistent/cpuinfo", {}, "riscv64"), Error);
}

// Keys padded with spaces or tabs are read, a key given twice keeps its last value, and an empty
// value is shown as "?".
TEST(CpuModel, ReadsPaddedKeysTheLastValueAndEmptyOnes) {
  EXPECT_EQ(with_cpuinfo("model name  : AMD EPYC\ncpu family  : 23\ncpu family\t: 25\nmodel\t:\nstepping : 1"),
            "AMD EPYC (family 25, model ?, stepping 1; no avx2)");
}

// A cache file that cannot be used is no cache: missing (nothing said), not JSON, or a FIFO planted
// under its name, which would block a plain read forever.
TEST(CachedJson, OnlyARegularJsonFileIsRead) {
  const std::string dir = testing::temp_dir("cached");
  std::string why;
  EXPECT_FALSE(read_cached_json(dir + "/missing.json", &why));
  EXPECT_EQ(why, "");
  std::ofstream(dir + "/good.json") << R"({"key": 1})";
  ASSERT_TRUE(read_cached_json(dir + "/good.json"));
  EXPECT_EQ(read_cached_json(dir + "/good.json")->at("key"), 1);
  std::ofstream(dir + "/bad.json") << "{ not json";
  EXPECT_FALSE(read_cached_json(dir + "/bad.json", &why));
  EXPECT_NE(why, "");
  ASSERT_EQ(::mkfifo((dir + "/fifo.json").c_str(), 0600), 0);
  why.clear();
  EXPECT_FALSE(read_cached_json(dir + "/fifo.json", &why));
  EXPECT_NE(why.find("is a FIFO"), std::string::npos) << why;
  std::filesystem::remove_all(dir);
}

// --remeasure: no cached file is read while it is on, and the same file is read again after.
TEST(CachedJson, NoneIsReadWhileRemeasuring) {
  const std::string dir = testing::temp_dir("cached");
  std::ofstream(dir + "/good.json") << R"({"key": 1})";
  {
    const testing::Remeasuring on;
    std::string why;
    EXPECT_FALSE(read_cached_json(dir + "/good.json", &why));
    EXPECT_EQ(why, "");  // nothing wrong with the file
  }
  EXPECT_TRUE(read_cached_json(dir + "/good.json"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace remat::detail
