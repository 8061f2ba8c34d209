// resolve_policy: the one way a policy string becomes per-layer choices.
#include "remat/resolve.h"

#include "remat/costs.h"
#include "remat/error.h"
#include "remat/units.h"

namespace remat {

Plan plan_on_placeholder_costs(const ModelConfig& cfg, const ModelSpec& spec, const Budget& budget,
                               const LayerPolicy& pins, const ThreadConfig& threads) {
  CostModel costs = estimate_costs(spec, MachineRates{1.0, 1.0});
  costs.threads = threads;
  return make_plan(cfg, budget, costs, pins);
}

namespace {

void refuse_unmet(const Policy& policy, const Plan& plan) {
  if (!plan.fits)
    fail(
        "budget {} cannot be met: the smallest peak any policy reaches is {} (weights {}, optimizer {}, data {}, "
        "activations and gradients {})",
        to_string(policy.budget()), bytes_str(plan.min_budget), bytes_str(plan.memory.params),
        bytes_str(plan.memory.optimizer), bytes_str(plan.memory.data), bytes_str(plan.memory.peak));
}

}  // namespace

Resolution resolve_policy(const Policy& policy, const ModelConfig& cfg, const ResolveOptions& o) {
  auto spec = std::make_shared<const ModelSpec>(make_model(cfg));
  const ThreadConfig& threads = o.threads;
  Resolution r;
  if (!policy.is_budget()) {
    r.policy = policy.resolve(spec->block, cfg.layers);
    r.text = policy.text();
    r.memory = simulate_memory(compile_step(spec, r.policy), threads);
    return r;
  }
  const LayerPolicy pins = policy.pins(spec->block);  // name errors before any measuring
  // When the costs may be measured (seconds), an impossible budget is refused first.
  const bool may_measure = !o.given && o.costs != CostSource::Estimated;
  Plan plan;
  if (may_measure) plan = plan_on_placeholder_costs(cfg, *spec, policy.budget(), pins, threads);
  if (!may_measure || plan.fits) {
    if (o.progress) o.progress(fmt::format("planning {}", policy.text()));
    const CostModel costs = o.given ? *o.given : choose_costs(cfg, o.costs, o.threads);
    plan = make_plan(cfg, policy.budget(), costs, pins);
    r.costs = costs;
  }
  refuse_unmet(policy, plan);
  r.policy = plan.policy;
  r.text = plan.policy_text;
  r.memory = plan.memory;
  r.plan = plan;
  return r;
}

void check_policy(const Policy& policy, const ModelConfig& cfg, const ThreadConfig& threads) {
  const ModelSpec spec = make_model(cfg);
  if (!policy.is_budget()) {
    policy.resolve(spec.block, cfg.layers);
    return;
  }
  refuse_unmet(policy, plan_on_placeholder_costs(cfg, spec, policy.budget(), policy.pins(spec.block), threads));
}

}  // namespace remat
