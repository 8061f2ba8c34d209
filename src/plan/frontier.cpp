// The block frontier: every way to run one block that no other way beats (NOTE [The planner], 2).
#include <algorithm>
#include <map>

#include "remat/error.h"
#include "remat/planner.h"

namespace remat {

namespace {

// A choosable tensor at most 1/kNegligible of the largest is always kept, not searched: each such
// tensor moves a layer's saved bytes by under 2%, and every searched tensor doubles the options.
constexpr int64_t kNegligible = 64;

// Tensors the search decides: choosable, not pinned, and not tiny.
std::vector<int> searched_tensors(const BlockSpec& block, const LayerPolicy& pins) {
  if (pins.tensors.size() != block.tensors.size())
    fail(
        "pins hold {} tensor choices for the '{}' block's {}; make them for this block (keep_everything, "
        "Policy::parse_pins)",
        pins.tensors.size(), block.kind, block.tensors.size());
  int64_t largest = 0;
  for (int t : block.choosable()) largest = std::max(largest, block.tensors[t].bytes());
  std::vector<int> ids;
  for (int t : block.choosable()) {
    if (pins.tensors[t].strength == Strength::Must) continue;
    if (block.tensors[t].bytes() * kNegligible <= largest) continue;
    ids.push_back(t);
  }
  return ids;
}

std::string option_text(const BlockSpec& block, const std::vector<int>& dropped) {
  if (dropped.empty()) return "none";
  if (dropped.size() == block.choosable().size()) return "full";
  std::string s = "drop:";
  for (size_t i = 0; i < dropped.size(); ++i) s += (i ? "," : "") + block.tensors[dropped[i]].name;
  return s;
}

// One option: its schedule's bytes and working sets, replayed by the memory model on a lone block.
BlockOption evaluate(const BlockSpec& block, const CostModel& costs, const LayerPolicy& lp, const Schedule& s) {
  BlockOption o;
  o.policy = lp;
  for (int t : block.choosable())
    if (!lp.saves(t)) o.dropped.push_back(t);
  const BlockMemory m = simulate_block(block, s, costs.threads);
  o.saved = m.saved;
  o.forward_extra = m.forward_extra;
  o.backward_extra = m.backward_extra;
  o.recompute_ms = costs.block.empty() ? 0.0 : costs.recompute_ms(s);
  o.text = option_text(block, o.dropped);
  return o;
}

bool same_point(const BlockOption& a, const BlockOption& b) {
  return a.saved == b.saved && a.recompute_ms == b.recompute_ms && a.forward_extra == b.forward_extra &&
         a.backward_extra == b.backward_extra;
}

bool dominates(const BlockOption& a, const BlockOption& b) {
  const bool no_worse = a.saved <= b.saved && a.recompute_ms <= b.recompute_ms && a.forward_extra <= b.forward_extra &&
                        a.backward_extra <= b.backward_extra;
  return no_worse && !same_point(a, b);
}

LayerPolicy with_drops(const BlockSpec& block, const LayerPolicy& pins, const std::vector<int>& searched,
                       uint32_t mask) {
  LayerPolicy lp = pins;
  for (int t : block.choosable())
    if (pins.tensors[t].strength != Strength::Must) lp.tensors[t] = {Choice::Save, Strength::Prefer};
  for (size_t i = 0; i < searched.size(); ++i)
    if (mask & (1u << i)) lp.tensors[searched[i]] = {Choice::Recompute, Strength::Prefer};
  return lp;
}

void sort_options(std::vector<BlockOption>& v) {
  std::sort(v.begin(), v.end(), [](const BlockOption& a, const BlockOption& b) {
    if (a.saved != b.saved) return a.saved > b.saved;
    if (a.recompute_ms != b.recompute_ms) return a.recompute_ms < b.recompute_ms;
    return a.dropped < b.dropped;
  });
}

}  // namespace

std::vector<BlockOption> block_frontier(const BlockSpec& block, const CostModel& costs, const LayerPolicy& pins) {
  const std::vector<int> searched = searched_tensors(block, pins);
  if (searched.size() > 20) fail("block_frontier: {} tensors to search is too many (at most 20)", searched.size());
  // Many subsets compile to the same schedule (dropping a tensor nobody else needs once its
  // consumer is recomputed anyway): evaluate each distinct (saved set, recompute set) once.
  std::map<std::pair<std::vector<bool>, std::vector<int>>, BlockOption> distinct;
  for (uint32_t mask = 0; mask < (1u << searched.size()); ++mask) {
    const LayerPolicy lp = with_drops(block, pins, searched, mask);
    const Schedule s = compile_schedule(block, lp);
    auto key = std::make_pair(s.saved, s.recomputed);
    if (distinct.count(key)) continue;
    distinct.emplace(std::move(key), evaluate(block, costs, lp, s));
  }
  std::vector<BlockOption> all;
  for (auto& [key, o] : distinct) all.push_back(std::move(o));
  // Sweep by saved bytes: an option can only be beaten by one that saves no more.
  sort_options(all);
  std::vector<BlockOption> front;
  for (size_t i = all.size(); i-- > 0;) {
    const bool beaten = std::any_of(front.begin(), front.end(), [&](const BlockOption& f) {
      return dominates(f, all[i]) || same_point(f, all[i]);
    });
    if (beaten) continue;
    // Later (larger-saved) options cannot beat it on saved bytes, but equal-saved ones can: drop
    // those already kept that it beats.
    front.erase(std::remove_if(front.begin(), front.end(), [&](const BlockOption& f) { return dominates(all[i], f); }),
                front.end());
    front.push_back(all[i]);
  }
  sort_options(front);
  return front;
}

std::vector<BlockOption> block_frontier_brute_force(const BlockSpec& block, const CostModel& costs,
                                                    const LayerPolicy& pins) {
  const std::vector<int> searched = searched_tensors(block, pins);
  std::vector<BlockOption> all;
  for (uint32_t mask = 0; mask < (1u << searched.size()); ++mask) {
    const LayerPolicy lp = with_drops(block, pins, searched, mask);
    all.push_back(evaluate(block, costs, lp, compile_schedule(block, lp)));
  }
  std::vector<BlockOption> front;
  for (size_t i = 0; i < all.size(); ++i) {
    bool beaten = false;
    for (size_t j = 0; j < all.size() && !beaten; ++j) beaten = dominates(all[j], all[i]);
    // Keep one of each set of equal points: the first in sorted order.
    const bool duplicate =
        std::any_of(front.begin(), front.end(), [&](const BlockOption& f) { return same_point(f, all[i]); });
    if (!beaten && !duplicate) front.push_back(all[i]);
  }
  sort_options(front);
  return front;
}

}  // namespace remat
