// Files a command reads and writes (internal): where a path really leads, whether two paths are the
// same file, and inputs that must be regular files.
//
//   remat::FileRoles files;
//   files.input("--data", data);
//   files.output("--csv", csv);
//   files.check();   // "--csv 'corpus.txt' is the file --data reads; ..." before any work
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat {

// The file `path` leads to: symbolic links followed to the end, a dangling one to the path it
// names (relative links resolved from the link's folder). At most 40 links, as the kernel allows;
// a loop throws remat::Error.
std::string final_target(const std::string& path);

// Reads a whole regular file of at most `max_bytes`. A FIFO, a device or a folder is refused
// without opening it (a FIFO would block forever). `flag` names the path in errors ("--device",
// "train state"); `fix` ends the error for a path that is missing or not a regular file. Throws remat::Error
// (usage) naming the flag, the path and what was wrong.
std::string read_regular_file(const std::string& flag, const std::string& path, int64_t max_bytes,
                              const std::string& fix = "give a regular file");

// The inputs and outputs of one command, by the flag that named each. check() refuses, before any
// work, an output that is one of the inputs or another output: the same path, a symbolic link to
// it, a hard link of it, or a file inside an input folder that the command reads.
class FileRoles {
 public:
  // A file (or, with `folder`, a folder whose files the command reads or writes: a train state).
  void input(std::string flag, std::string path, bool folder = false);
  void output(std::string flag, std::string path, bool folder = false);
  // Throws remat::Error (usage) naming both flags and paths at the first clash.
  void check() const;
  // True when `a` and `b` lead to the same file or folder (a run resumed and saved in one place).
  static bool same(const std::string& a, const std::string& b);

 private:
  struct Entry {
    std::string flag, path;
    bool folder = false;
    bool output = false;
  };
  std::vector<Entry> entries_;
};

}  // namespace remat
