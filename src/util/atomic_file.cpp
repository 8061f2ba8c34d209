#include "util/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "remat/error.h"
#include "util/paths.h"

namespace remat {

namespace {

// A new file beside `path`, "PATH.tmp.PID.N", opened for writing: created here (O_EXCL), never an
// existing file or a link planted under the name (O_NOFOLLOW), and N counts up, so that two writes
// of one process at once get files of their own. Returns the descriptor, or -1 with errno set.
int create_temp(const std::string& path, std::string& name) {
  static std::atomic<uint64_t> next{0};
  for (;;) {
    name = fmt::format("{}.tmp.{}.{}", path, getpid(), next.fetch_add(1));
    const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
}

// Where the bytes go: a link's target (a dangling link's too), never the link itself.
std::string target_of(const std::string& path) { return final_target(path); }

enum class Kind { Missing, Regular, Stream, Other };

// A file with other names: renaming a new file over this name would leave them with the old bytes.
std::string hard_links(const std::string& path, nlink_t links) {
  return fmt::format(
      "cannot write '{}': it has {} hard links, which a safe (write, then rename) update would split "
      "from it; write to another name",
      path, links);
}

Kind kind_of(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return Kind::Missing;
  if (S_ISREG(st.st_mode)) return Kind::Regular;
  if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode)) return Kind::Stream;
  return Kind::Other;
}

// Writes all of `content` to fd; returns 0 or an errno.
int write_all(int fd, std::string_view content) {
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

void write_file_atomic(const std::string& given, std::string_view content) {
  const std::string path = target_of(given);
  const Kind kind = kind_of(path);
  if (kind == Kind::Other) fail_runtime("cannot write '{}': it is not a regular file or a device", given);
  if (kind == Kind::Stream) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fail_runtime("cannot write '{}': {}", given, std::strerror(errno));
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    const int err = write_all(fd, content);
    ::close(fd);
    if (err != 0) fail_runtime("cannot write '{}': {}", given, std::strerror(err));
    return;
  }
  struct stat old;
  const bool exists = ::stat(path.c_str(), &old) == 0;
  if (exists && old.st_nlink > 1) fail_runtime("{}", hard_links(given, old.st_nlink));
  std::string tmp;
  const int fd = create_temp(path, tmp);
  if (fd < 0) fail_runtime("cannot write '{}': {}", given, std::strerror(errno));
  int err = write_all(fd, content);
  if (err == 0 && exists && ::fchmod(fd, old.st_mode & 07777) != 0) err = errno;  // the file keeps its mode
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && std::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    fail_runtime("cannot write '{}': {}", given, std::strerror(err));
  }
  // The rename made durable: the folder's entry synced too (where the file system allows it).
  const std::string folder = std::filesystem::path(path).parent_path().string();
  const int dir = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void check_writable(const std::string& given) {
  if (given.empty()) fail("empty output path; give a file name");
  const std::string path = target_of(given);
  const Kind kind = kind_of(path);
  if (kind == Kind::Other) fail("cannot write '{}': it is a directory or another non-file", given);
  struct stat st;
  if (kind == Kind::Regular && ::stat(path.c_str(), &st) == 0 && st.st_nlink > 1)
    fail("{}", hard_links(given, st.st_nlink));
  if (kind == Kind::Stream) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) fail("cannot write '{}': {}", given, std::strerror(errno));
    ::close(fd);
    return;
  }
  std::string tmp;
  const int fd = create_temp(path, tmp);
  if (fd < 0) fail("cannot write '{}': {}", given, std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

}  // namespace remat
