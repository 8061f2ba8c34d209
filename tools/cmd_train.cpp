// remat train and remat sample: a GPT trained on text under any recompute policy, and text from it.
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "app/report.h"
#include "app/train.h"
#include "cli.h"
#include "remat/units.h"

namespace remat::cli {

namespace {

struct TrainFlags {
  ShapeFlags shape;
  TrainOptions o;
  std::string resume, csv, threads;
  std::vector<std::string> charts;
};

int run(TrainFlags& f, CLI::App* app) {
  f.shape.cfg.vocab = 256;
  f.o.model = f.shape.resolve();
  if (!f.threads.empty()) f.o.threads = parse_threads(f.threads);
  if (!f.csv.empty()) check_writable(f.csv);
  for (const std::string& c : f.charts) {
    check_chart_path(c);
    check_writable(c);
  }
  std::vector<std::string> given;
  for (const CLI::Option* opt : app->get_options())
    if (opt->count() > 0 && !opt->get_lnames().empty()) given.push_back(opt->get_lnames()[0]);

  const bool tty = isatty(fileno(stderr));
  int64_t last_line = 0;
  f.o.progress = [&](const TrainProgress& p) {
    const std::string val = std::isnan(p.val_loss) ? "-" : fmt::format("{:.3f}", p.val_loss);
    const int width = 24, done = static_cast<int>(width * p.step / p.steps);
    const std::string line = fmt::format("step {}/{} [{}{}] loss {:.3f} | val {} | {:.1f}k tok/s | peak {} | ETA {}",
                                         p.step, p.steps, std::string(done, '='), std::string(width - done, ' '),
                                         p.loss, val, p.tokens_per_s / 1000, bytes_str(p.peak_bytes), duration(p.eta_s));
    if (tty) {
      fmt::print(stderr, "\r\033[K{}", line);
    } else if (p.step == p.steps || p.step - last_line >= std::max<int64_t>(1, p.steps / 20)) {
      fmt::print(stderr, "{}\n", line);
      last_line = p.step;
    }
  };
  fmt::print("remat train: {} | policy {} | {} steps x {} tokens | seed {}\n", describe(f.o.model), f.o.policy,
             f.o.steps, f.o.model.batch * f.o.model.seq * f.o.accum, f.o.seed);
  if (!f.resume.empty()) fmt::print("  resuming the run saved in {}\n", f.resume);
  std::fflush(stdout);
  const TrainResult r = train(f.o, f.resume, given);
  end_progress();
  std::vector<double> speed;
  int64_t peak = 0;
  for (const TrainRecord& rec : r.log) {
    speed.push_back(rec.tokens_per_s);
    peak = std::max(peak, rec.peak_bytes);
  }
  std::sort(speed.begin(), speed.end());
  fmt::print("  policy as run: {}\n", r.policy_text);
  fmt::print("  final validation loss {:.4f} nats/byte | {:.1f}k tokens/s (median) | peak {} (predicted {})\n",
             r.final_val_loss, speed.empty() ? 0.0 : speed[speed.size() / 2] / 1000, bytes_str(peak),
             bytes_str(r.predicted_peak));
  fmt::print("  weights digest: {}\n", r.weights_digest);
  if (!f.o.save_dir.empty()) fmt::print("  train state: {}/state.bin\n", f.o.save_dir);
  if (!f.csv.empty()) {
    write_file_atomic(f.csv, r.csv());
    fmt::print("wrote {}\n", f.csv);
  }
  for (const std::string& c : f.charts) {
    r.write_chart(c, "remat train: " + describe(f.o.model) + ", policy " + f.o.policy);
    fmt::print("wrote {}\n", c);
  }
  return 0;
}

struct SampleFlags {
  std::string load;
  SampleOptions o;
};

}  // namespace

Command add_train(CLI::App& parent) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* a = parent.add_subcommand("train", "train a GPT on text with any recompute policy");
  f->shape.cfg = default_train_model();
  f->shape.add(a);
  TrainOptions& o = f->o;
  a->add_option("--data", o.data, "a text file (default: Debian's English fortunes)");
  a->add_option("--policy", o.policy, "recompute policy, e.g. attn+mlp-act or budget:300MiB")->capture_default_str();
  a->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  a->add_option("--accum", o.accum, "micro-batches per step (gradient accumulation)")->capture_default_str();
  a->add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  a->add_option("--min-lr", o.min_lr, "cosine floor")->capture_default_str();
  a->add_option("--warmup", o.warmup, "linear warm-up steps")->capture_default_str();
  a->add_option("--weight-decay", o.weight_decay, "AdamW decay on weight matrices")->capture_default_str();
  a->add_option("--clip", o.clip, "global gradient-norm clip; 0 = off")->capture_default_str();
  a->add_option("--eval-every", o.eval_every, "validation every N steps; 0 = at the end")->capture_default_str();
  a->add_option("--eval-batches", o.eval_batches, "batches per validation")->capture_default_str();
  a->add_option("--seed", o.seed, "weights, batches, dropout")->capture_default_str();
  a->add_option("--save", o.save_dir, "write the train state to this folder");
  a->add_option("--save-every", o.save_every, "steps between saves; 0 = at the end")->capture_default_str();
  a->add_option("--resume", f->resume, "continue the run saved in this folder");
  a->add_option("--threads", f->threads, "ATen/BLAS threads, e.g. 1/2");
  a->add_option("--csv", f->csv, "write the metrics as CSV");
  a->add_option("--chart", f->charts, "write the loss chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  return {a, [f, a] { return run(*f, a); }};
}

Command add_sample(CLI::App& parent) {
  auto f = std::make_shared<SampleFlags>();
  CLI::App* a = parent.add_subcommand("sample", "generate text with a trained model");
  a->add_option("--load", f->load, "the folder remat train --save wrote")->required();
  a->add_option("--prompt", f->o.prompt, "text to continue");
  a->add_option("--tokens", f->o.tokens, "bytes to generate")->capture_default_str();
  a->add_option("--temperature", f->o.temperature, "> 0; lower is more conservative")->capture_default_str();
  a->add_option("--top-k", f->o.top_k, "sample from the k likeliest bytes; 0 = all")->capture_default_str();
  a->add_option("--seed", f->o.seed, "sampling seed")->capture_default_str();
  return {a, [f] {
            fmt::print("{}\n", sample(f->load, f->o));
            return 0;
          }};
}

}  // namespace remat::cli
