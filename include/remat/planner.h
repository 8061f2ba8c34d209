// The planner: predicts the memory and time of one training step under any policy, and finds the
// fastest per-layer, per-tensor policy whose true peak memory fits a budget.
//
//   remat::ModelConfig cfg = ...;
//   remat::CostModel costs = remat::estimate_costs(remat::make_model(cfg), remat::MachineRates{180, 20});
//   remat::Plan plan = remat::make_plan(cfg, remat::parse_budget("300MiB"), costs);
//   if (plan.fits) remat::GPT model(cfg, plan.policy);   // plan.policy_text is the same as a string
//
// Memory is exact by construction: simulate_memory() replays the executor's compiled schedules on
// the tensor table's byte sizes, with the same gradient and free rules, and tests hold it equal
// to MemoryTracker's measurement. No ATen here: a 175B shape plans in milliseconds.
// See docs/design.md, NOTE [The planner].
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/block.h"
#include "remat/config.h"
#include "remat/executor.h"
#include "remat/policy.h"

namespace remat {

// ---- memory --------------------------------------------------------------------------------

// Bytes of one training step, as remat's engine and Adam run it. fp32: weights 4, gradients 4,
// Adam moments 8 bytes per parameter. fp16/bf16 (planning only; mixed precision as Megatron):
// weights 2, gradients 2, fp32 master weights and moments 12.
struct StepMemory {
  int64_t params = 0;      // weights
  int64_t grads = 0;       // parameter gradients, alive from the backward to the next step
  int64_t optimizer = 0;   // optimizer state
  int64_t data = 0;        // one batch: input and target
  int64_t saved = 0;       // live after the forward, above base()
  int64_t peak = 0;        // highest live during the step, above base()
  std::string peak_at;     // where the peak falls: "backward of layer 5, op 'fc'"

  // Live before a step: weights, optimizer state, data (gradients were freed).
  int64_t base() const { return params + optimizer + data; }
  int64_t total_peak() const { return base() + peak; }
};

// Replays one step of the engine: forward of every stage, backward in reverse, Adam. REQUIRES:
// policy.chunk == 0 (uniform:N chunks run under remat::checkpoint and are not modelled).
// `aten_threads`: LibTorch's thread count, which sizes one op's scratch (LayerNorm backward).
StepMemory simulate_memory(const ModelConfig& cfg, const ModelSpec& spec, const ResolvedPolicy& policy,
                           int aten_threads = 1);

// ---- time ----------------------------------------------------------------------------------

struct OpTime {
  double forward_ms = 0;   // also the cost of one recompute
  double backward_ms = 0;
};

struct CostModel {
  std::vector<OpTime> block;  // by op id of ModelSpec::block, one layer
  double other_ms = 0;        // per step: stem, head, optimizer, framework
  std::string source;         // "measured ..." or "estimated ..."
  int aten_threads = 1;       // the run these costs describe (sizes some scratch memory)

  // Step time with every activation kept.
  double none_step_ms(int64_t layers) const;
  // Time the ops a schedule reruns take, for one layer.
  double recompute_ms(const Schedule& schedule) const;
  // none_step_ms plus every layer's recompute.
  double step_ms(const ModelSpec& spec, const ResolvedPolicy& policy) const;
};

// Rates that turn FLOPs and bytes into time.
struct MachineRates {
  double matmul_gflops = 0;  // float32 GEMM
  double memory_gbps = 0;    // streaming read + write
};

// Per-op time as a roofline: max(matmul FLOPs / matmul rate, bytes moved / memory rate). For
// configs too large to run here; a measured profile (profile.h) is better where the model fits.
CostModel estimate_costs(const ModelSpec& spec, const MachineRates& rates);

// ---- plans ---------------------------------------------------------------------------------

struct Budget {
  int64_t bytes = 0;     // total peak in bytes, when > 0
  double percent = 0;    // else: base (weights, optimizer state, data) plus this percentage of what
                         // `none` adds to it during a step (activations, gradients, scratch)
};

// "300MiB", "2GB", "1.5GiB", "123456" (bytes), "60%" (of none's activation memory, see Budget).
// Throws remat::Error for anything else.
Budget parse_budget(std::string_view text);
std::string to_string(const Budget& b);

// One way to run a block.
struct BlockOption {
  std::vector<int> dropped;    // tensor ids recomputed, ascending
  int64_t saved = 0;           // Schedule::saved_bytes
  double recompute_ms = 0;     // CostModel::recompute_ms
  int64_t forward_extra = 0;   // peak above live at the block's start, during its forward
  int64_t backward_extra = 0;  // peak above live at the block's start, during its backward
  std::string text;            // as a preset: "none", "drop:probs,probs_drop"
};

// Every option of a block that no other option beats: none has at most the same saved bytes,
// recompute time and working sets, and less of one. Must-choices in `pins` are kept fixed.
// Choosable tensors under 1/64 of the block's largest (LayerNorm statistics) stay saved unless
// pinned. Sorted by saved bytes, descending.
std::vector<BlockOption> block_frontier(const BlockSpec& block, const CostModel& costs, const LayerPolicy& pins);

// The same set by brute force over every subset of the searched tensors (for tests).
std::vector<BlockOption> block_frontier_brute_force(const BlockSpec& block, const CostModel& costs,
                                                    const LayerPolicy& pins);

struct Plan {
  bool fits = false;
  int64_t budget = 0;          // total bytes asked for
  int64_t min_budget = 0;      // when !fits: the smallest total peak any plan reaches
  ResolvedPolicy policy;       // per layer
  std::string policy_text;     // the same as a policy string: "layers:0-3=drop:probs,...,4-5=none"
  StepMemory memory;           // simulated
  StepMemory none_memory;      // simulated, for `none`
  double step_ms = 0;          // predicted
  double none_step_ms = 0;
  std::vector<BlockOption> frontier;
};

// Plans one model for any number of budgets: the block frontier and the memory constants are
// computed once. `pins`: must-save and must-recompute choices no plan may move (keep:, drop:).
class Planner {
 public:
  Planner(const ModelConfig& cfg, const CostModel& costs, const LayerPolicy& pins);

  // The fastest policy whose simulated total peak is at most the budget, or (fits = false) the
  // smallest total peak any policy reaches.
  Plan plan(const Budget& budget) const;

  const std::vector<BlockOption>& frontier() const { return frontier_; }
  const StepMemory& none_memory() const { return none_memory_; }
  // Total bytes a budget stands for (percentages are of none's activation memory).
  int64_t bytes_of(const Budget& budget) const;

 private:
  std::vector<const BlockOption*> solve(int64_t total, int64_t buckets) const;
  std::vector<const BlockOption*> improve(std::vector<const BlockOption*> choice, int64_t total) const;
  std::vector<const BlockOption*> least_memory() const;
  StepMemory memory_of(const std::vector<const BlockOption*>& choice) const;

  ModelConfig cfg_;
  ModelSpec spec_;
  CostModel costs_;
  LayerPolicy pins_;
  std::vector<BlockOption> frontier_;
  StepMemory none_memory_;
  std::vector<int64_t> fwd_const_, bwd_const_;
  int64_t head_const_ = 0, stem_peak_ = 0;
};

// Planner(cfg, costs, pins).plan(budget).
Plan make_plan(const ModelConfig& cfg, const Budget& budget, const CostModel& costs, const LayerPolicy& pins);

// Resolves any policy for `cfg`: a budget policy through make_plan, the rest through
// Policy::resolve. Fills *plan when given and the policy is a budget.
ResolvedPolicy resolve_policy(const ModelConfig& cfg, const Policy& policy, const CostModel& costs,
                              Plan* plan = nullptr);

}  // namespace remat
