// Outputs never destroy inputs: clashes found through links, atomic writes that keep a file's mode
// and write through a dangling link, and no split hard links.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "remat/error.h"
#include "util/atomic_file.h"
#include "util/paths.h"

namespace remat {
namespace {

namespace fs = std::filesystem;

class Files : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("remat-paths-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name)) << text; }
  std::string read(const std::string& name) const {
    std::ifstream in(path(name));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  fs::path dir_;
};

TEST_F(Files, AnOutputThatIsAnInputIsRefused) {
  write("corpus.txt", "text");
  FileRoles f;
  f.input("--data", path("corpus.txt"));
  f.output("--csv", path("corpus.txt"));
  EXPECT_THROW(f.check(), Error);
}

TEST_F(Files, AnOutputReachedThroughALinkIsTheSameFile) {
  write("device.json", "{}");
  fs::create_symlink(path("device.json"), path("link.json"));
  FileRoles f;
  f.input("--device", path("device.json"));
  f.output("--json", path("link.json"));
  EXPECT_THROW(f.check(), Error);
}

TEST_F(Files, AHardLinkOfAnInputIsTheSameFile) {
  write("a.txt", "text");
  fs::create_hard_link(path("a.txt"), path("b.txt"));
  FileRoles f;
  f.input("--data", path("a.txt"));
  f.output("--csv", path("b.txt"));
  EXPECT_THROW(f.check(), Error);
}

TEST_F(Files, TwoOutputsOfOneNameAreRefused) {
  FileRoles f;
  f.output("--json", path("r.out"));
  f.output("--csv", path("r.out"));
  EXPECT_THROW(f.check(), Error);
}

TEST_F(Files, AFileInsideAnOutputFolderIsRefused) {
  FileRoles f;
  f.output("--save", path("run"), /*folder=*/true);
  f.output("--csv", path("run/state.bin"));
  EXPECT_THROW(f.check(), Error);
}

TEST_F(Files, DistinctFilesPass) {
  write("corpus.txt", "text");
  FileRoles f;
  f.input("--data", path("corpus.txt"));
  f.output("--csv", path("metrics.csv"));
  f.output("--save", path("run"), /*folder=*/true);
  EXPECT_NO_THROW(f.check());
}

TEST_F(Files, AtomicWriteKeepsTheFileMode) {
  write("r.json", "old");
  ::chmod(path("r.json").c_str(), 0600);
  write_file_atomic(path("r.json"), "new");
  struct stat st;
  ASSERT_EQ(::stat(path("r.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(read("r.json"), "new");
}

TEST_F(Files, AtomicWriteGoesThroughADanglingLinkAndKeepsIt) {
  fs::create_symlink("target.json", path("link.json"));  // relative, dangling
  write_file_atomic(path("link.json"), "plan");
  EXPECT_TRUE(fs::is_symlink(path("link.json")));
  EXPECT_EQ(read("target.json"), "plan");
}

TEST_F(Files, AtomicWriteNeverFollowsALinkAtItsTemporaryName) {
  write("victim.json", "secret");
  write("r.json", "old");
  const std::string stem = path("r.json") + ".tmp." + std::to_string(::getpid());
  fs::create_symlink(path("victim.json"), stem);
  for (int n = 0; n < 256; ++n) fs::create_symlink(path("victim.json"), stem + "." + std::to_string(n));
  write_file_atomic(path("r.json"), "new");
  EXPECT_EQ(read("victim.json"), "secret");
  EXPECT_FALSE(fs::is_symlink(path("r.json")));
  EXPECT_EQ(read("r.json"), "new");
}

TEST_F(Files, AtomicWriteRefusesToSplitHardLinks) {
  write("a.json", "old");
  fs::create_hard_link(path("a.json"), path("b.json"));
  EXPECT_THROW(write_file_atomic(path("a.json"), "new"), Error);
  EXPECT_THROW(check_writable(path("a.json")), Error);
  EXPECT_EQ(read("b.json"), "old");
}

TEST_F(Files, RegularFileReaderRefusesAFifoWithoutOpeningIt) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  EXPECT_THROW(read_regular_file("--device", path("fifo"), 1024), Error);  // would block forever if opened
}

}  // namespace
}  // namespace remat
