// The planner: the fastest per-layer, per-tensor policy whose true peak memory fits a budget.
//
//   remat::CostModel costs = remat::choose_costs(cfg, remat::CostSource::Estimated, threads);
//   remat::Plan plan = remat::make_plan(cfg, remat::parse_budget("300MiB"), costs, pins);
//   if (plan.fits) remat::GPT model(cfg, plan.policy);   // plan.policy_text is the same as a string
//
// Memory is exact by construction: every candidate is replayed by the memory model
// (memory_model.h) on the schedules the executor would run. See docs/design.md, NOTE [The planner].
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "remat/block.h"
#include "remat/config.h"
#include "remat/costs.h"
#include "remat/memory_model.h"
#include "remat/policy.h"
#include "remat/schedule.h"

namespace remat {

// One way to run a block.
struct BlockOption {
  std::vector<int> dropped;    // tensor ids recomputed, ascending
  LayerPolicy policy;          // the pins plus these drops
  int64_t saved = 0;           // Schedule::saved_bytes
  double recompute_ms = 0;     // CostModel::recompute_ms
  int64_t forward_extra = 0;   // peak above live at the block's start, during its forward
  int64_t backward_extra = 0;  // peak above live at the block's start, during its backward
  std::string text;            // as a preset: "none", "drop:probs,probs_drop"
};

// Every option of a block that no other option beats: none has at most the same saved bytes,
// recompute time and working sets, and less of one. Must-choices in `pins` are kept fixed.
// Choosable tensors under 1/64 of the block's largest (normalisation statistics) stay saved unless
// pinned. Sorted by saved bytes, descending.
std::vector<BlockOption> block_frontier(const BlockSpec& block, const CostModel& costs, const LayerPolicy& pins);

// The same set by brute force over every subset of the searched tensors (for tests).
std::vector<BlockOption> block_frontier_brute_force(const BlockSpec& block, const CostModel& costs,
                                                    const LayerPolicy& pins);

struct Plan {
  bool fits = false;        // some policy's total peak is at most the budget
  int64_t budget = 0;       // total bytes asked for
  int64_t min_budget = 0;   // when !fits: the smallest total peak any plan reaches
  ResolvedPolicy policy;    // per layer
  std::string policy_text;  // the same as a policy string: "layers:0-3=drop:probs,...,4-5=none"
  StepMemory memory;        // simulated
  StepMemory none_memory;   // simulated, for `none`
  double step_ms = 0;       // predicted
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

  // One layer's options the plans choose among (block_frontier), and the step's memory under none.
  const std::vector<BlockOption>& frontier() const { return frontier_; }
  const StepMemory& none_memory() const { return none_memory_; }
  // Total bytes a budget stands for (percentages are of none's activations and gradients).
  int64_t bytes_of(const Budget& budget) const;

 private:
  std::vector<const BlockOption*> solve(int64_t total, int64_t buckets) const;
  std::vector<const BlockOption*> improve(std::vector<const BlockOption*> choice, int64_t total) const;
  std::vector<const BlockOption*> least_memory() const;
  CompiledStep plan_of(const std::vector<const BlockOption*>& choice) const;
  StepMemory memory_of(const std::vector<const BlockOption*>& choice) const;

  ModelConfig cfg_;
  std::shared_ptr<const ModelSpec> spec_;
  CostModel costs_;
  LayerPolicy pins_;
  std::vector<BlockOption> frontier_;
  StepMemory none_memory_;
  std::vector<int64_t> fwd_const_, bwd_const_;
  int64_t head_const_ = 0, stem_peak_ = 0;
  mutable ScheduleCache cache_;
};

// Planner(cfg, costs, pins).plan(budget).
Plan make_plan(const ModelConfig& cfg, const Budget& budget, const CostModel& costs, const LayerPolicy& pins);

}  // namespace remat
