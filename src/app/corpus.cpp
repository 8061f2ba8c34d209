// The training text: Debian's fortunes or a file, split into training and held-out bytes.
#include "app/corpus.h"

#include <algorithm>
#include <filesystem>
#include <random>
#include <sstream>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "util/hash.h"
#include "util/paths.h"

namespace remat {

namespace {

constexpr const char* kFortunes = "/usr/share/games/fortunes";

// The most text remat train reads (it holds the corpus in memory twice: text and windows).
constexpr int64_t kMaxCorpusBytes = int64_t{4} << 30;

std::string read_file(const std::string& path) {
  return read_regular_file("--data", path, kMaxCorpusBytes, "give a text file");
}

// Debian's English fortunes: every text file in the folder (not the .dat indexes or .u8 links),
// in name order, with the "%" separator lines turned into blank lines.
std::string fortunes() {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(kFortunes, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || e.is_symlink() || name.find('.') != std::string::npos) continue;
    files.push_back(e.path().string());
  }
  if (ec || files.empty())
    fail("no fortunes in {} (install Debian's fortunes package: make setup), or give --data FILE", kFortunes);
  std::sort(files.begin(), files.end());
  std::string text;
  for (const std::string& f : files) {
    std::istringstream lines(read_file(f));
    for (std::string line; std::getline(lines, line);) text += (line == "%" ? "" : line) + "\n";
  }
  return text;
}

}  // namespace

std::optional<std::pair<std::string, std::string>> split_corpus_id(const std::string& id) {
  const size_t hash = id.rfind(':');
  const size_t size = hash == std::string::npos || hash == 0 ? std::string::npos : id.rfind(':', hash - 1);
  if (size == std::string::npos) return std::nullopt;
  return std::make_pair(id.substr(0, size), id.substr(size + 1));
}

Corpus load_corpus(const std::string& path, double val_fraction, int64_t seq) {
  if (!(val_fraction > 0 && val_fraction < 0.5))
    fail("TrainOptions.val_fraction must be in (0, 0.5), got {}", val_fraction);
  if (seq < 1 || seq > (int64_t{1} << 24)) fail("ModelConfig.seq must be in 1..16777216, got {}", seq);
  const std::string text = path.empty() ? fortunes() : read_file(path);
  const int64_t n = static_cast<int64_t>(text.size());
  const int64_t val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  // Training needs two windows of seq + 1 bytes, validation one.
  auto enough = [&](int64_t bytes) {
    const int64_t held = static_cast<int64_t>(static_cast<double>(bytes) * val_fraction);
    return bytes - held >= 2 * (seq + 1) && held >= seq + 1;
  };
  if (!enough(n)) {
    int64_t least = static_cast<int64_t>(static_cast<double>(seq + 1) / val_fraction);
    while (!enough(least)) ++least;
    fail("--data '{}' has {} bytes; with --seq {} and {:g}% held out it needs at least {}",
         path.empty() ? kFortunes : path, n, seq, 100 * val_fraction, least);
  }
  Corpus c;
  c.train = text.substr(0, n - val);
  c.val = text.substr(n - val);
  // "fortunes" names the default text in an id; a file of that name is recorded as ./fortunes.
  const std::string source = path.empty() ? "fortunes" : path == "fortunes" ? "./fortunes" : path;
  c.id = fmt::format("{}:{}:{:016x}", source, n, detail::fnv1a(text.data(), text.size()));
  return c;
}

// (B, T) inputs and next-byte targets from windows starting at `starts`.
std::pair<at::Tensor, at::Tensor> windows(const std::string& text, const std::vector<int64_t>& starts, int64_t seq) {
  const int64_t b = static_cast<int64_t>(starts.size());
  at::Tensor x = at::empty({b, seq}, at::kLong), y = at::empty({b, seq}, at::kLong);
  int64_t* px = x.data_ptr<int64_t>();
  int64_t* py = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < seq; ++t) {
      px[i * seq + t] = static_cast<unsigned char>(text[starts[i] + t]);
      py[i * seq + t] = static_cast<unsigned char>(text[starts[i] + t + 1]);
    }
  return {x, y};
}

// The batch of (step, micro): a pure function of the seed, so a resumed run draws the same ones.
std::pair<at::Tensor, at::Tensor> train_batch(const Corpus& c, const ModelConfig& m, uint64_t seed, int64_t step,
                                              int64_t micro) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(step),
                    static_cast<uint32_t>(micro), 0x7261u};
  std::mt19937_64 rng(seq);
  std::uniform_int_distribution<int64_t> pick(0, static_cast<int64_t>(c.train.size()) - m.seq - 1);
  std::vector<int64_t> starts(m.batch);
  for (int64_t& s : starts) s = pick(rng);
  return windows(c.train, starts, m.seq);
}

}  // namespace remat
