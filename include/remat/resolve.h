// The one way a policy string becomes per-layer choices where a model runs: bench and train call
// this (remat plan --budget, which runs nothing, calls parse_budget and make_plan directly).
//
//   remat::Resolution r = remat::resolve_policy(remat::Policy::parse("budget:60%"), cfg, {});
//   remat::GPT model(cfg, r.policy);   // r.text: the plan as a policy; r.memory: its exact bytes
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "remat/config.h"
#include "remat/costs.h"
#include "remat/memory_model.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/runtime.h"

namespace remat {

struct ResolveOptions {
  CostSource costs = CostSource::Auto;               // how a budget's plan gets op costs (costs.h)
  const CostModel* given = nullptr;                  // use these costs instead (the bench measures them once)
  ThreadConfig threads = default_threads();          // the run's threads: scratch sizes, measured costs
  std::function<void(const std::string&)> progress;  // told when planning starts; may be empty
};

struct Resolution {
  ResolvedPolicy policy;           // per layer
  std::string text;                // the policy as given, or a budget's plan as a policy string
  std::optional<Plan> plan;        // budget policies
  StepMemory memory;               // the predicted bytes of one step under `policy`
  std::optional<CostModel> costs;  // budget policies: the op costs the plan was made with
};

// Resolves `policy` for `cfg`: a budget through the planner, anything else through
// Policy::resolve. Throws remat::Error for a policy that does not resolve, and for a budget no
// policy meets (naming the smallest peak any policy reaches and what it is made of).
Resolution resolve_policy(const Policy& policy, const ModelConfig& cfg, const ResolveOptions& options = {});

// Throws, measuring nothing, the remat::Error resolve_policy gives a policy that cannot resolve on
// `cfg` with `threads` (a name the block lacks, a range past the last layer, a preset that drops
// nothing, a budget no policy meets: that does not depend on the op costs, so it is planned on
// placeholder ones, as resolve_policy does before it measures). A command checks its policies with
// it before any work starts.
void check_policy(const Policy& policy, const ModelConfig& cfg, const ThreadConfig& threads);

// `budget`'s plan on placeholder op costs for a run on `threads` (they size some scratch): whether
// it fits, and the smallest peak any policy reaches, do not depend on the costs but at the least
// peak itself, where the planner's rounding (about 0.1% of it) picks among plans by cost; so a
// command can refuse an unmet budget before it measures them. Its policy and times mean nothing.
// `spec` is make_model(cfg), which the caller has for its pins.
Plan plan_on_placeholder_costs(const ModelConfig& cfg, const ModelSpec& spec, const Budget& budget,
                               const LayerPolicy& pins, const ThreadConfig& threads);

}  // namespace remat
