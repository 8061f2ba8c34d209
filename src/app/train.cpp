#include "app/train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "app/corpus.h"
#include "app/report.h"
#include "app/train_state.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "remat/policy.h"
#include "remat/resolve.h"
#include "remat/units.h"

namespace remat {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Options in the train state

Json options_json(const TrainOptions& o, const std::string& corpus_id) {
  const ModelConfig& m = o.model;
  return {{"arch", m.arch},     {"kv-heads", m.kv_heads}, {"attention", std::string(to_string(m.attention))},
          {"layers", m.layers}, {"dim", m.dim},   {"heads", m.heads},
          {"batch", m.batch},   {"seq", m.seq},   {"ffn", m.ffn},
          {"dropout", m.dropout}, {"attn-block", m.attn_block},
          {"steps", o.steps},   {"accum", o.accum}, {"lr", o.lr},
          {"min-lr", o.min_lr}, {"warmup", o.warmup}, {"weight-decay", o.weight_decay},
          {"beta1", o.beta1},   {"beta2", o.beta2}, {"clip", o.clip},
          {"val-fraction", o.val_fraction}, {"seed", o.seed}, {"data", corpus_id},
          {"policy", o.policy}, {"eval-every", o.eval_every}, {"eval-batches", o.eval_batches},
          {"save-every", o.save_every}};
}

// Options that may change when resuming: they affect memory, time or bookkeeping, not the weights.
bool may_change(const std::string& key) {
  return key == "policy" || key == "eval-every" || key == "eval-batches" || key == "save-every";
}

}  // namespace

TrainOptions options_from(const Json& j, TrainOptions o) {
  ModelConfig& m = o.model;
  m.arch = j.contains("arch") ? j.at("arch").get<std::string>() : "gpt2";  // states before 0.3 were gpt2
  if (j.contains("attention")) m.attention = parse_attention(j.at("attention").get<std::string>());
  if (j.contains("kv-heads")) m.kv_heads = j.at("kv-heads");
  m.layers = j.at("layers"); m.dim = j.at("dim"); m.heads = j.at("heads"); m.batch = j.at("batch");
  m.seq = j.at("seq"); m.ffn = j.at("ffn"); m.dropout = j.at("dropout"); m.attn_block = j.at("attn-block");
  o.steps = j.at("steps"); o.accum = j.at("accum"); o.lr = j.at("lr"); o.min_lr = j.at("min-lr");
  o.warmup = j.at("warmup"); o.weight_decay = j.at("weight-decay"); o.beta1 = j.at("beta1"); o.beta2 = j.at("beta2");
  o.clip = j.at("clip"); o.val_fraction = j.at("val-fraction"); o.seed = j.at("seed");
  return o;
}

namespace {

void check_options(const TrainOptions& o) {
  validate(o.model);
  if (o.steps < 1) fail("--steps must be >= 1, got {}", o.steps);
  if (o.accum < 1) fail("--accum must be >= 1, got {}", o.accum);
  if (!(o.lr > 0) || !(o.min_lr >= 0) || o.min_lr > o.lr) fail("--lr {} and --min-lr {} need 0 <= min-lr <= lr, lr > 0", o.lr, o.min_lr);
  if (o.warmup < 0) fail("--warmup must be >= 0, got {}", o.warmup);
  if (o.weight_decay < 0) fail("--weight-decay must be >= 0, got {}", o.weight_decay);
  if (o.clip < 0) fail("--clip must be >= 0 (0 = off), got {}", o.clip);
  if (o.eval_every < 0 || o.eval_batches < 1) fail("--eval-every must be >= 0 and --eval-batches >= 1");
  if (o.save_every < 0) fail("--save-every must be >= 0, got {}", o.save_every);
  if (!(o.val_fraction > 0 && o.val_fraction < 0.5)) fail("--val-fraction must be in (0, 0.5), got {}", o.val_fraction);
}

double lr_at(const TrainOptions& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  const double t = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * t));
}

int64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The run

struct Run {
  TrainOptions o;
  Corpus corpus;
  GPT model{nullptr};
  std::unique_ptr<Adam> decayed, plain;  // AdamW on matrices; no decay on biases, norms, positions
  int64_t step = 0;
  ResolvedPolicy policy;
  std::string policy_text;
  int64_t predicted_peak = 0;
};

std::vector<std::pair<std::string, at::Tensor>> named_params(GPT& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

// AdamW's decay where the parameter's role says so (matrices), plain Adam elsewhere.
void make_optimizers(Run& r) {
  std::vector<at::Tensor> decayed, plain;
  const std::vector<at::Tensor> params = r.model->parameters();
  const std::vector<bool> decays = r.model->decays();
  for (size_t i = 0; i < params.size(); ++i) (decays[i] ? decayed : plain).push_back(params[i]);
  AdamOptions a{r.o.lr, r.o.beta1, r.o.beta2, 1e-8, r.o.weight_decay, /*decoupled=*/true};
  r.decayed = std::make_unique<Adam>(decayed, a);
  a.weight_decay = 0;
  r.plain = std::make_unique<Adam>(plain, a);
}

double val_loss(Run& r) {
  const ModelConfig& m = r.o.model;
  const int64_t windows_n = r.o.eval_batches * m.batch;
  const int64_t last = static_cast<int64_t>(r.corpus.val.size()) - m.seq - 1;
  at::NoGradGuard no_grad;
  r.model->eval();
  double sum = 0;
  for (int64_t b = 0; b < r.o.eval_batches; ++b) {
    std::vector<int64_t> starts(m.batch);
    for (int64_t i = 0; i < m.batch; ++i) starts[i] = last * (b * m.batch + i) / std::max<int64_t>(1, windows_n - 1);
    auto [x, y] = windows(r.corpus.val, starts, m.seq);
    sum += r.model->forward(x, y).item<double>();
  }
  r.model->train();
  return sum / static_cast<double>(r.o.eval_batches);
}

TrainState snapshot(Run& r) {
  TrainState s;
  s.header["format"] = "remat train state";
  s.header["options"] = options_json(r.o, r.corpus.id);
  s.header["step"] = r.step;
  s.header["policy"] = r.policy_text;
  std::vector<at::Tensor> weights;
  for (const auto& [name, p] : named_params(r.model)) {
    s.tensors.emplace_back("param:" + name, p);
    weights.push_back(p);
  }
  s.header["weights_digest"] = digest(weights);
  for (Adam* a : {r.decayed.get(), r.plain.get()}) {
    const std::string which = a == r.decayed.get() ? "decayed" : "plain";
    for (size_t i = 0; i < a->params().size(); ++i) {
      s.tensors.emplace_back(fmt::format("adam.{}.m.{}", which, i), a->exp_avg()[i]);
      s.tensors.emplace_back(fmt::format("adam.{}.v.{}", which, i), a->exp_avg_sq()[i]);
    }
    s.header["adam_steps_" + which] = a->steps();
  }
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.tensors.emplace_back("rng", gen.get_state());
  }
  return s;
}

void restore(Run& r, const TrainState& s, const std::string& dir) {
  at::NoGradGuard no_grad;
  for (auto& [name, p] : named_params(r.model)) {
    const at::Tensor& t = s.tensor("param:" + name);
    if (t.sizes() != p.sizes())
      fail("train state in '{}': '{}' is {}, the model's is {}", dir, name, shape_str(t.sizes().vec()),
           shape_str(p.sizes().vec()));
    p.copy_(t);
  }
  for (Adam* a : {r.decayed.get(), r.plain.get()}) {
    const std::string which = a == r.decayed.get() ? "decayed" : "plain";
    for (size_t i = 0; i < a->params().size(); ++i) {
      a->exp_avg()[i].copy_(s.tensor(fmt::format("adam.{}.m.{}", which, i)));
      a->exp_avg_sq()[i].copy_(s.tensor(fmt::format("adam.{}.v.{}", which, i)));
    }
    a->set_steps(s.header.at("adam_steps_" + which).get<int64_t>());
  }
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s.tensor("rng"));
}

// Global gradient-norm clip, in a fixed order (deterministic).
void clip_grads(Run& r) {
  if (r.o.clip <= 0) return;
  double sq = 0;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : r.model->parameters())
    if (p.grad().defined()) {
      grads.push_back(p.grad());
      sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    }
  const double norm = std::sqrt(sq);
  if (norm > r.o.clip)
    for (at::Tensor& g : grads) g.mul_(r.o.clip / (norm + 1e-6));
}

}  // namespace

ModelConfig default_train_model() {
  ModelConfig m;
  m.arch = "gpt2";
  m.layers = 4;
  m.dim = 256;
  m.heads = 8;
  m.batch = 16;
  m.seq = 128;
  m.vocab = 256;
  return m;
}

TrainResult train(const TrainOptions& given, const std::string& resume_dir,
                  const std::vector<std::string>& explicit_flags) {
  Run r;
  r.o = given;
  r.o.model.vocab = 256;
  std::optional<TrainState> saved;
  if (!resume_dir.empty()) {
    saved = load_train_state(resume_dir);
    const Json& was = saved->header.at("options");
    r.o = options_from(was, r.o);
    // Flags given now must not change the trajectory of the saved run.
    const Json now = options_json(given, was.at("data").get<std::string>());
    for (const std::string& flag : explicit_flags) {
      if (!now.contains(flag) || may_change(flag) || flag == "data") continue;
      if (now.at(flag) != was.at(flag))
        fail("--{} {} differs from the run saved in '{}' ({}); drop the flag to continue that run, or --save elsewhere",
             flag, now.at(flag).dump(), resume_dir, was.at(flag).dump());
    }
  }
  check_options(r.o);
  if (make_model(r.o.model).stem.tensors.empty())
    fail("remat train trains token models (gpt2, llama) on bytes; ModelConfig.arch {} takes float data",
         r.o.model.arch);
  apply_threads(r.o.threads);
  r.corpus = load_corpus(r.o.data, r.o.val_fraction, r.o.model.seq);
  if (saved && saved->header.at("options").at("data").get<std::string>() != r.corpus.id)
    fail("--data differs from the run saved in '{}': it trained on {}, this is {}", resume_dir,
         saved->header.at("options").at("data").get<std::string>(), r.corpus.id);

  // The policy: budgets are planned with costs estimated from this machine's rates (no profiling
  // pass before training), then checked against the memory this machine has.
  ResolveOptions ro;
  ro.costs = CostSource::Estimated;
  ro.threads = r.o.threads;
  const Resolution res = resolve_policy(Policy::parse(r.o.policy), r.o.model, ro);
  r.policy = res.policy;
  r.policy_text = res.text;
  if (r.policy.chunk == 0) {
    r.predicted_peak = res.memory.total_peak();
    const int64_t available = available_memory();
    if (available > 0 && res.memory.total_peak() > available * 9 / 10)
      fail("policy '{}' needs about {} per step and this machine has {} available; try --policy budget:{}MiB "
           "(the planner then recomputes what it must)",
           r.o.policy, bytes_str(res.memory.total_peak()), bytes_str(available), available * 6 / 10 / (1 << 20));
  }

  at::manual_seed(r.o.seed);
  r.model = GPT(r.o.model, r.policy);
  at::manual_seed(r.o.seed + 1);  // the dropout stream
  make_optimizers(r);
  if (saved) {
    restore(r, *saved, resume_dir);
    r.step = saved->header.at("step").get<int64_t>();
    if (r.step >= r.o.steps) fail("the run in '{}' already finished its {} steps", resume_dir, r.o.steps);
  }

  TrainResult result;
  result.policy_text = r.policy_text;
  result.predicted_peak = r.predicted_peak;
  int64_t last_saved = saved ? r.step : -1;
  double last_val = std::numeric_limits<double>::quiet_NaN();
  const auto t_start = Clock::now();
  const int64_t tokens_per_step = r.o.model.batch * r.o.model.seq * r.o.accum;
  for (; r.step < r.o.steps;) {
    const auto t0 = Clock::now();
    MemoryTracker::reset_peak();
    const double lr = lr_at(r.o, r.step);
    r.decayed->set_lr(lr);
    r.plain->set_lr(lr);
    r.decayed->zero_grad();
    r.plain->zero_grad();
    double loss = 0;
    for (int64_t micro = 0; micro < r.o.accum; ++micro) {
      auto [x, y] = train_batch(r.corpus, r.o.model, r.o.seed, r.step, micro);
      at::Tensor l = r.model->forward(x, y);
      if (r.o.accum > 1) l = l / static_cast<double>(r.o.accum);
      l.backward();
      loss += l.item<double>();
    }
    if (!std::isfinite(loss)) {
      const std::string kept = r.o.save_dir.empty()    ? "no train state was being saved"
                               : last_saved >= 0 ? fmt::format("the last good state (step {}) is kept in '{}'", last_saved, r.o.save_dir)
                                                 : "no state had been saved yet";
      fail_runtime("loss is {} at step {} (lr {:.3g}); stopped before the update; {}; lower --lr or set --clip",
                   loss, r.step + 1, lr, kept);
    }
    clip_grads(r);
    r.decayed->step();
    r.plain->step();
    ++r.step;

    TrainRecord rec;
    rec.step = r.step;
    rec.lr = lr;
    rec.loss = loss;
    rec.peak_bytes = MemoryTracker::peak();
    const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
    rec.tokens_per_s = static_cast<double>(tokens_per_step) / step_s;
    const bool last = r.step == r.o.steps;
    if (last || (r.o.eval_every > 0 && r.step % r.o.eval_every == 0)) last_val = rec.val_loss = val_loss(r);
    rec.elapsed_s = std::chrono::duration<double>(Clock::now() - t_start).count();
    result.log.push_back(rec);
    if (!r.o.save_dir.empty() && (last || (r.o.save_every > 0 && r.step % r.o.save_every == 0))) {
      save_train_state(r.o.save_dir, snapshot(r));
      last_saved = r.step;
    }
    if (r.o.progress) {
      TrainProgress p;
      p.step = r.step;
      p.steps = r.o.steps;
      p.loss = loss;
      p.val_loss = last_val;
      p.tokens_per_s = rec.tokens_per_s;
      p.peak_bytes = rec.peak_bytes;
      p.eta_s = rec.elapsed_s / static_cast<double>(result.log.size()) * static_cast<double>(r.o.steps - r.step);
      r.o.progress(p);
    }
  }
  result.final_val_loss = last_val;
  std::vector<at::Tensor> weights;
  for (const auto& [name, p] : named_params(r.model)) weights.push_back(p);
  result.weights_digest = digest(weights);
  return result;
}

std::string TrainResult::csv() const {
  std::string s = "step,lr,loss,val_loss,tokens_per_s,peak_bytes,elapsed_s\n";
  for (const TrainRecord& r : log)
    s += fmt::format("{},{:.6g},{:.6f},{},{:.1f},{},{:.3f}\n", r.step, r.lr, r.loss,
                     std::isnan(r.val_loss) ? "" : fmt::format("{:.6f}", r.val_loss), r.tokens_per_s, r.peak_bytes,
                     r.elapsed_s);
  return s;
}

void TrainResult::write_chart(const std::string& path, const std::string& title) const {
  Chart c;
  c.title = title;
  c.xlabel = "step";
  c.ylabel = "loss (nats per byte)";
  ChartSeries train_loss{"training loss (one batch)", {}, true}, val{"validation loss", {}, true};
  for (const TrainRecord& r : log) {
    train_loss.points.push_back({"", static_cast<double>(r.step), r.loss});
    if (!std::isnan(r.val_loss)) val.points.push_back({"", static_cast<double>(r.step), r.val_loss});
  }
  c.series = {train_loss, val};
  render_chart(c, path);
}

}  // namespace remat
