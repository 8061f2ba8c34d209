#include "app/report.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "remat/error.h"

namespace remat {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string temp_dir() {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("remat_report_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  return dir.string();
}

// A write that cannot happen is a runtime failure (exit code 1, not a usage error), names the path,
// and creates nothing.
TEST(Report, AFailedWriteNamesThePathAndCreatesNothing) {
  try {
    write_file_atomic("/nonexistent-dir/x.json", "{}");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Runtime);
    EXPECT_NE(std::string(e.what()).find("cannot write '/nonexistent-dir/x.json'"), std::string::npos);
  }
  EXPECT_FALSE(std::filesystem::exists("/nonexistent-dir"));
}

TEST(Report, CheckWritableIsAUsageErrorAndCreatesNothing) {
  const std::string dir = temp_dir();
  EXPECT_NO_THROW(check_writable(dir + "/ok.csv"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/ok.csv"));
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  try {
    check_writable(dir + "/missing/ok.csv");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Usage);
  }
  std::filesystem::remove_all(dir);
}

TEST(Report, MarkdownAlignsColumns) {
  Table t;
  t.header = {"policy", "ms"};
  t.numeric = {false, true};
  t.rows = {{"none", "1.5"}, {"every:2", "12.25"}};
  EXPECT_EQ(t.markdown(),
            "| policy  |    ms |\n"
            "|:--------|------:|\n"
            "| none    |   1.5 |\n"
            "| every:2 | 12.25 |\n");
}

TEST(Report, ChartNeedsAKnownExtension) {
  EXPECT_THROW(check_chart_path("out.jpg"), Error);
  EXPECT_NO_THROW(check_chart_path("out.svg"));
}

TEST(Report, RendersAnSvgChart) {
  const std::string path = temp_dir() + "/c.svg";
  Chart c;
  c.title = "t";
  c.xlabel = "x";
  c.ylabel = "y";
  c.series.push_back({"points", {{"none", 1, 2}, {"every:2", 2, 1}}, false});
  render_chart(c, path);
  const std::string svg = read(path);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("every:2"), std::string::npos);
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

}  // namespace
}  // namespace remat
