// What the tests share (internal): one tiny config per block kind, and comparisons that say by how
// much two tensors differ.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include "remat/config.h"
#include "remat/error.h"
#include "remat/policy.h"
#include "remat/runtime.h"

namespace remat::testing {

// The message of the remat::Error that `f` throws, or "" when it does not throw; the error must be
// a usage error (bad input), not an internal one.
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Usage) << e.what();
    return e.what();
  }
  return "";
}

// A model of `arch` that runs in milliseconds: 4 layers, width 16, 4 heads, batch 2, sequence 8,
// vocabulary 11, causal attention in two row blocks of 4 (the packed layout end to end).
ModelConfig tiny(const std::string& arch, double dropout = 0.0);

// Every registered block kind, and those that take tokens (have a stem).
// One real training step (forward, backward, Adam) under `policy`, measured by the tracker: live
// bytes before it (weights, optimizer state, data) and, above them, after the forward and at the peak.
struct MeasuredStep {
  int64_t base = 0, saved = 0, peak = 0;
};
MeasuredStep measure_step(const ModelConfig& c, const ResolvedPolicy& policy);

std::vector<std::string> all_kinds();
std::vector<std::string> token_kinds();

// What the engine tests run on: every block kind with math attention, and the causal ones with
// flash attention too, dropout on where the kind has it. Named "gpt2_flash" and so on.
struct EngineCase {
  std::string name;
  ModelConfig cfg;
};
std::vector<EngineCase> engine_cases();
inline void PrintTo(const EngineCase& c, std::ostream* os) { *os << c.name; }

// Same shape, dtype and bytes; otherwise says the largest difference.
::testing::AssertionResult bitwise_equal(const at::Tensor& a, const at::Tensor& b);
// |got - want| <= tol * max |want| everywhere (relative to the tensor's largest value, whatever its
// magnitude); otherwise says the largest difference.
::testing::AssertionResult close(const at::Tensor& got, const at::Tensor& want, double tol);

// A fresh folder under the system's temporary directory, removed first if it exists.
std::string temp_dir(const std::string& name);

// ATen's intra-op thread count for one scope, restored after (an early ASSERT return included).
class AtenThreads {
 public:
  explicit AtenThreads(int n);
  ~AtenThreads();
  AtenThreads(const AtenThreads&) = delete;
  AtenThreads& operator=(const AtenThreads&) = delete;

 private:
  int saved_;
};

// set_remeasure(true) for one scope (--remeasure: no cached measurement is read), restored after.
struct Remeasuring {
  Remeasuring() : saved(remeasuring()) { set_remeasure(true); }
  ~Remeasuring() { set_remeasure(saved); }
  bool saved;
  Remeasuring(const Remeasuring&) = delete;
  Remeasuring& operator=(const Remeasuring&) = delete;
};

}  // namespace remat::testing
