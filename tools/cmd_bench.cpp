// remat bench: step time, saved and peak memory, and gradient checks for a list of policies.
#include <algorithm>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "app/bench.h"
#include "app/report.h"
#include "cli.h"
#include "remat/error.h"
#include "remat/policy.h"
#include "util/paths.h"

namespace remat::cli {

namespace {

struct BenchFlags {
  ShapeFlags shape;
  std::string policies = "none,full,every:2,every:3";
  std::vector<std::string> engines;  // lists, one per --engine given; none: default_engines(arch)
  int steps = 5, warmup = 2;
  std::string threads, json, csv, markdown;
  std::vector<std::string> charts;
  uint64_t seed = 1234;
  bool verify = false, profile = false, frontier = false;
  std::optional<BenchOptions> options;  // the flags as options, once check() has run
};

// The flags as BenchOptions, checked (check_bench_options) and kept for run.
void check(BenchFlags& f) {
  BenchOptions o;
  o.model = f.shape.resolve();
  for (const std::string& a : split_list(f.shape.attention, "--attention", "math, flash"))
    o.attentions.push_back(parse_attention(a));
  o.policies = split_policy_list(f.policies);
  o.engines = default_engines(o.model.arch);
  if (!f.engines.empty()) {
    o.engines.clear();
    for (const std::string& list : f.engines)
      for (const std::string& e : split_list(list, "--engine", "module, ops")) o.engines.push_back(parse_engine(e));
  }
  o.verify = f.verify;
  o.profile = f.profile;
  o.frontier = f.frontier;
  o.steps = f.steps;
  o.warmup = f.warmup;
  o.seed = f.seed;
  if (!f.threads.empty()) o.threads = parse_threads(f.threads);
  if (f.frontier && f.charts.empty())
    fail("--frontier draws the planner's frontier on the chart: give --chart FILE.png (or .svg) too");
  FileRoles files;
  files.output("--json", f.json);
  files.output("--csv", f.csv);
  files.output("--markdown", f.markdown);
  for (const std::string& c : f.charts) files.output("--chart", c);
  files.check();
  for (const std::string& p : {f.json, f.csv, f.markdown})
    if (!p.empty()) check_writable(p);
  for (const std::string& c : f.charts) {
    check_chart_path(c);
    check_writable(c);
  }
  check_bench_options(o);
  o.progress = progress;
  f.options = std::move(o);
}

int run(BenchFlags& f) {
  if (!f.options) check(f);
  BenchOptions& o = *f.options;
  o.gemm_choice = settle_gemm(o.threads);

  std::string engine_names;
  for (Engine e : o.engines) engine_names += (engine_names.empty() ? "" : ",") + std::string(to_string(e));
  fmt::print("remat bench: {}\n", describe(o.model));
  std::string attentions;
  for (AttentionImpl a : o.attentions) attentions += (attentions.empty() ? "" : ",") + std::string(to_string(a));
  fmt::print(
      "  policies {} | engine {} | attention {} | {} warm-up + {} timed steps | threads ATen/BLAS {} | seed {}\n",
      fmt::join(o.policies, " "), engine_names, attentions, o.warmup, o.steps, to_string(o.threads), o.seed);
  fmt::print("{}", describe(o.gemm_choice));
  std::fflush(stdout);

  const BenchResult r = run_bench(o);
  end_progress();
  const auto [slowest, fastest] = std::minmax_element(r.round_gflops.begin(), r.round_gflops.end());
  std::string tried;
  for (const auto& [name, rate] : r.floor_gemm_rates)
    tried += fmt::format("{}{} {:.1f}", tried.empty() ? "" : ", ", name, rate);
  fmt::print("  BLAS: {}\n  GEMM: {}\n", r.blas, r.gemm);
  fmt::print(
      "  floor {:.1f} ms: the model's {:.2f} GFLOP per step at {:.1f} GFLOP/s, the fastest GEMM here on 1024^3 "
      "(every GEMM sampled before each of the {} timed steps, the fastest taken; rounds' medians {:.1f}-{:.1f}; "
      "before the steps {} was fastest, medians of {} interleaved rounds: {})\n",
      r.floor_ms, static_cast<double>(r.flops_per_step) / 1e9, r.matmul_gflops, r.sampled_gflops.size(), *slowest,
      *fastest, r.floor_gemm, r.floor_rounds, tried);
  if (r.peak.gflops <= 0)
    fmt::print("  peak: {}\n\n", r.peak.how);
  else if (r.matmul_gflops <= r.peak.gflops)
    fmt::print("  peak {:.1f} GFLOP/s ({}): the 1024^3 GEMM runs at {:.0f}% of it\n\n", r.peak.gflops, r.peak.how,
               100 * r.matmul_gflops / r.peak.gflops);
  else  // both measurements slowed by the host: what share of the peak the GEMM reaches is unknown
    fmt::print("  peak {:.1f} GFLOP/s ({}): below the 1024^3 GEMM's rate, so a busy host slowed it; not a peak\n\n",
               r.peak.gflops, r.peak.how);
  const std::string table = r.markdown();
  fmt::print("{}", table);
  if (o.profile) fmt::print("{}", r.profile_markdown());
  if (!f.json.empty()) write_file_atomic(f.json, r.json());
  if (!f.csv.empty()) write_file_atomic(f.csv, r.csv());
  if (!f.markdown.empty()) write_file_atomic(f.markdown, table);
  for (const std::string& c : f.charts) r.write_chart(c);
  for (const std::string& p : {f.json, f.csv, f.markdown})
    if (!p.empty()) fmt::print("wrote {}\n", p);
  for (const std::string& c : f.charts) fmt::print("wrote {}\n", c);
  // remat's promise: every policy's gradients are bitwise those of none. `!(d == 0)`: NaN fails too.
  for (const BenchRow& row : r.rows)
    if (!(row.grad_max_abs_diff == 0))
      fail_runtime(
          "the gradients of '{}' ({}) differ from none's by {}: a recompute is not bitwise; run with "
          "--verify to name the tensor",
          row.policy, to_string(row.engine), row.grad_max_abs_diff);
  return 0;
}

}  // namespace

Command add_bench(CLI::App& parent) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* a = parent.add_subcommand("bench", "measure step time and memory of recompute policies");
  f->shape.lists_attention = true;
  f->shape.add(a);
  a->add_option("--vocab", f->shape.cfg.vocab, "token models: vocabulary size (the tokens are random)")
      ->capture_default_str();
  a->add_option("--policies", f->policies, "policies to compare, comma-separated (see README, Policies)")
      ->capture_default_str();
  a->add_option("--engine", f->engines,
                "module (torch::nn + remat::checkpoint) and/or ops (remat::GPT); default: both for seed, ops otherwise")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  a->add_option("--steps", f->steps, "timed steps per policy")
      ->transform(decimal_integer<int>())
      ->capture_default_str();
  a->add_option("--warmup", f->warmup, "untimed steps before them")
      ->transform(decimal_integer<int>())
      ->capture_default_str();
  a->add_option("--threads", f->threads, "ATen/BLAS threads, e.g. 1/2 (default: 1/cores, measured fastest)");
  a->add_option("--seed", f->seed, "weights and data")->capture_default_str();
  a->add_flag("--verify", f->verify, "ops engine: check every recomputed tensor bitwise against the forward's");
  a->add_flag("--profile", f->profile, "ops engine: print per-op forward, recompute and backward times");
  a->add_flag("--frontier", f->frontier, "ops engine: draw the planner's predicted frontier on the chart");
  a->add_option("--json", f->json, "write results as JSON");
  a->add_option("--csv", f->csv, "write results as CSV");
  a->add_option("--markdown", f->markdown, "write the table as Markdown");
  a->add_option("--chart", f->charts, "write the trade-off chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  return {a, [f] { check(*f); }, [f] { return run(*f); }};
}

}  // namespace remat::cli
