// The size and budget parsers: budgets ("300MiB", "60%"), thread settings ("1/2"). An accepted
// budget is positive and prints; an accepted thread setting is positive.
#include <cstdlib>

#include "fuzz_util.h"
#include "remat/policy.h"
#include "remat/runtime.h"

using namespace remat;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string s = fuzz::text(data, size);
  fuzz::refuses_or_runs([&] {
    const Budget b = parse_budget(s);
    if (b.bytes <= 0 && !(b.percent > 0)) std::abort();  // "rounds to 0" must be refused
    (void)to_string(b);
  });
  fuzz::refuses_or_runs([&] {
    const ThreadConfig t = parse_threads(s);
    if (t.aten < 1 || t.blas < 1) std::abort();
  });
  return 0;
}
