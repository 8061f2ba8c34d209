// remat: the command-line tool. Parses flags, prints the configuration, calls the library, and maps
// errors to exit codes: 0 success, 1 a run that failed, 2 bad input.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "remat/bench.h"
#include "remat/block.h"
#include "remat/config.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/planner.h"
#include "remat/profile.h"
#include "remat/policy.h"
#include "remat/report.h"
#include "remat/runtime.h"
#include "remat/train.h"

namespace {

// Named shapes for `remat plan --model`. LLaMA shapes are planned on the gpt2 block kind: remat has
// no llama block yet (RMSNorm, SwiGLU's third matrix, grouped-query attention); see README.
struct NamedShape {
  const char* name;
  int64_t layers, dim, heads, ffn, seq, vocab;
  const char* dtype;
  double dropout;
};
constexpr NamedShape kShapes[] = {
    {"gpt2-small", 12, 768, 12, 0, 1024, 50257, "fp32", 0.1},
    {"gpt3-175b", 96, 12288, 96, 0, 2048, 50257, "fp16", 0.1},
    {"llama-7b", 32, 4096, 32, 11008, 4096, 32000, "bf16", 0.0},
    {"llama-70b", 80, 8192, 64, 28672, 4096, 32000, "bf16", 0.0},
};

// Flags shared by every subcommand that builds a model.
struct ShapeFlags {
  std::string arch = "seed";
  std::string dtype = "fp32";
  std::string attention = "math";
  std::string model;
  remat::ModelConfig cfg;
  CLI::App* app = nullptr;

  void add_planning(CLI::App* a) {
    a->add_option("--model", model, "a named shape: gpt2-small, gpt3-175b, llama-7b, llama-70b (flags override it)");
    a->add_option("--vocab", cfg.vocab, "gpt2: vocabulary size")->capture_default_str();
    a->add_option("--dtype", dtype, "fp32, bf16 or fp16 (the engine runs fp32; plan takes all)")->capture_default_str();
    a->add_option("--attention", attention, "math (T x T scores) or flash (fused; planning only)")->capture_default_str();
  }

  void add(CLI::App* a) {
    app = a;
    app->add_option("--arch", arch, "block kind: seed (the seed note's block) or gpt2")->capture_default_str();
    app->add_option("--layers", cfg.layers, "transformer blocks")->capture_default_str();
    app->add_option("--dim", cfg.dim, "model width")->capture_default_str();
    app->add_option("--heads", cfg.heads, "attention heads (must divide --dim)")->capture_default_str();
    app->add_option("--batch", cfg.batch, "sequences per step")->capture_default_str();
    app->add_option("--seq", cfg.seq, "tokens per sequence")->capture_default_str();
    app->add_option("--ffn", cfg.ffn, "MLP hidden width; 0 = 4 * dim")->capture_default_str();
    app->add_option("--dropout", cfg.dropout, "gpt2: dropout probability")->capture_default_str();
    app->add_option("--attn-block", cfg.attn_block, "causal attention: query rows per stored block")->capture_default_str();
  }

  remat::ModelConfig resolve() {
    if (!model.empty()) {
      const NamedShape* shape = nullptr;
      for (const NamedShape& s : kShapes)
        if (model == s.name) shape = &s;
      if (shape == nullptr)
        remat::fail("unknown --model '{}'; allowed: gpt2-small, gpt3-175b, llama-7b, llama-70b", model);
      auto unset = [&](const char* flag) { return app->count(flag) == 0; };
      if (unset("--arch")) arch = "gpt2";
      if (unset("--layers")) cfg.layers = shape->layers;
      if (unset("--dim")) cfg.dim = shape->dim;
      if (unset("--heads")) cfg.heads = shape->heads;
      if (unset("--ffn")) cfg.ffn = shape->ffn;
      if (unset("--seq")) cfg.seq = shape->seq;
      if (unset("--vocab")) cfg.vocab = shape->vocab;
      if (unset("--dtype")) dtype = shape->dtype;
      if (unset("--dropout")) cfg.dropout = shape->dropout;
      if (unset("--batch")) cfg.batch = 1;
    }
    cfg.arch = remat::parse_arch(arch);
    cfg.dtype = remat::parse_dtype(dtype);
    cfg.attention = remat::parse_attention(attention);
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
  bool verify = false, profile = false, frontier = false;
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
  o.frontier = f.frontier;
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

struct PlanFlags {
  std::string budget, pins, costs = "auto", threads, json;
};

std::string mib(int64_t b) { return remat::bytes_str(b); }

int run_plan(ShapeFlags& shape, const PlanFlags& f) {
  const remat::ModelConfig cfg = shape.resolve();
  if (f.budget.empty()) remat::fail("--budget is required, e.g. --budget 300MiB, --budget 2GB or --budget 60%");
  const remat::Budget budget = remat::parse_budget(f.budget);
  if (!f.json.empty()) remat::check_writable(f.json);
  const remat::ModelSpec spec = remat::make_model(cfg);
  const std::string policy_text = "budget:" + f.budget + (f.pins.empty() ? "" : "+" + f.pins);
  const remat::Policy policy = remat::Policy::parse(policy_text);
  const remat::LayerPolicy pins = policy.pins(spec.block);
  const remat::ThreadConfig threads = f.threads.empty() ? remat::default_threads() : remat::parse_threads(f.threads);

  // Costs: measured where a layer runs here in seconds (fp32, math attention), estimated otherwise.
  const bool runnable = cfg.dtype == remat::DType::F32 && cfg.attention == remat::AttentionImpl::Math;
  if (f.costs != "auto" && f.costs != "measured" && f.costs != "estimated")
    remat::fail("unknown --costs '{}'; allowed: auto, measured, estimated", f.costs);
  if (f.costs == "measured" && !runnable)
    remat::fail("--costs measured needs --dtype fp32 and --attention math (what the engine runs here)");
  remat::apply_threads(threads);
  const remat::MachineRates rates = remat::measure_rates();
  remat::CostModel costs = remat::estimate_costs(spec, rates);
  const double layer_ms = costs.none_step_ms(1) - costs.other_ms;
  if (f.costs == "measured" || (f.costs == "auto" && runnable && layer_ms < 5000)) {
    fmt::print(stderr, "profiling one layer ({})...\n", remat::describe(cfg));
    costs = remat::measure_costs(cfg, threads);
  }

  const auto t0 = std::chrono::steady_clock::now();
  const remat::Plan p = remat::make_plan(cfg, budget, costs, pins);
  const double planned_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("remat plan: {} | budget {}\n", remat::describe(cfg), remat::to_string(budget));
  fmt::print("  costs: {}\n  planned in {:.0f} ms\n\n", costs.source, planned_ms);
  if (!p.fits)
    remat::fail("budget {} ({}) cannot be met: the smallest peak any policy reaches is {} (weights {}, gradients "
                "and activations {}, optimizer {}, data {})",
                f.budget, mib(p.budget), mib(p.min_budget), mib(p.memory.params), mib(p.memory.peak),
                mib(p.memory.optimizer), mib(p.memory.data));

  remat::Table mem;
  mem.header = {"predicted", "none", "plan"};
  mem.numeric = {false, true, true};
  const remat::StepMemory &n = p.none_memory, &m = p.memory;
  mem.rows = {{"weights", mib(n.params), mib(m.params)},
              {"optimizer state", mib(n.optimizer), mib(m.optimizer)},
              {"data", mib(n.data), mib(m.data)},
              {"saved after forward", mib(n.saved), mib(m.saved)},
              {"peak above that (activations, gradients)", mib(n.peak), mib(m.peak)},
              {"total peak", mib(n.total_peak()), mib(m.total_peak())},
              {"budget", "", mib(p.budget)},
              {"step time", fmt::format("{:.1f} ms", p.none_step_ms),
               fmt::format("{:.1f} ms ({:+.1f}%)", p.step_ms, 100.0 * (p.step_ms / p.none_step_ms - 1.0))}};
  fmt::print("{}\n  peak at: {}\n\n  policy: {}\n\n", mem.markdown(), m.peak_at, p.policy_text);

  remat::Table front;
  front.header = {"block option (one layer)", "saved", "recompute ms", "forward extra", "backward extra"};
  front.numeric = {false, true, true, true, true};
  for (const remat::BlockOption& o : p.frontier)
    front.rows.push_back({o.text, mib(o.saved), fmt::format("{:.2f}", o.recompute_ms), mib(o.forward_extra),
                          mib(o.backward_extra)});
  fmt::print("block frontier (no option beats another on saved bytes, time and working sets):\n\n{}", front.markdown());

  if (!f.json.empty()) {
    nlohmann::json j;
    auto memory = [](const remat::StepMemory& s) {
      return nlohmann::json{{"params", s.params},       {"grads", s.grads},   {"optimizer", s.optimizer},
                            {"data", s.data},           {"saved", s.saved},   {"peak", s.peak},
                            {"total_peak", s.total_peak()}, {"peak_at", s.peak_at}};
    };
    j["config"] = {{"describe", remat::describe(cfg)}, {"arch", remat::to_string(cfg.arch)}, {"layers", cfg.layers},
                   {"dim", cfg.dim}, {"heads", cfg.heads}, {"batch", cfg.batch}, {"seq", cfg.seq},
                   {"ffn", cfg.hidden()}, {"vocab", cfg.vocab}, {"dtype", remat::to_string(cfg.dtype)},
                   {"dropout", cfg.dropout}, {"attention", remat::to_string(cfg.attention)}};
    j["budget"] = p.budget;
    j["fits"] = p.fits;
    j["policy"] = p.policy_text;
    j["memory"] = memory(m);
    j["none_memory"] = memory(n);
    j["step_ms"] = p.step_ms;
    j["none_step_ms"] = p.none_step_ms;
    j["costs"] = costs.source;
    j["frontier"] = nlohmann::json::array();
    for (const remat::BlockOption& o : p.frontier)
      j["frontier"].push_back({{"option", o.text}, {"saved_bytes", o.saved}, {"recompute_ms", o.recompute_ms},
                               {"forward_extra", o.forward_extra}, {"backward_extra", o.backward_extra}});
    remat::write_file_atomic(f.json, j.dump(2) + "\n");
    fmt::print("\nwrote {}\n", f.json);
  }
  return 0;
}

struct TrainFlags {
  remat::TrainOptions o;
  std::string resume, csv, threads;
  std::vector<std::string> charts;
};

std::string duration(double s) {
  const int64_t t = static_cast<int64_t>(s);
  return t >= 60 ? fmt::format("{}m{:02d}s", t / 60, static_cast<int>(t % 60)) : fmt::format("{}s", t);
}

int run_train(ShapeFlags& shape, TrainFlags& f, CLI::App* app) {
  if (app->count("--arch") && shape.arch != "gpt2")
    remat::fail("remat train trains gpt2 blocks on bytes; --arch {} is for remat bench", shape.arch);
  shape.arch = "gpt2";
  shape.cfg.vocab = 256;
  f.o.model = shape.resolve();
  if (!f.threads.empty()) f.o.threads = remat::parse_threads(f.threads);
  for (const std::string& p : {f.csv})
    if (!p.empty()) remat::check_writable(p);
  for (const std::string& c : f.charts) {
    remat::check_chart_path(c);
    remat::check_writable(c);
  }
  std::vector<std::string> given;
  for (const CLI::Option* opt : app->get_options())
    if (opt->count() > 0 && !opt->get_lnames().empty()) given.push_back(opt->get_lnames()[0]);

  const bool tty = isatty(fileno(stderr));
  int64_t last_line = 0;
  f.o.progress = [&](const remat::TrainProgress& p) {
    const std::string val = std::isnan(p.val_loss) ? "-" : fmt::format("{:.3f}", p.val_loss);
    const int width = 24, done = static_cast<int>(width * p.step / p.steps);
    const std::string line = fmt::format("step {}/{} [{}{}] loss {:.3f} | val {} | {:.1f}k tok/s | peak {} | ETA {}", p.step,
                                         p.steps, std::string(done, '='), std::string(width - done, ' '), p.loss, val,
                                         p.tokens_per_s / 1000, remat::bytes_str(p.peak_bytes), duration(p.eta_s));
    if (tty) {
      fmt::print(stderr, "\r\033[K{}", line);
    } else if (p.step == p.steps || p.step - last_line >= std::max<int64_t>(1, p.steps / 20)) {
      fmt::print(stderr, "{}\n", line);
      last_line = p.step;
    }
  };
  fmt::print("remat train: {} | policy {} | {} steps x {} tokens | seed {}\n", remat::describe(f.o.model), f.o.policy,
             f.o.steps, f.o.model.batch * f.o.model.seq * f.o.accum, f.o.seed);
  if (!f.resume.empty()) fmt::print("  resuming the run saved in {}\n", f.resume);
  std::fflush(stdout);
  const remat::TrainResult r = remat::train(f.o, f.resume, given);
  end_progress();
  std::vector<double> speed;
  int64_t peak = 0;
  for (const remat::TrainRecord& rec : r.log) {
    speed.push_back(rec.tokens_per_s);
    peak = std::max(peak, rec.peak_bytes);
  }
  std::sort(speed.begin(), speed.end());
  fmt::print("  policy as run: {}\n", r.policy_text);
  fmt::print("  final validation loss {:.4f} nats/byte | {:.1f}k tokens/s (median) | peak {} (predicted {})\n",
             r.final_val_loss, speed.empty() ? 0.0 : speed[speed.size() / 2] / 1000, remat::bytes_str(peak),
             remat::bytes_str(r.predicted_peak));
  fmt::print("  weights digest: {}\n", r.weights_digest);
  if (!f.o.save_dir.empty()) fmt::print("  train state: {}/state.bin\n", f.o.save_dir);
  if (!f.csv.empty()) {
    remat::write_file_atomic(f.csv, r.csv());
    fmt::print("wrote {}\n", f.csv);
  }
  for (const std::string& c : f.charts) {
    r.write_chart(c, "remat train: " + remat::describe(f.o.model) + ", policy " + f.o.policy);
    fmt::print("wrote {}\n", c);
  }
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
  bench->add_flag("--frontier", bf.frontier, "ops engine: draw the planner's predicted frontier on the chart");
  bench->add_option("--json", bf.json, "write results as JSON");
  bench->add_option("--csv", bf.csv, "write results as CSV");
  bench->add_option("--markdown", bf.markdown, "write the table as Markdown");
  bench->add_option("--chart", bf.charts, "write the trade-off chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  CLI::App* plan = app.add_subcommand("plan", "find the fastest policy whose true peak memory fits a budget");
  ShapeFlags plan_shape;
  plan_shape.arch = "gpt2";
  plan_shape.add(plan);
  plan_shape.add_planning(plan);
  PlanFlags pf;
  plan->add_option("--budget", pf.budget, "total peak memory: 300MiB, 2GB, 1.5GiB, or 60% (of none's peak)");
  plan->add_option("--pins", pf.pins, "choices the plan must keep, e.g. keep:qkv+drop:fc");
  plan->add_option("--costs", pf.costs, "auto (measure when a layer runs here quickly), measured, estimated")
      ->capture_default_str();
  plan->add_option("--threads", pf.threads, "ATen/BLAS threads for measuring, e.g. 1/2");
  plan->add_option("--json", pf.json, "write the plan as JSON");

  CLI::App* train = app.add_subcommand("train", "train a GPT on text with any recompute policy");
  ShapeFlags train_shape;
  train_shape.cfg = remat::default_train_model();
  train_shape.arch = "gpt2";
  train_shape.add(train);
  TrainFlags tf;
  remat::TrainOptions& to = tf.o;
  train->add_option("--data", to.data, "a text file (default: Debian's English fortunes)");
  train->add_option("--policy", to.policy, "recompute policy, e.g. attn+mlp-act or budget:300MiB")->capture_default_str();
  train->add_option("--steps", to.steps, "optimizer steps")->capture_default_str();
  train->add_option("--accum", to.accum, "micro-batches per step (gradient accumulation)")->capture_default_str();
  train->add_option("--lr", to.lr, "peak learning rate")->capture_default_str();
  train->add_option("--min-lr", to.min_lr, "cosine floor")->capture_default_str();
  train->add_option("--warmup", to.warmup, "linear warm-up steps")->capture_default_str();
  train->add_option("--weight-decay", to.weight_decay, "AdamW decay on weight matrices")->capture_default_str();
  train->add_option("--clip", to.clip, "global gradient-norm clip; 0 = off")->capture_default_str();
  train->add_option("--eval-every", to.eval_every, "validation every N steps; 0 = at the end")->capture_default_str();
  train->add_option("--eval-batches", to.eval_batches, "batches per validation")->capture_default_str();
  train->add_option("--seed", to.seed, "weights, batches, dropout")->capture_default_str();
  train->add_option("--save", to.save_dir, "write the train state to this folder");
  train->add_option("--save-every", to.save_every, "steps between saves; 0 = at the end")->capture_default_str();
  train->add_option("--resume", tf.resume, "continue the run saved in this folder");
  train->add_option("--threads", tf.threads, "ATen/BLAS threads, e.g. 1/2");
  train->add_option("--csv", tf.csv, "write the metrics as CSV");
  train->add_option("--chart", tf.charts, "write the loss chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  CLI::App* sample = app.add_subcommand("sample", "generate text with a trained model");
  std::string load;
  remat::SampleOptions so;
  sample->add_option("--load", load, "the folder remat train --save wrote")->required();
  sample->add_option("--prompt", so.prompt, "text to continue");
  sample->add_option("--tokens", so.tokens, "bytes to generate")->capture_default_str();
  sample->add_option("--temperature", so.temperature, "> 0; lower is more conservative")->capture_default_str();
  sample->add_option("--top-k", so.top_k, "sample from the k likeliest bytes; 0 = all")->capture_default_str();
  sample->add_option("--seed", so.seed, "sampling seed")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (*bench) return run_bench(bench_shape, bf);
    if (*plan) return run_plan(plan_shape, pf);
    if (*train) return run_train(train_shape, tf, train);
    if (*sample) {
      fmt::print("{}\n", remat::sample(load, so));
      return 0;
    }
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
