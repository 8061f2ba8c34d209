// remat plan: the fastest policy whose true peak memory fits a budget.
#include <chrono>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/report.h"
#include "cli.h"
#include "remat/costs.h"
#include "remat/error.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/units.h"

namespace remat::cli {

namespace {

struct PlanFlags {
  ShapeFlags shape;
  std::string budget, pins, costs = "auto", threads, json;
};

int run(PlanFlags& f) {
  const ModelConfig cfg = f.shape.resolve();
  if (f.budget.empty()) fail("--budget is required, e.g. --budget 300MiB, --budget 2GB or --budget 60%");
  const Budget budget = parse_budget(f.budget);
  const CostSource source = parse_cost_source(f.costs);
  if (!f.json.empty()) check_writable(f.json);
  const ModelSpec spec = make_model(cfg);
  const LayerPolicy pins = f.pins.empty() ? keep_everything(spec.block) : Policy::parse_pins(f.pins, spec.block);
  const ThreadConfig threads = f.threads.empty() ? default_threads() : parse_threads(f.threads);
  const CostModel costs = choose_costs(cfg, source, threads);

  const auto t0 = std::chrono::steady_clock::now();
  const Plan p = make_plan(cfg, budget, costs, pins);
  const double planned_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("remat plan: {} | budget {}\n", describe(cfg), to_string(budget));
  fmt::print("  costs: {}\n  planned in {:.0f} ms\n\n", costs.source, planned_ms);
  if (!p.fits)
    fail("budget {} ({}) cannot be met: the smallest peak any policy reaches is {} (weights {}, gradients and "
         "activations {}, optimizer {}, data {})",
         f.budget, bytes_str(p.budget), bytes_str(p.min_budget), bytes_str(p.memory.params), bytes_str(p.memory.peak),
         bytes_str(p.memory.optimizer), bytes_str(p.memory.data));

  Table mem;
  mem.header = {"predicted", "none", "plan"};
  mem.numeric = {false, true, true};
  const StepMemory &n = p.none_memory, &m = p.memory;
  mem.rows = {{"weights", bytes_str(n.params), bytes_str(m.params)},
              {"optimizer state", bytes_str(n.optimizer), bytes_str(m.optimizer)},
              {"data", bytes_str(n.data), bytes_str(m.data)},
              {"saved after forward", bytes_str(n.saved), bytes_str(m.saved)},
              {"peak above that (activations, gradients)", bytes_str(n.peak), bytes_str(m.peak)},
              {"total peak", bytes_str(n.total_peak()), bytes_str(m.total_peak())},
              {"budget", "", bytes_str(p.budget)},
              {"step time", fmt::format("{:.1f} ms", p.none_step_ms),
               fmt::format("{:.1f} ms ({:+.1f}%)", p.step_ms, 100.0 * (p.step_ms / p.none_step_ms - 1.0))}};
  fmt::print("{}\n  peak at: {}\n\n  policy: {}\n\n", mem.markdown(), m.peak_at, p.policy_text);

  Table front;
  front.header = {"block option (one layer)", "saved", "recompute ms", "forward extra", "backward extra"};
  front.numeric = {false, true, true, true, true};
  for (const BlockOption& o : p.frontier)
    front.rows.push_back({o.text, bytes_str(o.saved), fmt::format("{:.2f}", o.recompute_ms), bytes_str(o.forward_extra),
                          bytes_str(o.backward_extra)});
  fmt::print("block frontier (no option beats another on saved bytes, time and working sets):\n\n{}", front.markdown());

  if (!f.json.empty()) {
    nlohmann::json j;
    auto memory = [](const StepMemory& s) {
      return nlohmann::json{{"params", s.params},       {"grads", s.grads},   {"optimizer", s.optimizer},
                            {"data", s.data},           {"saved", s.saved},   {"peak", s.peak},
                            {"total_peak", s.total_peak()}, {"peak_at", s.peak_at}};
    };
    j["config"] = {{"describe", describe(cfg)}, {"arch", cfg.arch}, {"layers", cfg.layers}, {"dim", cfg.dim},
                   {"heads", cfg.heads}, {"kv_heads", cfg.kv()}, {"batch", cfg.batch}, {"seq", cfg.seq},
                   {"ffn", cfg.hidden()}, {"vocab", cfg.vocab}, {"dtype", to_string(cfg.dtype)},
                   {"dropout", cfg.dropout}, {"attention", to_string(cfg.attention)}};
    j["budget"] = p.budget;
    j["fits"] = p.fits;
    j["policy"] = p.policy_text;
    j["memory"] = memory(m);
    j["none_memory"] = memory(n);
    j["step_ms"] = p.step_ms;
    j["none_step_ms"] = p.none_step_ms;
    j["costs"] = costs.source;
    j["frontier"] = nlohmann::json::array();
    for (const BlockOption& o : p.frontier)
      j["frontier"].push_back({{"option", o.text}, {"saved_bytes", o.saved}, {"recompute_ms", o.recompute_ms},
                               {"forward_extra", o.forward_extra}, {"backward_extra", o.backward_extra}});
    write_file_atomic(f.json, j.dump(2) + "\n");
    fmt::print("\nwrote {}\n", f.json);
  }
  return 0;
}

}  // namespace

Command add_plan(CLI::App& parent) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* a = parent.add_subcommand("plan", "find the fastest policy whose true peak memory fits a budget");
  f->shape.cfg.arch = "gpt2";
  f->shape.add(a);
  f->shape.add_planning(a);
  a->add_option("--budget", f->budget, "total peak memory: 300MiB, 2GB, 1.5GiB, or 60% (of none's activations)");
  a->add_option("--pins", f->pins, "choices the plan must keep, e.g. keep:qkv+drop:fc");
  a->add_option("--costs", f->costs, "auto (measure when a layer runs here quickly), measured, estimated")
      ->capture_default_str();
  a->add_option("--threads", f->threads, "ATen/BLAS threads for measuring, e.g. 1/2");
  a->add_option("--json", f->json, "write the plan as JSON");
  return {a, [f] { return run(*f); }};
}

}  // namespace remat::cli
