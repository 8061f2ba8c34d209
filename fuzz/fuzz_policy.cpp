// The policy grammar: any text is parsed, split as a --policies list, and resolved against a small
// GPT-2 and LLaMA block; every resolved layer has one choice per tensor.
#include <cstdlib>

#include "fuzz_util.h"
#include "remat/block.h"
#include "remat/policy.h"

using namespace remat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string s = fuzz::text(data, size);
  static const BlockSpec blocks[] = {
      [] {
        ModelConfig c;
        c.arch = "gpt2", c.layers = 6, c.dim = 16, c.heads = 2, c.batch = 1, c.seq = 8, c.dropout = 0.1;
        return make_block(c);
      }(),
      [] {
        ModelConfig c;
        c.arch = "llama", c.layers = 6, c.dim = 16, c.heads = 4, c.kv_heads = 2, c.batch = 1, c.seq = 8;
        return make_block(c);
      }()};
  fuzz::refuses_or_runs([&] {
    for (const std::string& piece : split_policy_list(s)) (void)piece;
  });
  fuzz::refuses_or_runs([&] {
    const Policy p = Policy::parse(s);
    for (const BlockSpec& b : blocks)
      fuzz::refuses_or_runs([&] {
        const ResolvedPolicy r = p.resolve(b, 6);
        if (r.segment == 0 && r.layers.size() != 6) std::abort();
        for (const LayerPolicy& l : r.layers)
          if (l.tensors.size() != b.tensors.size()) std::abort();
      });
  });
  return 0;
}
