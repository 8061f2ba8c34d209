// The data loader (remat train --data) on any bytes, with a window length and a held-out share from
// the input's first bytes: refused with remat::Error, or split into train and validation text that
// are the file's bytes and both long enough for one window.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "app/corpus.h"
#include "fuzz_util.h"

using namespace remat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    char tmpl[] = "/tmp/remat-fuzz-data-XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd < 0) std::abort();
    close(fd);
    return std::string(tmpl);
  }();
  if (size < 3) return 0;
  const int64_t seq = static_cast<int64_t>(data[0]) - 4;                   // -4 .. 251
  const double val_fraction = (static_cast<double>(data[1]) - 8) / 200.0;  // -0.04 .. 1.235
  const std::string text = fuzz::text(data + 2, size - 2);
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
  }
  fuzz::refuses_or_runs([&] {
    const Corpus c = load_corpus(path, val_fraction, seq);
    if (c.train.size() + c.val.size() > text.size()) std::abort();
    if (static_cast<int64_t>(c.train.size()) <= seq || static_cast<int64_t>(c.val.size()) <= seq) std::abort();
  });
  return 0;
}
