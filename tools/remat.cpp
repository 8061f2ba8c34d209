// remat: the command-line tool. Parses flags, prints the configuration, calls the library, and maps
// errors to exit codes: 0 success, 1 a run that failed, 2 bad input.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "remat/bench.h"
#include "remat/block.h"
#include "remat/config.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/policy.h"
#include "remat/report.h"
#include "remat/runtime.h"

namespace {

// Flags shared by every subcommand that builds a model.
struct ShapeFlags {
  std::string arch = "seed";
  std::string dtype = "fp32";
  remat::ModelConfig cfg;

  void add(CLI::App* app) {
    app->add_option("--arch", arch, "block kind: seed (the seed note's block) or gpt2")->capture_default_str();
    app->add_option("--layers", cfg.layers, "transformer blocks")->capture_default_str();
    app->add_option("--dim", cfg.dim, "model width")->capture_default_str();
    app->add_option("--heads", cfg.heads, "attention heads (must divide --dim)")->capture_default_str();
    app->add_option("--batch", cfg.batch, "sequences per step")->capture_default_str();
    app->add_option("--seq", cfg.seq, "tokens per sequence")->capture_default_str();
    app->add_option("--ffn", cfg.ffn, "MLP hidden width; 0 = 4 * dim")->capture_default_str();
    app->add_option("--dropout", cfg.dropout, "gpt2: dropout probability")->capture_default_str();
  }

  remat::ModelConfig resolve() {
    cfg.arch = remat::parse_arch(arch);
    cfg.dtype = remat::parse_dtype(dtype);
    remat::validate(cfg);
    return cfg;
  }
};

// Progress on stderr: one rewritten line on a terminal, plain lines otherwise.
void progress(const std::string& line) {
  static const bool tty = isatty(fileno(stderr));
  if (tty) fmt::print(stderr, "\r\033[K{}", line);
  else fmt::print(stderr, "{}\n", line);
  std::fflush(stderr);
}

void end_progress() {
  if (isatty(fileno(stderr))) fmt::print(stderr, "\r\033[K");
}

struct BenchFlags {
  std::string policies = "none,full,every:2,every:3";
  std::vector<std::string> engines;  // empty: remat::default_engines(arch)
  int steps = 5, warmup = 2;
  std::string threads, json, csv, markdown;
  std::vector<std::string> charts;
  uint64_t seed = 1234;
  bool verify = false, profile = false;
};

int run_bench(ShapeFlags& shape, const BenchFlags& f) {
  const std::string &policies = f.policies, &threads = f.threads, &json = f.json, &csv = f.csv,
                    &markdown = f.markdown;
  const std::vector<std::string>& charts = f.charts;
  const int steps = f.steps, warmup = f.warmup;
  const uint64_t seed = f.seed;
  remat::BenchOptions o;
  o.model = shape.resolve();
  o.policies = remat::split_policy_list(policies);
  o.engines = remat::default_engines(o.model.arch);
  if (!f.engines.empty()) o.engines.clear();
  for (const std::string& e : f.engines) o.engines.push_back(remat::parse_engine(e));
  o.verify = f.verify;
  o.profile = f.profile;
  o.steps = steps;
  o.warmup = warmup;
  o.seed = seed;
  if (!threads.empty()) o.threads = remat::parse_threads(threads);
  for (const std::string& p : {json, csv, markdown})
    if (!p.empty()) remat::check_writable(p);
  for (const std::string& c : charts) {
    remat::check_chart_path(c);
    remat::check_writable(c);
  }
  o.progress = progress;

  std::string engine_names;
  for (remat::Engine e : o.engines) engine_names += (engine_names.empty() ? "" : ",") + std::string(remat::to_string(e));
  fmt::print("remat bench: {}\n", remat::describe(o.model));
  fmt::print("  policies {} | engine {} | {} warm-up + {} timed steps | threads ATen/BLAS {} | seed {}\n",
             fmt::join(o.policies, " "), engine_names, o.warmup, o.steps, remat::to_string(o.threads), o.seed);
  std::fflush(stdout);

  const remat::BenchResult r = remat::run_bench(o);
  end_progress();
  fmt::print("  BLAS: {}\n  matmul {:.1f} GFLOP/s; model FLOPs per step {:.2f} G; floor {:.1f} ms\n\n", r.blas,
             r.matmul_gflops, static_cast<double>(r.flops_per_step) / 1e9, r.floor_ms);
  const std::string table = r.markdown();
  fmt::print("{}", table);
  if (o.profile) fmt::print("{}", r.profile_markdown());
  if (!json.empty()) remat::write_file_atomic(json, r.json());
  if (!csv.empty()) remat::write_file_atomic(csv, r.csv());
  if (!markdown.empty()) remat::write_file_atomic(markdown, table);
  for (const std::string& c : charts) r.write_chart(c);
  for (const std::string& p : {json, csv, markdown})
    if (!p.empty()) fmt::print("wrote {}\n", p);
  for (const std::string& c : charts) fmt::print("wrote {}\n", c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  remat::MemoryTracker::install();  // first: every tensor after this is counted

  CLI::App app{"remat: selective activation recomputation for transformer training on LibTorch"};
  app.require_subcommand(1);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("remat: error: {} (see remat --help)\n", e.what());
  });

  CLI::App* bench = app.add_subcommand("bench", "measure step time and memory of recompute policies");
  ShapeFlags bench_shape;
  bench_shape.add(bench);
  BenchFlags bf;
  bench->add_option("--policies", bf.policies, "policies to compare, comma-separated (see README, Policies)")
      ->capture_default_str();
  bench->add_option("--engine", bf.engines,
                    "module (torch::nn + remat::checkpoint) and/or ops (remat::GPT); default: both for seed, ops for gpt2")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  bench->add_option("--steps", bf.steps, "timed steps per policy")->capture_default_str();
  bench->add_option("--warmup", bf.warmup, "untimed steps before them")->capture_default_str();
  bench->add_option("--threads", bf.threads, "ATen/BLAS threads, e.g. 1/2 (default: 1/cores, measured fastest)");
  bench->add_option("--seed", bf.seed, "weights and data")->capture_default_str();
  bench->add_flag("--verify", bf.verify, "ops engine: check every recomputed tensor bitwise against the forward's");
  bench->add_flag("--profile", bf.profile, "ops engine: print per-op forward, recompute and backward times");
  bench->add_option("--json", bf.json, "write results as JSON");
  bench->add_option("--csv", bf.csv, "write results as CSV");
  bench->add_option("--markdown", bf.markdown, "write the table as Markdown");
  bench->add_option("--chart", bf.charts, "write the trade-off chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (*bench) return run_bench(bench_shape, bf);
  } catch (const remat::Error& e) {
    end_progress();
    fmt::print(stderr, "remat: error: {}\n", e.what());
    return e.kind() == remat::Error::Kind::Usage ? 2 : 1;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    end_progress();
    fmt::print(stderr, "remat: error: {}\n", what);
    return 1;
  }
  return 0;
}
