// The train-state loader on any bytes as DIR/state.bin: refused with remat::Error or loaded; a
// loaded state's tensors lie inside the file. (A valid checksum is easy to forge, so the seed
// corpus holds real states and the fuzzer's mutations keep some checksums right.)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>

#include "app/train_state.h"
#include "fuzz_util.h"

using namespace remat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/remat-fuzz-state-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) std::abort();
    return std::string(tmpl);
  }();
  {
    std::ofstream f(dir + "/state.bin", std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  fuzz::refuses_or_runs([&] {
    const TrainState s = load_train_state(dir);
    int64_t bytes = 0;
    for (const auto& [name, t] : s.tensors) bytes += t.nbytes();
    if (bytes > static_cast<int64_t>(size)) std::abort();  // tensors come from the file, nothing more
  });
  return 0;
}
