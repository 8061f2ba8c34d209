// remat bench: run a sweep of policies on one model and measure each.
//
// For every policy: the same initial weights and data; one untimed step whose gradients are
// compared with those of `none`; warm-up steps; timed steps (forward + loss, backward, Adam step).
// Policies take their steps round-robin, one each in turn, so drifting machine load hits all alike.
// Memory comes from MemoryTracker: saved_bytes = live after forward - live before it; peak_bytes =
// peak during the step - live before it (weights, optimizer state and data are in "before";
// gradients are freed before each step, as PyTorch's zero_grad(set_to_none=True)).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/config.h"
#include "remat/runtime.h"

namespace remat {

enum class Engine : uint8_t {
  Module,  // the seed model on torch::nn modules, whole layers checkpointed (seed arch only)
  Ops,     // remat::GPT on the op-level engine: any policy, any arch
};
std::string_view to_string(Engine e);
Engine parse_engine(std::string_view s);

struct BenchOptions {
  ModelConfig model;
  std::vector<std::string> policies = {"none", "full", "every:2", "every:3"};
  std::vector<Engine> engines = {Engine::Module};  // default_engines(arch) from the CLI
  // Attention implementations to run each policy with, round-robin in the same run; empty: the
  // model's. A policy that has nothing to drop under one (attn under flash) is left out there.
  std::vector<AttentionImpl> attentions;
  int steps = 5;         // timed steps per policy
  int warmup = 2;        // untimed steps before them
  uint64_t seed = 1234;  // weights and data
  double lr = 1e-4;      // Adam learning rate
  ThreadConfig threads = default_threads();
  bool verify = false;                               // ops engine: one extra step checking every recompute bitwise
  bool profile = false;                              // ops engine: per-op forward / recompute / backward times
  bool frontier = false;                             // ops engine: measure op costs and draw the planner's frontier
  std::function<void(const std::string&)> progress;  // one line per event; may be empty
  // How the engine's GEMM was chosen (choose_gemm's rates), when it was measured; recorded in the
  // JSON beside the choice itself (gemm_record).
  GemmMeasurement gemm_choice;
};

struct BenchRow {
  std::string policy;
  Engine engine = Engine::Module;
  AttentionImpl attention = AttentionImpl::Math;
  double step_ms_median = 0, step_ms_min = 0, step_ms_max = 0;
  std::vector<double> step_ms;      // every timed step, in order
  std::vector<double> step_gflops;  // the 1024^3 rate sampled just before each timed step
  double fwd_ms_median = 0, bwd_ms_median = 0;
  int64_t saved_bytes = 0;                          // measured: live after forward - live before
  int64_t predicted_saved_bytes = -1;               // ops engine: from the tensor table; -1 when not predicted
  int64_t predicted_peak_bytes = -1;                // ops engine: the planner's memory model; -1 when not predicted
  double predicted_step_ms = -1;                    // ops engine: the cost model's step time (costs timed in the
                                                    // bench's rounds where they are measured); -1 when not predicted
  std::string plan;                                 // budget policies: the plan the planner chose
  int64_t peak_bytes = 0;                           // measured: peak in the step - live before
  double grad_max_abs_diff = 0;                     // against `none` on the same engine, first step
  int64_t flops_per_step = 0;                       // model matmul FLOPs, recompute not counted
  double floor_ratio = 0;                           // step_ms_median / floor_ms (the math-attention model's FLOPs)
  double floor_ratio_min = 0, floor_ratio_max = 0;  // of each timed round's step over that round's
                                                    // floor (round_gflops): the ratio's own spread
  bool verified = false;                            // --verify passed for this row
  std::string note;                                 // e.g. why a row is missing on an engine
};

// Per-op times of one ops-engine row, per step, summed over layers (--profile).
struct OpProfile {
  std::string policy;  // with its attention when the run has several: "flash none"
  std::vector<std::string> ops;
  std::vector<double> forward_ms, recompute_ms, backward_ms;
  // The cost model's times for the same ops (one layer timed in the bench's rounds, times the
  // layers that run or rerun each op); empty when the costs were not timed in the rounds.
  std::vector<double> predicted_forward_ms, predicted_recompute_ms, predicted_backward_ms;
};

struct BenchResult {
  BenchOptions options;
  std::string blas;
  std::string gemm;         // the engine's GEMM (gemm_name)
  std::string gemm_record;  // and as a saved run keeps it (gemm_record): the bits depend on it
  // The floor's GEMM: the fastest this build has on the 1024^3 product, tried before the rounds
  // (floor_gemm_rates). Beside every step each is sampled again and the fastest taken
  // (sampled_gflops): no step's products run faster than the fastest GEMM here.
  std::string floor_gemm;
  std::vector<std::pair<std::string, double>> floor_gemm_rates;
  int floor_rounds = 0;                // interleaved rounds each of floor_gemm_rates is the median of
  PeakRate peak;                       // the CPU's FMA peak on the run's threads, the faster of a measurement
                                       // before the steps and one after: what no GEMM can beat
  double matmul_gflops = 0;            // 1024^3 float32 rate of the fastest GEMM: median of sampled_gflops
  std::vector<double> sampled_gflops;  // the fastest GEMM's rate before every timed step, round by round
  std::vector<double> round_gflops;    // each timed round's median sample, in order: the floor's own spread
  int64_t flops_per_step = 0;          // of the model with math attention: what any row must compute
  double floor_ms = 0;                 // flops_per_step at the matmul rate
  std::vector<BenchRow> rows;
  std::vector<OpProfile> profiles;  // --profile
  std::string costs;                // the source of the costs the plans were made with
  std::string costs_in_run;         // the costs the predictions come from, when timed in the rounds
  double costs_gflops = 0;          // the matmul rate when the costs were taken (0: not known)
  struct FrontierPoint {
    double step_ms;
    int64_t peak_bytes;  // above the step's start, as peak_bytes
  };
  std::vector<FrontierPoint> frontier;  // the planner's predicted (time, peak) curve
  std::vector<std::string> notes;       // lines printed under the table

  std::string markdown() const;          // the table `remat bench` prints
  std::string profile_markdown() const;  // --profile: one table per policy
  std::string csv() const;
  std::string json() const;                         // {"config": {...}, "rows": [{...}, ...]}
  void write_chart(const std::string& path) const;  // peak memory against step time
};

// module and ops for the seed arch, ops for the others.
std::vector<Engine> default_engines(const std::string& arch);

// The largest absolute difference between two gradient lists; NaN when either holds a NaN, and
// infinity when one has a gradient where the other has none, so a broken gradient never reads as 0.
double grad_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b);

// Throws remat::Error naming the first bad option: the config, the counts, an engine and attention
// that do not go together, a policy that does not parse or that the module path cannot run, a
// shape whose `none` does not fit this machine's memory. Computes nothing: the CLI calls it before
// it may re-execute itself for the BLAS kernel; run_bench calls it first.
void check_bench_options(const BenchOptions& options);

// Runs the sweep. Throws remat::Error for an invalid config or policy (check_bench_options), or a
// budget no policy meets, before running anything.
BenchResult run_bench(const BenchOptions& options);

namespace detail {
// The floor's rate beside a step: the fastest of `gemms`' rates as `sample` gives them (in a run,
// matmul_gflops(1024, 3, gemm)), OpenBLAS's own threads sampled first and let sleep after, so that
// the others and the step have the cores.
double fastest_gemm_rate(std::vector<std::string> gemms, const std::function<double(const std::string&)>& sample);
}  // namespace detail

}  // namespace remat
