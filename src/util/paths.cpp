#include "util/paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>

#include "remat/error.h"

namespace remat {

namespace fs = std::filesystem;

std::string final_target(const std::string& path) {
  std::string p = path;
  for (int hops = 0; hops <= 40; ++hops) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    char buf[PATH_MAX];
    const ssize_t n = ::readlink(p.c_str(), buf, sizeof buf - 1);
    if (n < 0) return p;
    const std::string to(buf, static_cast<size_t>(n));
    p = to.front() == '/' ? to : (fs::path(p).parent_path() / to).string();
  }
  fail("'{}': too many levels of symbolic links", path);
}

namespace {

const char* kind_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Where a path is, for comparing: the target's absolute path with what exists resolved.
std::string where(const std::string& path) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(final_target(path), ec), ec);
  return ec ? fs::absolute(path).lexically_normal().string() : p.string();
}

bool inside(const std::string& folder, const std::string& path) {
  return path.size() > folder.size() && path.compare(0, folder.size(), folder) == 0 && path[folder.size()] == '/';
}

}  // namespace

std::string read_regular_file(const std::string& flag, const std::string& path, int64_t max_bytes,
                              const std::string& fix) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) fail("cannot read {} '{}': {}; {}", flag, path, std::strerror(errno), fix);
  if (!S_ISREG(st.st_mode)) fail("{} '{}' is {}; {}", flag, path, kind_name(st.st_mode), fix);
  if (st.st_size > max_bytes)
    fail("{} '{}' has {} bytes; at most {} are read (is it the right file?)", flag, path, st.st_size, max_bytes);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot read {} '{}': {}", flag, path, std::strerror(errno));
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("cannot read {} '{}': {}", flag, path, std::strerror(err));
    }
    if (n == 0) break;  // the file shrank since stat: what it holds now
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(done);
  return text;
}

bool FileRoles::same(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  struct stat sa, sb;
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  return where(a) == where(b);
}

void FileRoles::input(std::string flag, std::string path, bool folder) {
  if (!path.empty()) entries_.push_back({std::move(flag), std::move(path), folder, false});
}

void FileRoles::output(std::string flag, std::string path, bool folder) {
  if (!path.empty()) entries_.push_back({std::move(flag), std::move(path), folder, true});
}

void FileRoles::check() const {
  struct Key {
    std::string at;
    bool exists = false, stream = false;
    dev_t dev = 0;
    ino_t ino = 0;
  };
  std::vector<Key> keys;
  for (const Entry& e : entries_) {
    Key k;
    k.at = where(e.path);
    struct stat st;
    if (::stat(e.path.c_str(), &st) == 0) {
      k.exists = true, k.dev = st.st_dev, k.ino = st.st_ino;
      k.stream = S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode);  // /dev/null, /dev/stdout: shared freely
    }
    keys.push_back(k);
  }
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& a = entries_[i];
    if (!a.output || keys[i].stream) continue;
    for (size_t j = 0; j < entries_.size(); ++j) {
      const Entry& b = entries_[j];
      if (i == j || (b.output && j > i) || keys[j].stream) continue;  // each pair of outputs once
      const bool same =
          (keys[i].exists && keys[j].exists && keys[i].dev == keys[j].dev && keys[i].ino == keys[j].ino) ||
          keys[i].at == keys[j].at;
      const bool nested = (b.folder && inside(keys[j].at, keys[i].at)) || (a.folder && inside(keys[i].at, keys[j].at));
      if (!same && !nested) continue;
      const char* role = b.output ? "also writes" : "reads";
      if (same)
        fail(
            "{} '{}' is the same file as {} '{}', which the command {}; an output never replaces another file of "
            "the command: give another name",
            a.flag, a.path, b.flag, b.path, role);
      fail("{} '{}' and {} '{}' overlap (one is inside the other's folder, which the command {}); give another name",
           a.flag, a.path, b.flag, b.path, role);
    }
  }
}

}  // namespace remat
