// Config validation: a ModelConfig from the input's bytes (sizes anywhere in int64, any dropout).
// One that validate() accepts must build its tensor table, and a small one must replay through the
// memory model with a positive peak: validate() is the only gate before that work.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "fuzz_util.h"
#include "remat/block.h"
#include "remat/memory_model.h"
#include "remat/policy.h"

using namespace remat;

namespace {

struct Reader {
  const uint8_t* p;
  size_t n;
  template <typename T>
  T take() {
    T v{};
    const size_t k = n < sizeof v ? n : sizeof v;
    std::memcpy(&v, p, k);
    p += k, n -= k;
    return v;
  }
  // Mostly small sizes (the interesting edges), sometimes any int64.
  int64_t size() {
    const uint8_t mode = take<uint8_t>();
    return mode < 200 ? static_cast<int64_t>(take<uint8_t>()) - 8 : take<int64_t>();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r{data, size};
  ModelConfig c;
  static const char* kArchs[] = {"seed", "gpt2", "llama", "bogus"};
  c.arch = kArchs[r.take<uint8_t>() % 4];
  c.layers = r.size(), c.dim = r.size(), c.heads = r.size(), c.kv_heads = r.size();
  c.batch = r.size(), c.seq = r.size(), c.ffn = r.size(), c.vocab = r.size(), c.attn_block = r.size();
  c.tp = r.size();
  c.sp = r.take<uint8_t>() & 1;
  c.dropout = r.take<double>();
  c.attention = (r.take<uint8_t>() & 1) ? AttentionImpl::Flash : AttentionImpl::Math;
  static const DType kTypes[] = {DType::F32, DType::BF16, DType::F16, DType::Bool};
  c.dtype = kTypes[r.take<uint8_t>() % 4];
  try {
    validate(c);
  } catch (const Error&) {
    return 0;
  }
  const ModelSpec spec = make_model(c);  // must not throw, overflow or allocate the world
  if (c.layers <= 8 && c.dim <= 512 && c.tokens() <= 4096) {
    fuzz::refuses_or_runs([&] {
      const ResolvedPolicy none = Policy::parse("none").resolve(spec.block, c.layers);
      if (simulate_memory(c, none).total_peak() <= 0) std::abort();
    });
  }
  return 0;
}
