// The planner's search (NOTE [The planner], 3-4): a knapsack over layers whose constraints are the
// true peaks, read off the memory model, and an exact pass that spends what rounding left over.
#include "remat/planner.h"

#include <algorithm>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "remat/error.h"

namespace remat {

namespace {

std::string plan_text(const std::vector<const BlockOption*>& choice) {
  std::vector<std::pair<int64_t, std::string>> layers;
  for (size_t l = 0; l < choice.size(); ++l) layers.push_back({static_cast<int64_t>(l), choice[l]->text});
  return layers_policy_text(layers);
}

ResolvedPolicy policy_of(const std::vector<const BlockOption*>& choice) {
  ResolvedPolicy r;
  for (const BlockOption* o : choice) r.layers.push_back(o->policy);
  return r;
}

// Multiple-choice knapsack over layers (NOTE [The planner], rule 3). State: bytes saved by the
// layers so far, in buckets of `q` rounded up. Returns the per-layer choice, or empty if none fits.
std::vector<const BlockOption*> knapsack(const std::vector<BlockOption>& options, int64_t layers,
                                         const std::vector<int64_t>& fwd_const, const std::vector<int64_t>& bwd_const,
                                         int64_t rest_const, int64_t limit, int64_t buckets) {
  if (limit <= 0) return {};
  const int64_t q = std::max<int64_t>(1, (limit + buckets - 1) / buckets);
  const int64_t states = limit / q + 1;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> cost(states, inf), next(states);
  std::vector<std::vector<int16_t>> pick(layers, std::vector<int16_t>(states, -1));
  std::vector<std::vector<int32_t>> from(layers, std::vector<int32_t>(states, -1));
  cost[0] = 0;
  for (int64_t l = 0; l < layers; ++l) {
    std::fill(next.begin(), next.end(), inf);
    for (int64_t k = 0; k < states; ++k) {
      if (cost[k] == inf) continue;
      const int64_t before = k * q;
      for (size_t c = 0; c < options.size(); ++c) {
        const BlockOption& o = options[c];
        const int64_t after = before + (o.saved + q - 1) / q * q;
        if (after > limit) continue;
        if (before + fwd_const[l] + o.forward_extra > limit) continue;
        if (after + bwd_const[l] + o.backward_extra > limit) continue;
        const int64_t k2 = after / q;
        const double t = cost[k] + o.recompute_ms;
        if (t < next[k2]) {
          next[k2] = t;
          pick[l][k2] = static_cast<int16_t>(c);
          from[l][k2] = static_cast<int32_t>(k);
        }
      }
    }
    cost.swap(next);
  }
  int64_t best = -1;
  for (int64_t k = 0; k < states; ++k)
    if (cost[k] < inf && k * q + rest_const <= limit && (best < 0 || cost[k] < cost[best])) best = k;
  if (best < 0) return {};
  std::vector<const BlockOption*> choice(layers);
  for (int64_t l = layers - 1, k = best; l >= 0; --l) {
    choice[l] = &options[pick[l][k]];
    k = from[l][k];
  }
  return choice;
}

}  // namespace

Planner::Planner(const ModelConfig& cfg, const CostModel& costs, const LayerPolicy& pins)
    : cfg_(cfg), spec_(std::make_shared<const ModelSpec>(make_model(cfg))), costs_(costs), pins_(pins) {
  if (costs_.block.size() != spec_->block.ops.size())
    fail("the cost model has {} block ops; the {} block has {}", costs_.block.size(), spec_->block.kind,
         spec_->block.ops.size());
  frontier_ = block_frontier(spec_->block, costs_, pins_);
  // The reference for percentages and for the "none" column: nothing dropped, pins or not.
  ResolvedPolicy none;
  none.layers.assign(spec_->layers, keep_everything(spec_->block));
  none_memory_ = simulate_memory(compile_step(spec_, none, &cache_), costs_.threads);
  // Constants of the constraints: the level at each block's start minus what the blocks' choices
  // put there, read from a reference run (the frontier's first option everywhere). They do not
  // depend on the choices: other stages, gradients of later layers, block inputs, dy.
  const BlockOption& ref = frontier_.front();
  MemoryTrace t;
  simulate_memory(plan_of(std::vector<const BlockOption*>(spec_->layers, &ref)), costs_.threads, &t);
  for (int64_t l = 0; l < spec_->layers; ++l) {
    fwd_const_.push_back(t.fwd_start[l] - l * ref.saved);
    bwd_const_.push_back(t.bwd_start[l] - (l + 1) * ref.saved);
  }
  head_const_ = t.head_peak - spec_->layers * ref.saved;
  stem_peak_ = t.stem_peak;
}

int64_t Planner::bytes_of(const Budget& budget) const {
  if (budget.bytes > 0) return budget.bytes;
  return none_memory_.base() + static_cast<int64_t>(static_cast<double>(none_memory_.peak) * budget.percent / 100.0);
}

// The knapsack's resolution, in buckets of the memory between the base and the budget: a plan is
// searched finely (each bucket rounds an option's bytes up, so a coarse grid wastes budget), the
// bisection for the least peak coarsely (its answer is then checked exactly).
constexpr int64_t kPlanBuckets = 4096;
constexpr int64_t kBisectionBuckets = 1024;
// The bisection stops within 1/kBisectionTolerance of the peak it brackets: the range starts at
// most `hi` wide, so about 11 halvings; kBisectionSteps only bounds the loop should that change.
constexpr int64_t kBisectionTolerance = 2000;
constexpr int kBisectionSteps = 40;

std::vector<const BlockOption*> Planner::solve(int64_t total, int64_t buckets) const {
  const int64_t limit = total - none_memory_.base();
  if (stem_peak_ > limit) return {};  // the embedding alone does not fit
  return knapsack(frontier_, spec_->layers, fwd_const_, bwd_const_, head_const_, limit, buckets);
}

CompiledStep Planner::plan_of(const std::vector<const BlockOption*>& choice) const {
  return compile_step(spec_, policy_of(choice), &cache_);
}

StepMemory Planner::memory_of(const std::vector<const BlockOption*>& choice) const {
  return simulate_memory(plan_of(choice), costs_.threads);
}

// The knapsack rounds bytes up, so its answer can leave a little of the budget unused. Move layers
// to faster options while the exact simulation still fits, largest saving first, until no move
// fits. A faster option saves more bytes and later moves only add bytes, so a move that did not fit
// is not retried: each (layer, option) is simulated at most once, and no cap cuts the search short
// (a cap of 400 made more budget give a slower plan when the move that fit came after 778 that did not).
std::vector<const BlockOption*> Planner::improve(std::vector<const BlockOption*> choice, int64_t total) const {
  std::set<std::pair<int64_t, const BlockOption*>> too_big;
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<std::pair<double, std::pair<int64_t, const BlockOption*>>> moves;
    for (int64_t l = 0; l < spec_->layers; ++l)
      for (const BlockOption& o : frontier_)
        if (o.recompute_ms < choice[l]->recompute_ms && !too_big.count({l, &o}))
          moves.push_back({choice[l]->recompute_ms - o.recompute_ms, {l, &o}});
    std::stable_sort(moves.begin(), moves.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [gain, move] : moves) {
      std::vector<const BlockOption*> next = choice;
      next[move.first] = move.second;
      if (memory_of(next).total_peak() <= total) {
        choice = std::move(next);
        moved = true;
        break;
      }
      too_big.insert(move);
    }
  }
  return choice;
}

Plan Planner::plan(const Budget& budget) const {
  Plan p;
  p.frontier = frontier_;
  p.none_memory = none_memory_;
  p.none_step_ms = costs_.none_step_ms(spec_->layers);
  p.budget = bytes_of(budget);
  std::vector<const BlockOption*> choice = solve(p.budget, kPlanBuckets);
  if (choice.empty()) {
    // Rounding can miss a budget right at the minimum: try the least-memory plan exactly.
    std::vector<const BlockOption*> least = least_memory();
    if (!least.empty() && memory_of(least).total_peak() <= p.budget) choice = std::move(least);
  }
  if (!choice.empty()) {
    choice = improve(std::move(choice), p.budget);
    p.fits = true;
    p.policy = policy_of(choice);
    p.policy_text = plan_text(choice);
    const CompiledStep step = plan_of(choice);
    p.memory = simulate_memory(step, costs_.threads);
    p.step_ms = costs_.step_ms(step);
    if (p.memory.total_peak() > p.budget)  // the knapsack rounds up and improve() checks exactly
      REMAT_INTERNAL("plan peaks at {} over the budget {}", p.memory.total_peak(), p.budget);
    return p;
  }
  // Refused: name the smallest budget any plan meets.
  p.memory = memory_of(least_memory());
  p.min_budget = p.memory.total_peak();
  return p;
}

// The plan with the smallest total peak the knapsack finds: bisection on the budget.
std::vector<const BlockOption*> Planner::least_memory() const {
  int64_t lo = none_memory_.base(), hi = none_memory_.total_peak();
  // `none` itself fits its own peak, so the doubling ends at once unless the knapsack is broken.
  while (solve(hi, kBisectionBuckets).empty()) {
    if (hi > std::numeric_limits<int64_t>::max() / 2) REMAT_INTERNAL("no plan fits even {} bytes", hi);
    hi *= 2;
  }
  for (int it = 0; it < kBisectionSteps && hi - lo > std::max<int64_t>(1, hi / kBisectionTolerance); ++it) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (solve(mid, kBisectionBuckets).empty())
      lo = mid;
    else
      hi = mid;
  }
  return solve(hi, kBisectionBuckets);
}

Plan make_plan(const ModelConfig& cfg, const Budget& budget, const CostModel& costs, const LayerPolicy& pins) {
  return Planner(cfg, costs, pins).plan(budget);
}

}  // namespace remat
