#include "app/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "app/report.h"
#include "remat/blas_kernel.h"
#include "remat/block.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/memory_model.h"
#include "remat/model.h"
#include "remat/module_model.h"
#include "remat/optim.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/resolve.h"
#include "remat/runtime.h"
#include "remat/schedule.h"
#include "remat/units.h"
#include "remat/version.h"
#include "util/cache.h"
#include "util/gemm.h"
#include "util/timing.h"

namespace remat {

namespace {

using detail::Clock;
using detail::median;
using detail::ms_since;

// The matmul floor: a step's FLOPs at a matmul rate, in milliseconds.
double floor_ms_at(int64_t flops, double gflops) { return static_cast<double>(flops) / (gflops * 1e9) * 1e3; }

// A model, its fixed batch and its loss, behind one interface so that every engine is measured by
// the same loop.
class Subject {
 public:
  virtual ~Subject() = default;
  virtual at::Tensor loss() = 0;
  virtual std::vector<at::Tensor> parameters() = 0;
};

class ModuleSubject final : public Subject {
 public:
  ModuleSubject(const ModelConfig& cfg, const Policy& policy, uint64_t seed) {
    at::manual_seed(seed);
    model_ = std::make_unique<ModuleModel>(cfg, policy);
    at::manual_seed(seed + 1);
    x_ = at::randn({cfg.seq, cfg.batch, cfg.dim});
    target_ = at::randn({cfg.seq, cfg.batch, cfg.dim});
  }
  // Reduction::None then mean(): LibTorch 1.13's Mean reduction returns a view that keeps the whole
  // unreduced (T, B, C) buffer alive until backward (see the mse_loss op).
  at::Tensor loss() override { return at::mse_loss(model_->forward(x_), target_, at::Reduction::None).mean(); }
  std::vector<at::Tensor> parameters() override { return model_->parameters(); }

 private:
  std::unique_ptr<ModuleModel> model_;
  at::Tensor x_, target_;
};

class OpsSubject final : public Subject {
 public:
  OpsSubject(const ModelConfig& cfg, const ResolvedPolicy& policy, uint64_t seed, ExecOptions options) {
    at::manual_seed(seed);
    model_ = GPT(cfg, policy, std::move(options));
    at::manual_seed(seed + 1);
    std::tie(input_, target_) = random_batch(cfg);
  }
  at::Tensor loss() override { return model_->forward(input_, target_); }
  std::vector<at::Tensor> parameters() override { return model_->parameters(); }
  GPT& model() { return model_; }
  const GPT& model() const { return model_; }

 private:
  GPT model_{nullptr};
  at::Tensor input_, target_;
};

std::unique_ptr<Subject> make_subject(Engine engine, const ModelConfig& cfg, const Policy& policy,
                                      const ResolvedPolicy& resolved, uint64_t seed, ExecOptions options = {}) {
  switch (engine) {
    case Engine::Module:
      return std::make_unique<ModuleSubject>(cfg, policy, seed);
    case Engine::Ops:
      return std::make_unique<OpsSubject>(cfg, resolved, seed, std::move(options));
  }
  REMAT_INTERNAL("unknown engine {}", static_cast<int>(engine));
}

// Whether the module path can run `policy` (whole layers only).
bool module_runs(const ModelConfig& cfg, const Policy& policy) {
  try {
    ModuleModel::check(cfg, policy);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The gradients of one forward/backward at the initial weights, cloned.
std::vector<at::Tensor> first_grads(Subject& s) {
  at::Tensor loss = s.loss();
  loss.backward();
  std::vector<at::Tensor> grads;
  for (at::Tensor& p : s.parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    p.mutable_grad() = at::Tensor();
  }
  return grads;
}

}  // namespace

double grad_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return std::numeric_limits<double>::infinity();
    if (!a[i].defined()) continue;
    const double d = (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>();
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

namespace {

std::string fmt_ms(double ms) { return fmt::format("{:.1f}", ms); }
std::string fmt_ratio(double r) { return fmt::format("{:.2f}x", r); }
std::string fmt_mib(int64_t b) { return fmt::format("{:.1f}", static_cast<double>(b) / (1 << 20)); }

const BenchRow* find_none(const std::vector<BenchRow>& rows, Engine engine, AttentionImpl attention) {
  for (const BenchRow& r : rows)
    if (r.engine == engine && r.attention == attention && r.policy == "none") return &r;
  return nullptr;
}

bool several_attentions(const std::vector<BenchRow>& rows) {
  for (const BenchRow& r : rows)
    if (r.attention != rows.front().attention) return true;
  return false;
}

// "flash none" when the run has several attention implementations, else "none".
std::string row_name(const BenchRow& r, bool several) {
  return several ? fmt::format("{} {}", to_string(r.attention), r.policy) : r.policy;
}

}  // namespace

std::string_view to_string(Engine e) {
  switch (e) {
    case Engine::Module:
      return "module";
    case Engine::Ops:
      return "ops";
  }
  return "?";
}

Engine parse_engine(std::string_view s) {
  if (s == "module") return Engine::Module;
  if (s == "ops") return Engine::Ops;
  fail("unknown --engine '{}'; allowed: module, ops", s);
}

std::vector<Engine> default_engines(const std::string& arch) {
  if (arch == "seed") return {Engine::Module, Engine::Ops};
  return {Engine::Ops};
}

namespace {

bool runs_engine(const BenchOptions& o, Engine e) {
  return std::find(o.engines.begin(), o.engines.end(), e) != o.engines.end();
}

// The attention implementations the rows run with: the options' list, else the model's.
std::vector<AttentionImpl> bench_attentions(const BenchOptions& o) {
  return o.attentions.empty() ? std::vector<AttentionImpl>{o.model.attention} : o.attentions;
}

}  // namespace

void check_bench_options(const BenchOptions& o) {
  validate(o.model);
  // Every timed and warm-up step runs every row: bounds far past what a comparison needs.
  constexpr int kMostSteps = 10000, kMostPolicies = 64;
  if (o.steps < 1 || o.steps > kMostSteps) fail("BenchOptions.steps must be in 1..{}, got {}", kMostSteps, o.steps);
  if (o.warmup < 0 || o.warmup > kMostSteps) fail("BenchOptions.warmup must be in 0..{}, got {}", kMostSteps, o.warmup);
  if (o.policies.empty()) fail("BenchOptions.policies is empty; give at least one policy, e.g. none,full");
  if (o.policies.size() > kMostPolicies)
    fail("BenchOptions.policies lists {} policies; give at most {}", o.policies.size(), kMostPolicies);
  for (size_t i = 0; i < o.policies.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (o.policies[i] == o.policies[j]) fail("BenchOptions.policies lists '{}' twice", o.policies[i]);
  if (o.engines.empty()) fail("BenchOptions.engines is empty; allowed: module, ops");
  for (size_t i = 0; i < o.engines.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (o.engines[i] == o.engines[j]) fail("BenchOptions.engines lists '{}' twice", to_string(o.engines[i]));
  for (size_t i = 0; i < o.attentions.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (o.attentions[i] == o.attentions[j])
        fail("BenchOptions.attentions lists '{}' twice", to_string(o.attentions[i]));
  const bool has_ops = runs_engine(o, Engine::Ops), has_module = runs_engine(o, Engine::Module);
  if (!has_ops)
    for (const auto& [on, name] :
         {std::pair{o.verify, "verify"}, std::pair{o.profile, "profile"}, std::pair{o.frontier, "frontier"}})
      if (on)
        fail("BenchOptions.{} is for the op-level engine; add it to BenchOptions.engines (ops, or module,ops)", name);
  const std::vector<AttentionImpl> attentions = bench_attentions(o);
  if (has_module && (attentions.size() > 1 || attentions[0] != AttentionImpl::Math))
    fail("the module path runs math attention only; give BenchOptions.engines ops with ModelConfig.attention flash");
  for (const std::string& text : o.policies) {
    const Policy p = Policy::parse(text);
    if (has_module && !has_ops) ModuleModel::check(o.model, p);
  }
  if (has_ops) {
    for (AttentionImpl a : attentions) {
      ModelConfig cfg = o.model;
      cfg.attention = a;
      check_engine(cfg);
      // Every variant first runs `none` for its reference gradients, beside every run's model (its
      // weights, Adam's moments and last gradients, kept until the report): refuse a shape whose
      // none does not fit this machine so (the kernel's OOM killer would end the run).
      ResolvedPolicy keep;
      keep.layers.assign(cfg.layers, keep_everything(make_block(cfg)));
      const auto spec = std::make_shared<const ModelSpec>(make_model(cfg));
      const StepMemory none = simulate_memory(compile_step(spec, keep), o.threads);
      const int64_t runs = static_cast<int64_t>(o.policies.size() * o.engines.size() * attentions.size());
      const int64_t need = none.total_peak() + (runs - 1) * (none.params + none.optimizer + none.grads);
      if (const int64_t usable = usable_memory(); usable > 0 && need > usable)
        fail(
            "with {} attention, none (every bench's reference step){} is predicted to peak at {}; runs here may "
            "take {} (nine tenths of what this machine has available): try {}--attention flash, a shorter --seq or "
            "a smaller --batch",
            to_string(a),
            runs > 1 ? fmt::format(" beside the other {} runs' weights, moments and gradients", runs - 1) : "",
            bytes_str(need), bytes_str(usable), runs > 1 ? "fewer --policies or --engine values, " : "");
    }
    // A policy no attention variant can run is refused now, with the first variant's error as a
    // single run would give it (one that fails in some variants only is left out of those, with a note).
    for (const std::string& text : o.policies) {
      const Policy p = Policy::parse(text);
      auto runs_on = [&](AttentionImpl a) {
        ModelConfig cfg = o.model;
        cfg.attention = a;
        try {
          check_policy(p, cfg, o.threads);
          return true;
        } catch (const Error&) {
          return false;
        }
      };
      if (std::none_of(attentions.begin(), attentions.end(), runs_on)) {
        ModelConfig cfg = o.model;
        cfg.attention = attentions[0];
        check_policy(p, cfg, o.threads);
      }
    }
  }
}

namespace {

void say(const BenchOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

// One attention implementation's model and its policies, resolved before anything runs.
struct Variant {
  ModelConfig cfg;
  std::vector<std::optional<Resolution>> resolved;  // by policy; empty where it was left out
  std::optional<CostModel> costs;
};

// Every policy is parsed, then resolved for each attention implementation, before anything runs:
// a bad name or an impossible budget fails here. A policy with nothing to drop under one
// implementation (attn under flash, which keeps no T x T tensor) is left out there, with a note.
// Budget plans measure op costs on one layer of the config (cached).
Variant resolve_variant(const BenchOptions& o, AttentionImpl a, const std::vector<Policy>& policies, bool first,
                        BenchResult& result) {
  const bool has_ops = runs_engine(o, Engine::Ops);
  Variant v;
  v.cfg = o.model;
  v.cfg.attention = a;
  ResolveOptions ro;
  ro.costs = CostSource::Measured;
  ro.threads = o.threads;
  ro.progress = o.progress;
  for (const Policy& p : policies) {
    if (!has_ops) {
      v.resolved.emplace_back();
      continue;
    }
    if (v.costs) ro.given = &*v.costs;
    try {
      v.resolved.push_back(resolve_policy(p, v.cfg, ro));
    } catch (const Error& e) {
      if (bench_attentions(o).size() == 1) throw;
      v.resolved.emplace_back();
      result.notes.push_back(fmt::format("{} attention: '{}' left out: {}", to_string(a), p.text(), e.what()));
      continue;
    }
    if (v.resolved.back()->costs && !v.costs) v.costs = v.resolved.back()->costs;
  }
  if (has_ops && o.frontier && !v.costs && first) {
    say(o, "measuring op costs on one layer (for the planner)");
    v.costs = choose_costs(v.cfg, CostSource::Measured, o.threads);
  }
  // Every row of the engine gets a predicted step time, so that the cost model the planner
  // trusts is checked against each measured row: measured on one layer where that takes
  // seconds, else estimated (choose_costs).
  if (has_ops && !v.costs) {
    say(o, "measuring op costs on one layer (for the predicted step times)");
    v.costs = choose_costs(v.cfg, CostSource::Auto, o.threads);
  }
  return v;
}

std::vector<Variant> resolve_variants(const BenchOptions& o, const std::vector<Policy>& policies, BenchResult& result) {
  const std::vector<AttentionImpl> attentions = bench_attentions(o);
  std::vector<Variant> variants;
  for (AttentionImpl a : attentions) variants.push_back(resolve_variant(o, a, policies, variants.empty(), result));
  for (size_t i = 0; i < policies.size() && runs_engine(o, Engine::Ops) && attentions.size() > 1; ++i) {
    bool any = false;
    for (const Variant& v : variants) any = any || v.resolved[i].has_value();
    if (!any) {  // it fails everywhere: the error of the first, as a single run would give it
      ModelConfig c = o.model;
      c.attention = attentions[0];
      resolve_policy(policies[i], c, {});
    }
  }
  return variants;
}

// One (attention, engine, policy): its own model and optimizer, and what its timed steps measured.
struct Entry {
  size_t variant = 0;  // index into variants
  BenchRow row;
  std::unique_ptr<Subject> subject;
  std::unique_ptr<Adam> adam;
  ExecOptions exec;
  std::vector<double> fwd_ms, bwd_ms;
  std::vector<std::string> ops;  // the block's op names (--profile)

  const GPT& model() const { return static_cast<const OpsSubject&>(*subject).model(); }
};

// The entry of policy i on `engine`, its gradients checked against `reference` (none's) and its
// predictions filled in; nullopt where the engine cannot run the policy.
std::optional<Entry> make_entry(const BenchOptions& o, const std::vector<Variant>& variants, size_t vi, Engine engine,
                                const Policy& policy, size_t i, const std::vector<at::Tensor>& reference,
                                BenchResult& result) {
  const Variant& v = variants[vi];
  const std::string& text = o.policies[i];
  if (engine == Engine::Ops && !v.resolved[i]) return std::nullopt;
  if (engine == Engine::Module && !module_runs(v.cfg, policy)) {
    result.notes.push_back(fmt::format("module path: '{}' chooses per tensor; it runs on the ops engine only", text));
    return std::nullopt;
  }
  say(o, fmt::format("{} {}: gradient check", to_string(engine), text));
  Entry e;
  e.variant = vi;
  const ResolvedPolicy r = engine == Engine::Ops ? v.resolved[i]->policy : ResolvedPolicy();
  if (o.profile && engine == Engine::Ops) e.exec.timer = std::make_shared<OpTimes>();
  e.subject = make_subject(engine, v.cfg, policy, r, o.seed, e.exec);
  e.adam = std::make_unique<Adam>(e.subject->parameters(), AdamOptions{o.lr});
  e.row.policy = text;
  e.row.engine = engine;
  e.row.attention = v.cfg.attention;
  e.row.flops_per_step = result.flops_per_step;
  e.row.grad_max_abs_diff = grad_difference(first_grads(*e.subject), reference);
  for (const OpNode& op : make_model(v.cfg).block.ops) e.ops.push_back(op.name);
  if (engine != Engine::Ops) return e;
  e.row.predicted_saved_bytes = e.model()->predicted_saved_bytes();
  e.row.predicted_peak_bytes = v.resolved[i]->memory.peak;
  if (v.costs) e.row.predicted_step_ms = v.costs->step_ms(e.model()->compiled_step());
  if (v.resolved[i]->plan) e.row.plan = v.resolved[i]->text;
  if (o.verify) {
    say(o, fmt::format("{} {}: verifying every recompute", to_string(engine), text));
    ExecOptions check;
    check.verify = true;
    auto checked = make_subject(engine, v.cfg, policy, r, o.seed, check);
    first_grads(*checked);  // throws, naming the tensor, on the first mismatch
    e.row.verified = true;
  }
  return e;
}

// Every (attention, engine, policy) gets its own model and optimizer. Steps then go round-robin,
// one step of each in turn, so that drifting machine load touches all of them alike.
std::vector<Entry> make_entries(const BenchOptions& o, const std::vector<Variant>& variants,
                                const std::vector<Policy>& policies, BenchResult& result) {
  std::vector<Entry> entries;
  const Policy none_policy = Policy::parse("none");
  for (size_t vi = 0; vi < variants.size(); ++vi)
    for (Engine engine : o.engines) {
      const Variant& v = variants[vi];
      const ResolvedPolicy none_resolved = none_policy.resolve(make_model(v.cfg).block, v.cfg.layers);
      std::vector<at::Tensor> reference;
      {
        say(o, fmt::format("{} {}: reference gradients (none)", to_string(engine), to_string(v.cfg.attention)));
        auto subject = make_subject(engine, v.cfg, none_policy, none_resolved, o.seed);
        reference = first_grads(*subject);
      }
      for (size_t i = 0; i < policies.size(); ++i)
        if (auto e = make_entry(o, variants, vi, engine, policies[i], i, reference, result))
          entries.push_back(std::move(*e));
    }
  return entries;
}

// One step of an entry (forward and loss, backward, Adam); a timed one records its times and bytes.
void run_step(const BenchOptions& o, Entry& e, int s, bool several) {
  const bool timed = s >= o.warmup;
  e.adam->zero_grad();
  const int64_t before = MemoryTracker::live();
  MemoryTracker::reset_peak();
  const auto t0 = Clock::now();
  double fwd, bwd;
  try {
    at::Tensor loss = e.subject->loss();
    fwd = ms_since(t0);
    const int64_t saved = MemoryTracker::live() - before;
    const auto t1 = Clock::now();
    loss.backward();
    bwd = ms_since(t1);
    if (timed) e.row.saved_bytes = std::max(e.row.saved_bytes, saved);
  } catch (const OutOfMemory& x) {
    fail_runtime("out of memory in a step of {} '{}': {}; {}; plan for this machine with --policies budget:{}MiB",
                 to_string(e.row.engine), e.row.policy, x.detail(),
                 e.row.predicted_peak_bytes >= 0
                     ? "its predicted peak is " + bytes_str(before + e.row.predicted_peak_bytes)
                     : "its peak is not predicted",
                 planned_share(usable_memory()) >> 20);
  }
  e.adam->step();
  const double step = ms_since(t0);
  if (timed) {
    e.row.peak_bytes = std::max(e.row.peak_bytes, MemoryTracker::peak() - before);
    e.row.step_ms.push_back(step);
    e.fwd_ms.push_back(fwd);
    e.bwd_ms.push_back(bwd);
  }
  say(o, fmt::format("{} {}/{}: {} {} {:.0f} ms", timed ? "step" : "warm-up", timed ? s - o.warmup + 1 : s + 1,
                     timed ? o.steps : o.warmup, to_string(e.row.engine), row_name(e.row, several), step));
}

// The 1024^3 rate beside a step: every GEMM the floor was chosen among, the median of three
// products each, the fastest kept (detail::fastest_gemm_rate). A round's floor then rests on
// whatever ran fastest beside its steps, not on the GEMM the rounds before the steps ranked first:
// a busy spell there can rank OpenBLAS's own threads over oneDNN, and a round whose OpenBLAS
// samples then ran slow would put its floor above a step that ran on oneDNN.
double fastest_beside_step(const BenchResult& result) {
  std::vector<std::string> gemms;
  for (const auto& [name, rate] : result.floor_gemm_rates) gemms.push_back(name);
  return detail::fastest_gemm_rate(gemms, [](const std::string& g) { return matmul_gflops(1024, 3, g); });
}

// The matmul rate drifts with the machine's load as much as step times do: it is sampled before
// every timed step, beside the step it is compared with; a round's rate is the median of its
// samples, and the floor's is the median of all of them. One sample at the start of a round
// missed the round's speed by up to a third on a shared VM (docs/design.md, NOTE [The engine's
// GEMMs], 4): a round of 9 rows lasts 8 to 90 s, the sample 60 ms. So are the op
// costs the predictions come from: one layer of each measured variant takes as many steps per
// round as the rows have layers (LayerProbe; its first step is its warm-up), so that each op's
// median stands on as many layer-steps as a row's time does. With one probe step per round, a
// slow spell in two of three rounds moved every row's prediction by +15% at once (GPT-2,
// T = 1024, on a shared VM); with one per layer, alternated runs came within 5% in every row.
// Returns the rate samples of each timed round.
std::vector<std::vector<double>> run_rounds(const BenchOptions& o, std::vector<Entry>& entries,
                                            std::vector<std::unique_ptr<LayerProbe>>& probes,
                                            const BenchResult& result) {
  const bool several = bench_attentions(o).size() > 1;
  std::vector<std::vector<double>> round_samples;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const bool timed = s >= o.warmup;
    if (timed) {
      round_samples.emplace_back();
      if (entries.empty()) round_samples.back().push_back(fastest_beside_step(result));
      for (auto& probe : probes)
        if (probe)
          for (int64_t i = 0; i < o.model.layers; ++i) probe->step();
    }
    for (Entry& e : entries) {
      if (timed && s == o.warmup && e.exec.timer) e.exec.timer->zero();  // count timed steps only
      if (timed) {  // 1024^3 products on every GEMM, just before the step they are compared with
        e.row.step_gflops.push_back(fastest_beside_step(result));
        round_samples.back().push_back(e.row.step_gflops.back());
      }
      run_step(o, e, s, several);
      // A step that ran OpenBLAS's own threads leaves them spinning for about 2^28 cycles
      // (docs/design.md, NOTE [The engine's GEMMs], 2) on the cores the next row's kernel threads
      // need: the engine's first row after the module path's read 4-7% above its prediction, its
      // forward 10-40 ms slower than the engine's other rows'. The next row starts once they sleep.
      if (e.row.engine == Engine::Module || !detail::gemm_on_kernel_threads()) detail::let_blas_threads_sleep();
    }
  }
  return round_samples;
}

// --profile: the entry's op times per step beside what the cost model says of each op.
OpProfile op_profile(const BenchOptions& o, const Entry& e, const std::optional<CostModel>& in_run, bool several) {
  OpProfile prof;
  prof.policy = row_name(e.row, several);
  for (size_t op = 0; op < e.ops.size(); ++op) {
    prof.ops.push_back(e.ops[op]);
    prof.forward_ms.push_back(e.exec.timer->forward_ms[op] / o.steps);
    prof.recompute_ms.push_back(e.exec.timer->recompute_ms[op] / o.steps);
    prof.backward_ms.push_back(e.exec.timer->backward_ms[op] / o.steps);
  }
  if (in_run) {  // what the cost model says of each op, for the same step
    CostModel::OpStepMs t = in_run->op_ms(e.model()->compiled_step());
    prof.predicted_forward_ms = std::move(t.forward);
    prof.predicted_recompute_ms = std::move(t.recompute);
    prof.predicted_backward_ms = std::move(t.backward);
  }
  return prof;
}

// A row's medians and its step over the floor, overall and per timed round (each round took one
// step of the row at that round's rate: how far a 1.13x is from a 1.15x target on this noise).
void summarize_row(BenchRow& row, const std::vector<double>& fwd_ms, const std::vector<double>& bwd_ms,
                   const BenchResult& result) {
  row.step_ms_median = median(row.step_ms);
  row.step_ms_min = *std::min_element(row.step_ms.begin(), row.step_ms.end());
  row.step_ms_max = *std::max_element(row.step_ms.begin(), row.step_ms.end());
  row.fwd_ms_median = median(fwd_ms);
  row.bwd_ms_median = median(bwd_ms);
  row.floor_ratio = row.step_ms_median / result.floor_ms;
  std::vector<double> per_round(row.step_ms.size());
  for (size_t i = 0; i < row.step_ms.size(); ++i)
    per_round[i] = row.step_ms[i] / floor_ms_at(result.flops_per_step, result.round_gflops[i]);
  const auto [lo, hi] = std::minmax_element(per_round.begin(), per_round.end());
  row.floor_ratio_min = *lo;
  row.floor_ratio_max = *hi;
}

// The planner's curve: plans at budgets from the least memory to none's peak.
std::vector<BenchResult::FrontierPoint> frontier(const ModelConfig& cfg, const CostModel& costs) {
  std::vector<BenchResult::FrontierPoint> points;
  const Planner planner(cfg, costs, keep_everything(make_model(cfg).block));
  const Plan least = planner.plan(Budget{planner.none_memory().base() + 1, 0});
  const int64_t lo = least.min_budget, hi = planner.none_memory().total_peak();
  for (int i = 0; i <= 24; ++i) {
    const Plan p = planner.plan(Budget{lo + (hi - lo) * i / 24, 0});
    if (p.fits) points.push_back({p.step_ms, p.memory.peak});
  }
  return points;
}

// Probes and the floor's GEMM before the rounds, every row's medians, predictions and profile after.
void measure(const BenchOptions& o, const std::vector<Variant>& variants, std::vector<Entry>& entries,
             BenchResult& result) {
  // One layer of each variant whose costs are measured, stepped by run_rounds; its first step is
  // its warm-up.
  std::vector<std::unique_ptr<LayerProbe>> probes(variants.size());
  for (size_t vi = 0; vi < variants.size(); ++vi)
    if (variants[vi].costs && variants[vi].costs->measured) {
      probes[vi] = std::make_unique<LayerProbe>(variants[vi].cfg);
      probes[vi]->step();
    }
  // The floor is the model's FLOPs at the fastest GEMM here, not at the engine's: a step measured
  // against its own GEMM's rate can read "faster than its floor" when that GEMM is slow.
  result.floor_rounds = 5;
  const FastestMatmul fastest = fastest_matmul_gflops(1024, result.floor_rounds);
  result.floor_gemm = fastest.gemm;
  result.floor_gemm_rates = fastest.rates;
  detail::let_blas_threads_sleep();
  const int peak_threads = std::max(o.threads.blas, o.threads.aten);
  result.peak = peak_gflops(peak_threads);
  const std::vector<std::vector<double>> round_samples = run_rounds(o, entries, probes, result);
  // The peak again after the steps, the faster kept: a busy spell on a shared host can slow all
  // three rounds of one measurement, and a peak below the GEMM rates beside it means nothing.
  detail::let_blas_threads_sleep();  // as before the first: no BLAS worker spins beside it
  if (const PeakRate after = peak_gflops(peak_threads); after.gflops > result.peak.gflops) result.peak = after;
  if (result.peak.gflops > 0) result.peak.how += ", before the steps and after them, the faster kept";

  // Predictions from the costs timed in these rounds; the plans were made with the costs before.
  for (const std::vector<double>& r : round_samples) {
    result.round_gflops.push_back(median(r));
    result.sampled_gflops.insert(result.sampled_gflops.end(), r.begin(), r.end());
  }
  result.matmul_gflops = median(result.sampled_gflops);
  result.floor_ms = floor_ms_at(result.flops_per_step, result.matmul_gflops);
  std::vector<std::optional<CostModel>> in_run(variants.size());
  for (size_t vi = 0; vi < variants.size(); ++vi)
    if (probes[vi]) {
      in_run[vi] = probes[vi]->costs();
      in_run[vi]->threads = o.threads;
      in_run[vi]->matmul_gflops = result.matmul_gflops;
      if (result.costs_in_run.empty()) result.costs_in_run = in_run[vi]->source;
    }
  const bool several = bench_attentions(o).size() > 1;
  for (Entry& e : entries) {
    if (e.row.engine == Engine::Ops && in_run[e.variant])
      e.row.predicted_step_ms = in_run[e.variant]->step_ms(e.model()->compiled_step());
    summarize_row(e.row, e.fwd_ms, e.bwd_ms, result);
    if (e.exec.timer) result.profiles.push_back(op_profile(o, e, in_run[e.variant], several));
    result.rows.push_back(e.row);
  }
  // The planner's curve timed with the costs of these rounds where they were taken.
  const Variant& first = variants.front();
  if (o.frontier && first.costs) result.frontier = frontier(first.cfg, in_run.front() ? *in_run.front() : *first.costs);
}

}  // namespace

double detail::fastest_gemm_rate(std::vector<std::string> gemms,
                                 const std::function<double(const std::string&)>& sample) {
  std::stable_partition(gemms.begin(), gemms.end(), [](const std::string& g) { return g == "blas-threads"; });
  double best = 0;
  for (const std::string& g : gemms) {
    best = std::max(best, sample(g));
    if (g == "blas-threads") let_blas_threads_sleep();  // the next to run has the cores
  }
  return best;
}

BenchResult run_bench(const BenchOptions& o) {
  check_bench_options(o);
  MemoryTracker::install();
  apply_threads(o.threads);
  std::vector<Policy> policies;
  for (const std::string& text : o.policies) policies.push_back(Policy::parse(text));
  BenchResult result;
  const std::vector<Variant> variants = resolve_variants(o, policies, result);

  result.options = o;
  result.blas = blas_name();
  result.gemm = gemm_name();
  result.gemm_record = gemm_record();
  for (const Variant& v : variants)
    if (v.costs && result.costs.empty()) {
      result.costs = v.costs->source;
      result.costs_gflops = v.costs->matmul_gflops;
    }
  ModelConfig math = o.model;
  math.attention = AttentionImpl::Math;
  result.flops_per_step = make_model(math).step_flops();

  std::vector<Entry> entries = make_entries(o, variants, policies, result);
  measure(o, variants, entries, result);
  const BenchRow* module_none = find_none(result.rows, Engine::Module, AttentionImpl::Math);
  const BenchRow* ops_none = find_none(result.rows, Engine::Ops, AttentionImpl::Math);
  if (module_none && ops_none)
    result.notes.push_back(fmt::format("ops engine none / module path none step time: {:.3f}",
                                       ops_none->step_ms_median / module_none->step_ms_median));
  return result;
}

std::string BenchResult::markdown() const {
  Table t;
  bool timed_predictions = false;
  for (const BenchRow& r : rows) timed_predictions = timed_predictions || r.predicted_step_ms >= 0;
  const bool several = !rows.empty() && several_attentions(rows);
  t.header = {"policy",    "engine",       "step ms",      "min-max ms", "fwd ms",
              "bwd ms",    "time vs none", "saved MiB",    "predicted",  "peak MiB",
              "predicted", "peak vs none", "step / floor", "per round",  "grad diff"};
  t.numeric = {false, false, true, true, true, true, true, true, true, true, true, true, true, true, true};
  if (timed_predictions) {
    t.header.insert(t.header.begin() + 3, {"predicted", "time error"});
    t.numeric.insert(t.numeric.begin() + 3, {true, true});
  }
  if (several) {
    t.header.insert(t.header.begin() + 1, "attention");
    t.numeric.insert(t.numeric.begin() + 1, false);
  }
  auto or_dash = [](bool ok, const std::string& s) { return ok ? s : std::string("-"); };
  for (const BenchRow& r : rows) {
    const BenchRow* none = find_none(rows, r.engine, r.attention);
    std::vector<std::string> row = {
        r.policy,
        std::string(to_string(r.engine)),
        fmt_ms(r.step_ms_median),
        fmt::format("{:.0f}-{:.0f}", r.step_ms_min, r.step_ms_max),
        fmt_ms(r.fwd_ms_median),
        fmt_ms(r.bwd_ms_median),
        none ? fmt_ratio(r.step_ms_median / none->step_ms_median) : "-",
        fmt_mib(r.saved_bytes),
        or_dash(r.predicted_saved_bytes >= 0, fmt_mib(r.predicted_saved_bytes)),
        fmt_mib(r.peak_bytes),
        or_dash(r.predicted_peak_bytes >= 0, fmt_mib(r.predicted_peak_bytes)),
        none ? fmt_ratio(static_cast<double>(r.peak_bytes) / static_cast<double>(none->peak_bytes)) : "-",
        fmt_ratio(r.floor_ratio),
        fmt::format("{:.2f}-{:.2f}", r.floor_ratio_min, r.floor_ratio_max),
        fmt::format("{:g}", r.grad_max_abs_diff)};
    if (timed_predictions) {
      const bool p = r.predicted_step_ms >= 0;
      row.insert(row.begin() + 3,
                 {or_dash(p, fmt_ms(r.predicted_step_ms)),
                  or_dash(p, fmt::format("{:+.1f}%", 100.0 * (r.predicted_step_ms / r.step_ms_median - 1)))});
    }
    if (several) row.insert(row.begin() + 1, std::string(to_string(r.attention)));
    t.rows.push_back(std::move(row));
  }
  std::string out = t.markdown();
  for (const BenchRow& r : rows)
    if (!r.plan.empty()) out += fmt::format("\n{}: the planner chose {}", row_name(r, several), r.plan);
  if (!costs_in_run.empty()) {
    out += "\nop costs for predictions: " + costs_in_run + ", taken in the same rounds as the rows";
    if (!costs.empty()) out += "; the plans were made before the run with: " + costs;
    out += "\n";
  } else if (!costs.empty()) {
    out += "\nop costs for predictions: " + costs;
    if (costs_gflops > 0)
      out += fmt::format(" (matmul {:.1f} GFLOP/s then, {:.1f} in this run)", costs_gflops, matmul_gflops);
    out += "\n";
  }
  for (const std::string& n : notes) out += "\n" + n;
  if (!notes.empty()) out += "\n";
  return out;
}

std::string BenchResult::profile_markdown() const {
  std::string out;
  for (const OpProfile& p : profiles) {
    Table t;
    const bool predicted = !p.predicted_forward_ms.empty();
    t.header = {"op", "forward ms", "recompute ms", "backward ms"};
    if (predicted) t.header.insert(t.header.end(), {"predicted fwd", "predicted rec", "predicted bwd"});
    t.numeric.assign(t.header.size(), true);
    t.numeric[0] = false;
    double f = 0, r = 0, b = 0, pf = 0, pr = 0, pb = 0;
    for (size_t i = 0; i < p.ops.size(); ++i) {
      t.rows.push_back({p.ops[i], fmt::format("{:.2f}", p.forward_ms[i]), fmt::format("{:.2f}", p.recompute_ms[i]),
                        fmt::format("{:.2f}", p.backward_ms[i])});
      if (predicted) {
        t.rows.back().insert(t.rows.back().end(), {fmt::format("{:.2f}", p.predicted_forward_ms[i]),
                                                   fmt::format("{:.2f}", p.predicted_recompute_ms[i]),
                                                   fmt::format("{:.2f}", p.predicted_backward_ms[i])});
        pf += p.predicted_forward_ms[i];
        pr += p.predicted_recompute_ms[i];
        pb += p.predicted_backward_ms[i];
      }
      f += p.forward_ms[i];
      r += p.recompute_ms[i];
      b += p.backward_ms[i];
    }
    t.rows.push_back({"all blocks", fmt::format("{:.2f}", f), fmt::format("{:.2f}", r), fmt::format("{:.2f}", b)});
    if (predicted)
      t.rows.back().insert(t.rows.back().end(),
                           {fmt::format("{:.2f}", pf), fmt::format("{:.2f}", pr), fmt::format("{:.2f}", pb)});
    out += fmt::format("\nper-op time of the blocks, ms per step (ops engine, {}):\n\n", p.policy) + t.markdown();
  }
  return out;
}

std::string BenchResult::csv() const {
  std::string s =
      "policy,engine,attention,step_ms_median,step_ms_min,step_ms_max,fwd_ms_median,bwd_ms_median,saved_bytes,"
      "predicted_saved_bytes,peak_bytes,grad_max_abs_diff,flops_per_step,floor_ratio,floor_ratio_min,floor_ratio_max\n";
  for (const BenchRow& r : rows)
    s += fmt::format("\"{}\",{},{},{:.3f},{:.3f},{:.3f},{:.3f},{:.3f},{},{},{},{:g},{},{:.4f},{:.4f},{:.4f}\n",
                     r.policy, to_string(r.engine), to_string(r.attention), r.step_ms_median, r.step_ms_min,
                     r.step_ms_max, r.fwd_ms_median, r.bwd_ms_median, r.saved_bytes,
                     r.predicted_saved_bytes >= 0 ? std::to_string(r.predicted_saved_bytes) : "", r.peak_bytes,
                     r.grad_max_abs_diff, r.flops_per_step, r.floor_ratio, r.floor_ratio_min, r.floor_ratio_max);
  return s;
}

namespace {

// A row as the bench's JSON keeps it; a value not predicted is null.
nlohmann::json row_json(const BenchRow& r) {
  auto predicted = [](auto v) { return v >= 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
  return {{"policy", r.policy},
          {"engine", to_string(r.engine)},
          {"attention", to_string(r.attention)},
          {"step_ms_median", r.step_ms_median},
          {"step_ms_min", r.step_ms_min},
          {"step_ms_max", r.step_ms_max},
          {"step_ms", r.step_ms},
          {"step_gflops", r.step_gflops},
          {"fwd_ms_median", r.fwd_ms_median},
          {"bwd_ms_median", r.bwd_ms_median},
          {"saved_bytes", r.saved_bytes},
          {"predicted_saved_bytes", predicted(r.predicted_saved_bytes)},
          {"peak_bytes", r.peak_bytes},
          {"grad_max_abs_diff",  // (JSON has no NaN or infinity: as the table writes them)
           std::isfinite(r.grad_max_abs_diff) ? nlohmann::json(r.grad_max_abs_diff)
                                              : nlohmann::json(fmt::format("{}", r.grad_max_abs_diff))},
          {"flops_per_step", r.flops_per_step},
          {"floor_ratio", r.floor_ratio},
          {"floor_ratio_min", r.floor_ratio_min},
          {"floor_ratio_max", r.floor_ratio_max},
          {"verified", r.verified},
          {"predicted_peak_bytes", predicted(r.predicted_peak_bytes)},
          {"predicted_step_ms", predicted(r.predicted_step_ms)},
          {"plan", r.plan}};
}

}  // namespace

std::string BenchResult::json() const {
  const ModelConfig& m = options.model;
  nlohmann::json config = model_json(m);
  std::string attentions;  // the rows' attention implementations, "math,flash"
  for (AttentionImpl a : bench_attentions(options))
    attentions += (attentions.empty() ? "" : ",") + std::string(to_string(a));
  config["attention"] = attentions;
  config.update({
      {"remat", std::string(version())},
      {"cpu", detail::cpu_model()},
      {"steps", options.steps},
      {"warmup", options.warmup},
      {"seed", options.seed},
      {"lr", options.lr},
      {"threads", to_string(options.threads)},
      {"blas", blas},
      {"blas_kernel", blas::loaded_kernel()},
      {"gemm", gemm},
      {"gemm_record", gemm_record},
      {"floor_gemm", floor_gemm},
      {"matmul_gflops", matmul_gflops},
      {"peak_gflops", peak.gflops},
      {"peak_how", peak.how},
      {"round_gflops", round_gflops},
      {"sampled_gflops", sampled_gflops},
      {"flops_per_step", flops_per_step},
      {"floor_ms", floor_ms},
      {"costs", costs},
      {"costs_in_run", costs_in_run},
      {"costs_matmul_gflops", costs_gflops},
      {"libtorch", TORCH_VERSION},
  });
  nlohmann::json engines = nlohmann::json::array();
  for (Engine e : options.engines) engines.push_back(to_string(e));
  config["engines"] = engines;
  nlohmann::json floor_rates = nlohmann::json::object();
  for (const auto& [name, rate] : floor_gemm_rates) floor_rates[name] = rate;
  config["floor_gemm_gflops"] = floor_rates;
  if (!options.gemm_choice.classes.empty())
    config["gemm_choice"] = {{"source", options.gemm_choice.source},
                             {"classes", detail::gemm_classes_json(options.gemm_choice.classes)},
                             {"pass_ms", options.gemm_choice.pass_ms}};
  nlohmann::json out = {{"config", config}, {"rows", nlohmann::json::array()}, {"notes", notes}};
  for (const BenchRow& r : rows) out["rows"].push_back(row_json(r));
  return out.dump(2) + "\n";
}

void BenchResult::write_chart(const std::string& path) const {
  Chart chart;
  if (!frontier.empty()) {
    ChartSeries line;
    line.title = "planner frontier (predicted: fastest plan at each peak)";
    line.line = true;
    for (const FrontierPoint& f : frontier)
      line.points.push_back({"", f.step_ms, static_cast<double>(f.peak_bytes) / (1 << 20)});
    chart.series.push_back(std::move(line));
  }
  chart.title = "remat bench: " + describe(options.model);
  chart.xlabel = "step time, median (ms)";
  chart.ylabel = "peak memory above weights and optimizer state (MiB)";
  const bool several = !rows.empty() && several_attentions(rows);
  for (Engine e : options.engines)
    for (AttentionImpl a : {AttentionImpl::Math, AttentionImpl::Flash}) {
      ChartSeries series;
      series.title = e == Engine::Module ? "module path (torch::nn + remat::checkpoint)" : "ops engine (remat::GPT)";
      if (several) series.title += fmt::format(", {} attention", to_string(a));
      for (const BenchRow& r : rows)
        if (r.engine == e && r.attention == a)
          series.points.push_back({r.policy, r.step_ms_median, static_cast<double>(r.peak_bytes) / (1 << 20)});
      if (!series.points.empty()) chart.series.push_back(std::move(series));
    }
  render_chart(chart, path);
}

}  // namespace remat
