#include "app/train_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "remat/units.h"
#include "util/atomic_file.h"
#include "util/hash.h"
#include "util/paths.h"

namespace remat {

namespace {

// "REMATTS1" files carry a checksum of another hash: FNV-1a's prime with a mistyped offset basis
// (the published decimal basis without its last digit).
constexpr char kMagic[8] = {'R', 'E', 'M', 'A', 'T', 'T', 'S', '2'};
constexpr char kEarlierMagic[8] = {'R', 'E', 'M', 'A', 'T', 'T', 'S', '1'};

using detail::fnv1a;

std::string path_of(const std::string& dir) { return dir + "/state.bin"; }

void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }

uint64_t get_u64(const std::string& in, size_t at) {
  uint64_t v;
  std::memcpy(&v, in.data() + at, 8);
  return v;
}

at::ScalarType dtype_of(const std::string& name, const std::string& file) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "uint8") return at::kByte;
  if (name == "int64") return at::kLong;
  fail("train state '{}' is corrupt: unknown tensor dtype '{}'", file, name);
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kByte:
      return "uint8";
    case at::kLong:
      return "int64";
    default:
      fail_runtime("train state: cannot store dtype {}", c10::toString(t));
  }
}

}  // namespace

const at::Tensor& TrainState::tensor(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  fail("train state has no tensor '{}'; it was written by another model or version", name);
}

const at::Tensor& TrainState::tensor_like(const std::string& name, const at::Tensor& like,
                                          const std::string& dir) const {
  const at::Tensor& t = tensor(name);
  if (t.sizes() != like.sizes() || t.scalar_type() != like.scalar_type())
    fail("train state in '{}': '{}' is {} {}, the model's is {} {}", dir, name, shape_str(t.sizes().vec()),
         c10::toString(t.scalar_type()), shape_str(like.sizes().vec()), c10::toString(like.scalar_type()));
  return t;
}

void check_state_dir(const std::string& dir, const std::string& resume_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty()) fail("the train state folder is empty; give a folder name");
  const fs::path p(dir);
  if (fs::exists(p, ec) && !fs::is_directory(p, ec)) fail("cannot save a train state in '{}': it is not a folder", dir);
  const bool resumes_here = !resume_dir.empty() && fs::equivalent(p, fs::path(resume_dir), ec);
  if (fs::exists(path_of(dir), ec) && !resumes_here)
    fail("'{}' holds a saved run; continue it with --resume {} --save {}, or --save to a new folder", dir, dir, dir);
  // Create what is missing, try the file, and remove what was created, deepest first.
  std::vector<fs::path> created;
  for (fs::path at = fs::absolute(p, ec); !at.empty() && !fs::exists(at, ec); at = at.parent_path()) {
    created.push_back(at);
    if (at == at.parent_path()) break;
  }
  fs::create_directories(p, ec);
  const std::string why = ec ? ec.message() : std::string();
  auto undo = [&] {
    for (const fs::path& c : created) fs::remove(c, ec);
  };
  if (!why.empty()) {
    undo();
    fail("cannot save a train state in '{}': {}", dir, why);
  }
  try {
    check_writable(path_of(dir));
  } catch (const Error&) {
    undo();
    throw;
  }
  undo();
}

void save_train_state(const std::string& dir, const TrainState& state) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail_runtime("cannot create '{}': {}", dir, ec.message());
  nlohmann::json header = state.header;
  header["tensors"] = nlohmann::json::array();
  uint64_t offset = 0;
  std::vector<at::Tensor> contiguous;
  for (const auto& [name, t] : state.tensors) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    header["tensors"].push_back({{"name", name},
                                 {"dtype", dtype_name(c.scalar_type())},
                                 {"shape", c.sizes().vec()},
                                 {"offset", offset},
                                 {"bytes", c.nbytes()}});
    offset += c.nbytes();
    contiguous.push_back(std::move(c));
  }
  const std::string json = header.dump();
  std::string out(kMagic, 8);
  put_u64(out, json.size());
  out += json;
  out.reserve(out.size() + offset + 8);
  for (const at::Tensor& c : contiguous) out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  put_u64(out, fnv1a(out.data(), out.size()));
  write_file_atomic(path_of(dir), out);
}

RunLock::RunLock(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail_runtime("cannot create '{}': {}", dir, ec.message());
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) fail_runtime("cannot open the run folder '{}': {}", dir, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      fail("another remat train is saving into '{}'; wait for it to end or --save elsewhere", dir);
    fail_runtime("cannot lock the run folder '{}': {}", dir, std::strerror(err));
  }
  // A writer killed mid-save leaves "state.bin.tmp.PID.N" (write_file_atomic); no writer is alive now.
  const std::string stale = "state.bin.tmp.";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind(stale, 0) == 0) std::filesystem::remove(e.path(), ec);
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the lock
}

// Every field of the file is untrusted: offsets, sizes and shapes are checked against the file
// before anything is allocated or copied, and a malformed header names the file, not the parser.
TrainState load_train_state(const std::string& dir) {
  const std::string file = path_of(dir);
  const std::string data =
      read_regular_file("train state", file, std::numeric_limits<int64_t>::max(), "give the folder passed to --save");
  if (data.size() >= 8 && std::memcmp(data.data(), kEarlierMagic, 8) == 0)
    fail(
        "train state '{}' was written by an earlier remat (format REMATTS1); resume it with that release, or "
        "train again",
        file);
  if (data.size() < 8 + 8 + 8 || std::memcmp(data.data(), kMagic, 8) != 0)
    fail("'{}' is not a remat train state (bad magic or too short: {} bytes)", file, data.size());
  const uint64_t stored = get_u64(data, data.size() - 8);
  if (fnv1a(data.data(), data.size() - 8) != stored)
    fail("train state '{}' is corrupt or truncated (checksum mismatch); resume from an earlier copy or start over",
         file);
  const uint64_t json_len = get_u64(data, 8);
  if (json_len > data.size() - 24) fail("train state '{}' is corrupt: header length {} past the end", file, json_len);
  TrainState state;
  try {
    state.header = nlohmann::json::parse(data.substr(16, json_len));
  } catch (const std::exception& e) {
    fail("train state '{}' is corrupt: unreadable header ({})", file, e.what());
  }
  const uint64_t payload = 16 + json_len, room = data.size() - 8 - payload;
  try {
    if (!state.header.is_object() || !state.header.contains("tensors") || !state.header.at("tensors").is_array())
      fail("train state '{}' is corrupt: the header has no tensor list", file);
    // Written since the first release; another value is a format this release cannot read.
    if (state.header.value("format", std::string()) != kTrainStateFormat)
      fail("train state '{}' has format '{}'; this remat reads '{}' (resume it with the release that saved it)", file,
           state.header.value("format", std::string()), kTrainStateFormat);
    for (const auto& e : state.header.at("tensors")) {
      const std::string name = e.at("name").get<std::string>();
      const auto& o = e.at("offset");
      const auto& n = e.at("bytes");
      if (!o.is_number_unsigned() || !n.is_number_unsigned())
        fail("train state '{}' is corrupt: tensor '{}' has a negative or non-integer offset or size", file, name);
      const uint64_t off = o.get<uint64_t>(), bytes = n.get<uint64_t>();
      if (off > room || bytes > room - off) fail("train state '{}' is corrupt: tensor '{}' past the end", file, name);
      const at::ScalarType type = dtype_of(e.at("dtype").get<std::string>(), file);
      const std::vector<int64_t> shape = e.at("shape").get<std::vector<int64_t>>();
      uint64_t numel = 1;
      for (int64_t d : shape) {
        if (d < 0 || (d > 0 && numel > bytes / static_cast<uint64_t>(d)))
          fail("train state '{}' is corrupt: tensor '{}' has shape dimension {} for {} bytes", file, name, d, bytes);
        numel *= static_cast<uint64_t>(d);
      }
      if (numel * c10::elementSize(type) != bytes)
        fail("train state '{}' is corrupt: tensor '{}' of {} elements of {} is {} bytes, the header says {}", file,
             name, numel, c10::toString(type), numel * c10::elementSize(type), bytes);
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
      std::memcpy(t.data_ptr(), data.data() + payload + off, bytes);
      state.tensors.emplace_back(name, std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("train state '{}' is corrupt: malformed tensor list ({})", file, e.what());
  }
  return state;
}

std::string digest(const std::vector<at::Tensor>& tensors) {
  uint64_t h = detail::kFnv1aOffset;
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    h = fnv1a(c.data_ptr(), c.nbytes(), h);
  }
  return fmt::format("{:016x}", h);
}

}  // namespace remat
