#include "app/train.h"

#include <unistd.h>

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
#include "core/shard.h"
#include "remat/blas_kernel.h"
#include "remat/data_parallel.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/memory_model.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "remat/policy.h"
#include "remat/resolve.h"
#include "remat/units.h"
#include "util/gemm.h"
#include "util/hash.h"

namespace remat {

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Options in the train state

std::string switch_name(Switch s, const char* on, const char* off) {
  return s == Switch::Default ? "default" : s == Switch::On ? on : off;
}
// switch_name's text back; `key` names the saved option in the refusal of any other.
Switch parse_switch(const std::string& s, const char* key, const char* on, const char* off) {
  if (s == "default") return Switch::Default;
  if (s == on) return Switch::On;
  if (s == off) return Switch::Off;
  fail("saved option '{}' is '{}'; a train state holds default, {} or {}", key, s, on, off);
}

// The sigmoid router's arithmetic, saved with a run: 2 divides each token's scores by their sum in
// the balancing loss and keeps one weight's score (1, states without the key: raw scores, and one
// weight divided by itself).
constexpr int kRouterArithmetic = 2;

Json options_json(const TrainOptions& o, const std::string& corpus_id) {
  const ModelConfig& m = o.model;
  return {{"norm", to_string(m.norm)},
          {"positions", to_string(m.positions)},
          {"mlp", to_string(m.mlp)},
          {"bias", switch_name(m.bias, "on", "off")},
          {"qkv-bias", m.qkv_bias},
          {"tied", switch_name(m.tied, "on", "off")},
          {"qkv", switch_name(m.fused_qkv, "fused", "separate")},
          {"loss", to_string(m.loss, m.loss_chunks)},
          {"arch", m.arch},
          {"kv-heads", m.kv_heads},
          {"attention", std::string(to_string(m.attention))},
          {"layers", m.layers},
          {"dim", m.dim},
          {"heads", m.heads},
          {"batch", m.batch},
          {"seq", m.seq},
          {"ffn", m.ffn},
          {"dropout", m.dropout},
          {"attn-block", m.attn_block},
          {"head-dim", m.head_size},
          {"experts", m.experts},
          {"top-k", m.top_k},
          {"shared-ffn", m.shared_ffn},
          {"capacity-factor", m.capacity_factor},
          {"router", std::string(to_string(m.router))},
          {"norm-topk", m.norm_topk},
          {"aux-loss", m.aux_loss},
          {"expert-weights", std::string(to_string(m.expert_weights))},
          {"router-arithmetic", kRouterArithmetic},
          {"steps", o.steps},
          {"accum", o.accum},
          {"lr", o.lr},
          {"min-lr", o.min_lr},
          {"warmup", o.warmup},
          {"weight-decay", o.weight_decay},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"clip", o.clip},
          {"val-fraction", o.val_fraction},
          {"seed", o.seed},
          {"data", corpus_id},
          {"policy", o.policy},
          {"eval-every", o.eval_every},
          {"eval-batches", o.eval_batches},
          {"save-every", o.save_every},
          {"nproc", o.dist.world},
          {"zero", o.zero},
          {"bucket-mb", static_cast<double>(o.bucket_bytes) / (1 << 20)},
          {"aten-threads", o.threads.aten},
          {"gemm", gemm_record()},
          {"blas-kernel", blas::loaded_kernel()}};
}

// Options that may change when resuming: they affect memory, time or bookkeeping, not the weights.
// (ZeRO-1 changes where the moments live, not what they are.)
bool may_change(const std::string& key) {
  return key == "policy" || key == "eval-every" || key == "eval-batches" || key == "save-every" || key == "zero" ||
         key == "bucket-mb";
}

// A resumed run continues bitwise only on the arithmetic it started with. Measured on 30 steps of
// a small model: the ATen thread count changes the weights (some gradients are summed in its
// order), the engine's GEMM does, and OpenBLAS's kernel does when the GEMM is the BLAS; the BLAS
// thread count does not (the engine's tiles never depend on it). A GEMM chosen by measurement
// (--gemm auto) is taken over from the saved run; anything else that differs is refused with the
// flag that restores it.
void check_same_arithmetic(const Json& was, const TrainOptions& o, const std::string& dir) {
  if (was.contains("aten-threads") && was.at("aten-threads").get<int>() != o.threads.aten)
    fail(
        "the run in '{}' was trained with {} ATen thread(s); resume it with --threads {}/{} (its gradients are "
        "summed in that order)",
        dir, was.at("aten-threads").get<int>(), was.at("aten-threads").get<int>(), o.threads.blas);
  // (An explicit --gemm that differs was refused with the other flags that change the trajectory.)
  if (was.contains("gemm")) restore_gemm(was.at("gemm").get<std::string>());
  if (gemm_uses_blas() && was.contains("blas-kernel") &&
      was.at("blas-kernel").get<std::string>() != blas::loaded_kernel())
    fail("the run in '{}' was trained on OpenBLAS kernel {}; resume it with --blas-kernel {} (this process runs {})",
         dir, was.at("blas-kernel").get<std::string>(), was.at("blas-kernel").get<std::string>(),
         blas::loaded_kernel());
}

}  // namespace

TrainOptions options_from(const Json& j, TrainOptions o) {
  ModelConfig& m = o.model;
  m.arch = j.contains("arch") ? j.at("arch").get<std::string>() : "gpt2";  // states before 0.3 were gpt2
  if (j.contains("attention")) m.attention = parse_attention(j.at("attention").get<std::string>());
  if (j.contains("kv-heads")) m.kv_heads = j.at("kv-heads");
  if (j.contains("head-dim")) m.head_size = j.at("head-dim");
  // The decoder's choices (absent from states before 0.4: the kinds' defaults).
  auto text = [&](const char* k) { return j.contains(k) ? j.at(k).get<std::string>() : std::string("default"); };
  if (text("norm") != "default") m.norm = parse_norm(text("norm"));
  if (text("positions") != "default") m.positions = parse_positions(text("positions"));
  if (text("mlp") != "default") m.mlp = parse_mlp(text("mlp"));
  m.bias = parse_switch(text("bias"), "bias", "on", "off");
  m.tied = parse_switch(text("tied"), "tied", "on", "off");
  m.fused_qkv = parse_switch(text("qkv"), "qkv", "fused", "separate");
  if (j.contains("qkv-bias")) m.qkv_bias = j.at("qkv-bias").get<bool>();
  if (text("loss") != "default") parse_loss(text("loss"), m);
  // The mixture of experts (absent from states before 0.5: the defaults).
  if (j.contains("experts")) {
    m.experts = j.at("experts");
    m.top_k = j.at("top-k");
    m.shared_ffn = j.at("shared-ffn");
    m.capacity_factor = j.at("capacity-factor");
    m.router = parse_router(j.at("router").get<std::string>());
    m.norm_topk = j.at("norm-topk");
    m.aux_loss = j.at("aux-loss");
    if (j.contains("expert-weights"))  // (absent before 0.6: combine)
      m.expert_weights = parse_expert_weights(j.at("expert-weights").get<std::string>());
  }
  m.layers = j.at("layers");
  m.dim = j.at("dim");
  m.heads = j.at("heads");
  m.batch = j.at("batch");
  m.seq = j.at("seq");
  m.ffn = j.at("ffn");
  m.dropout = j.at("dropout");
  m.attn_block = j.at("attn-block");
  o.steps = j.at("steps");
  o.accum = j.at("accum");
  o.lr = j.at("lr");
  o.min_lr = j.at("min-lr");
  o.warmup = j.at("warmup");
  o.weight_decay = j.at("weight-decay");
  o.beta1 = j.at("beta1");
  o.beta2 = j.at("beta2");
  o.clip = j.at("clip");
  o.val_fraction = j.at("val-fraction");
  o.seed = j.at("seed");
  return o;
}

uint64_t dropout_seed(uint64_t seed, int64_t step, int64_t micro) {
  uint64_t z = seed ^ (static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL) ^ (static_cast<uint64_t>(micro) << 48);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) & 0x7fffffffffffffffULL;  // at::manual_seed takes it as signed
}

void check_train_options(const TrainOptions& o, const std::string& resume_dir) {
  validate(o.model);
  if (make_model(o.model).stem.tensors.empty())
    fail("remat train trains token models (gpt2, llama) on bytes; ModelConfig.arch {} takes float data", o.model.arch);
  static_cast<void>(Policy::parse(o.policy));  // syntax only: a budget is planned once the corpus is loaded
  if (o.steps < 1) fail("--steps must be >= 1, got {}", o.steps);
  if (o.accum < 1 || o.accum > kMaxAccum) fail("--accum must be in 1..{}, got {}", kMaxAccum, o.accum);
  // dropout_seed keeps 16 bits of a micro-batch's index in the step: more would repeat masks.
  if (o.accum * o.dist.world > kMaxAccum)
    fail("--accum {} on {} ranks is {} micro-batches a step; at most {} (each draws dropout masks of its own)", o.accum,
         o.dist.world, o.accum * o.dist.world, kMaxAccum);
  // Written as !(x >= 0) so that NaN is refused too.
  if (!(o.lr > 0) || !std::isfinite(o.lr) || !(o.min_lr >= 0) || o.min_lr > o.lr)
    fail("--lr {} and --min-lr {} need 0 <= min-lr <= lr, lr > 0 and finite", o.lr, o.min_lr);
  if (o.warmup < 0) fail("--warmup must be >= 0, got {}", o.warmup);
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
    fail("--weight-decay must be a finite number >= 0, got {}", o.weight_decay);
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
    fail("TrainOptions.beta1 and beta2 must be in [0, 1), got {} and {}", o.beta1, o.beta2);
  if (!(o.clip >= 0) || !std::isfinite(o.clip)) fail("--clip must be a finite number >= 0 (0 = off), got {}", o.clip);
  if (o.eval_every < 0) fail("--eval-every must be >= 0, got {}", o.eval_every);
  if (o.eval_batches < 1 || o.eval_batches > kMaxEvalBatches)
    fail("--eval-batches must be in 1..{}, got {}", kMaxEvalBatches, o.eval_batches);
  if (o.save_every < 0) fail("--save-every must be >= 0, got {}", o.save_every);
  if (!(o.val_fraction > 0 && o.val_fraction < 0.5)) fail("--val-fraction must be in (0, 0.5), got {}", o.val_fraction);
  validate(o.dist);
  if (o.zero != 0 && o.zero != 1) fail("--zero must be 0 or 1 (ZeRO-1 shards the Adam moments), got {}", o.zero);
  if (o.zero == 1 && o.dist.world == 1) fail("--zero 1 shards the Adam moments over ranks; give --nproc 2 or more");
  if (o.bucket_bytes <= 0) fail("--bucket-mb must be positive, got {} bytes", o.bucket_bytes);
  if (!o.save_dir.empty() && o.dist.rank == 0) check_state_dir(o.save_dir, resume_dir);
}

namespace {

double lr_at(const TrainOptions& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  const double t = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * t));
}

// ---------------------------------------------------------------------------------------------
// The run

struct Run {
  TrainOptions o;
  Corpus corpus;
  GPT model{nullptr};
  std::vector<at::Tensor> params;     // model->parameters(), in plan order
  std::vector<std::string> names;     // their registered names
  std::unique_ptr<ShardedAdam> adam;  // this rank's share (all of them in one process or without ZeRO)
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<GradientBuckets> buckets;
  at::Tensor loss_sum;  // data parallelism: the all-reduced loss, one float64
  StepShape shape;      // the step as the memory model replays it (trainer_step_shape), and as it runs
  int64_t step = 0;
  ResolvedPolicy policy;
  std::string policy_text;
  int64_t predicted_peak = 0;
  std::vector<TrainRecord> log;  // every step's record so far, a resumed run's saved ones first
  bool parallel() const { return o.dist.world > 1; }
  bool leader() const { return o.dist.rank == 0; }
};

int64_t total_elements(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const at::Tensor& p : params) n += p.numel();
  return n;
}

// AdamW's decay where the parameter's role says so (matrices); over this rank's share with ZeRO-1.
void make_optimizer(Run& r) {
  for (const auto& item : r.model->named_parameters()) {
    r.names.push_back(item.key());
    r.params.push_back(item.value());
  }
  const int64_t total = total_elements(r.params);
  const bool shard = r.parallel() && r.o.zero == 1;
  const int64_t first = shard ? shard_first(total, r.o.dist.rank, r.o.dist.world) : 0;
  const int64_t last = shard ? shard_first(total, r.o.dist.rank + 1, r.o.dist.world) : total;
  AdamOptions a{r.o.lr, r.o.beta1, r.o.beta2, 1e-8, r.o.weight_decay, /*decoupled=*/true};
  r.adam = std::make_unique<ShardedAdam>(r.params, r.model->decays(), a, first, last);
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

// Full moments of every parameter, on rank 0: its own share and, with ZeRO-1, every other rank's,
// sent to it (all ranks take part). A parameter inside one rank's share is a view of it; only one
// that spans shares is copied together (no second copy of all the moments).
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> full_moments(Run& r) {
  const int64_t total = total_elements(r.params);
  std::vector<at::Tensor> ms = {r.adam->exp_avg()}, vs = {r.adam->exp_avg_sq()};
  std::vector<int64_t> starts = {0};  // flat index of each share's first element
  if (r.parallel() && r.o.zero == 1) {
    if (!r.leader()) {
      r.comm->send(ms[0], 0, 1, "sending Adam moments to rank 0");
      r.comm->send(vs[0], 0, 2, "sending Adam moments to rank 0");
      return {};
    }
    for (int q = 1; q < r.o.dist.world; ++q) {
      starts.push_back(shard_first(total, q, r.o.dist.world));
      const int64_t n = shard_first(total, q + 1, r.o.dist.world) - starts.back();
      ms.push_back(at::empty({n}));
      vs.push_back(at::empty({n}));
      r.comm->recv(ms.back(), q, 1, "gathering Adam moments");
      r.comm->recv(vs.back(), q, 2, "gathering Adam moments");
    }
  } else if (!r.leader()) {
    return {};
  }
  // Elements [at, at + n) of the moments laid end to end, shaped as `p`.
  auto piece = [&](const std::vector<at::Tensor>& shares, int64_t at, int64_t n, const at::Tensor& p) {
    size_t q = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin()) - 1;
    if (at + n <= starts[q] + shares[q].numel()) return shares[q].narrow(0, at - starts[q], n).view(p.sizes());
    at::Tensor whole = at::empty({n});
    for (int64_t done = 0; done < n; ++q) {
      const int64_t from = at + done - starts[q], take = std::min(n - done, shares[q].numel() - from);
      whole.narrow(0, done, take).copy_(shares[q].narrow(0, from, take));
      done += take;
    }
    return whole.view(p.sizes());
  };
  std::vector<at::Tensor> m, v;
  int64_t at = 0;
  for (const at::Tensor& p : r.params) {
    m.push_back(piece(ms, at, p.numel(), p));
    v.push_back(piece(vs, at, p.numel(), p));
    at += p.numel();
  }
  return {m, v};
}

// The columns of a saved state's "metrics": TrainRecord's fields, in its order.
constexpr int64_t kMetrics = 9;

void save(Run& r) {
  auto [m, v] = full_moments(r);
  if (!r.leader()) return;
  TrainState s;
  s.header["format"] = kTrainStateFormat;
  s.header["options"] = options_json(r.o, r.corpus.id);
  s.header["step"] = r.step;
  s.header["policy"] = r.policy_text;
  s.header["adam_steps"] = r.adam->steps();
  for (size_t i = 0; i < r.params.size(); ++i) {
    s.tensors.emplace_back("param:" + r.names[i], r.params[i]);
    s.tensors.emplace_back("adam.m:" + r.names[i], m[i]);
    s.tensors.emplace_back("adam.v:" + r.names[i], v[i]);
  }
  // The run's metrics so far, a row per step (kMetrics), so that a resumed run's log, CSV and chart
  // cover it from its first step.
  at::Tensor metrics = at::empty({static_cast<int64_t>(r.log.size()), kMetrics}, at::kDouble);
  for (size_t i = 0; i < r.log.size(); ++i) {
    const TrainRecord& t = r.log[i];
    const double row[kMetrics] = {
        static_cast<double>(t.step),       t.lr,        t.loss,     t.val_loss, t.tokens_per_s,
        static_cast<double>(t.peak_bytes), t.elapsed_s, t.reduce_s, t.exposed_s};
    std::copy(row, row + kMetrics, metrics.data_ptr<double>() + i * kMetrics);
  }
  s.tensors.emplace_back("metrics", metrics);
  s.header["weights_digest"] = digest(r.params);
  save_train_state(r.o.save_dir, s);
}

void restore(Run& r, const TrainState& s, const std::string& dir) {
  at::NoGradGuard no_grad;
  // The weights and both moments of each parameter: its shape and dtype (Adam's state is kept in
  // the parameter's float32).
  for (size_t i = 0; i < r.params.size(); ++i) {
    for (const char* part : {"adam.m:", "adam.v:"}) s.tensor_like(part + r.names[i], r.params[i], dir);
    r.params[i].copy_(s.tensor_like("param:" + r.names[i], r.params[i], dir));
  }
  // This rank's share of the moments, from the full ones.
  for (const ShardedAdam::Slice& sl : r.adam->slices()) {
    const int64_t n = sl.end - sl.begin, off = sl.flat - r.adam->first();
    r.adam->exp_avg().narrow(0, off, n).copy_(
        s.tensor("adam.m:" + r.names[sl.param]).view({-1}).narrow(0, sl.begin, n));
    r.adam->exp_avg_sq().narrow(0, off, n).copy_(
        s.tensor("adam.v:" + r.names[sl.param]).view({-1}).narrow(0, sl.begin, n));
  }
  r.adam->set_steps(s.header.at("adam_steps").get<int64_t>());
  // The steps' metrics: states of 0.12 and earlier have none, and a run resumed from one logs from
  // its resumed step on. The rows are the last steps up to the saved one, one each, in order.
  const int64_t step = s.header.at("step").get<int64_t>();
  for (const auto& [name, t] : s.tensors) {
    if (name != "metrics") continue;
    bool rows_ok = t.dim() == 2 && t.size(0) <= step && t.size(1) == kMetrics && t.scalar_type() == at::kDouble;
    for (int64_t i = 0; rows_ok && i < t.size(0); ++i)
      rows_ok = t.data_ptr<double>()[i * kMetrics] == static_cast<double>(step - t.size(0) + 1 + i);
    if (!rows_ok)
      fail(
          "train state in '{}' is corrupt: its metrics ({} of {}) are not one row of {} float64 columns for each of "
          "the last steps up to step {}",
          dir, shape_str(t.sizes().vec()), c10::toString(t.scalar_type()), kMetrics, step);
    const double* m = t.data_ptr<double>();
    for (int64_t i = 0; i < t.size(0); ++i, m += kMetrics) {
      TrainRecord rec;
      rec.step = static_cast<int64_t>(m[0]), rec.lr = m[1], rec.loss = m[2], rec.val_loss = m[3];
      rec.tokens_per_s = m[4], rec.peak_bytes = static_cast<int64_t>(m[5]), rec.elapsed_s = m[6];
      rec.reduce_s = m[7], rec.exposed_s = m[8];
      r.log.push_back(rec);
    }
  }
}

// Ranks on several hosts each read their own flags and saved run: a stale state.bin on one host, or
// another --lr, would still pair up in the collectives and train apart. Before the first step every
// rank compares what sets its trajectory (its step, its weights, and the options that change them
// or the exchange) with rank 0's, and all stop when one differs. Left out: the policy, evaluation
// and save settings, and each host's arithmetic (its ATen threads, GEMM and BLAS kernel, which
// change the last bits of a rank's gradients, not what it trains). Under ZeRO-1 a save gathers
// every rank's share of the moments, so whether and when the ranks save must agree too.
void check_ranks_agree(Run& r) {
  Json opts = options_json(r.o, "");
  for (const char* free : {"policy", "eval-every", "eval-batches", "save-every", "aten-threads", "gemm", "blas-kernel"})
    opts.erase(free);
  if (r.o.zero == 1) opts["saves"] = {!r.o.save_dir.empty(), r.o.save_every};
  const auto data = split_corpus_id(r.corpus.id);
  opts["data"] = data ? data->second : r.corpus.id;  // its size and hash, not its path
  const std::string text = fmt::format("{} {} {}", r.step, digest(r.params), opts.dump());
  at::Tensor mine = at::tensor({static_cast<int64_t>(detail::fnv1a(text.data(), text.size())), r.step}, at::kLong);
  at::Tensor first = mine.clone();
  r.comm->broadcast(first, 0, "the ranks' start check");
  at::Tensor differ = at::tensor({static_cast<int64_t>(!at::equal(mine, first))}, at::kLong);
  r.comm->all_reduce(differ, "the ranks' start check").wait();
  if (const int64_t n = differ.item<int64_t>(); n > 0)
    fail(
        "{} of the {} ranks start from other flags, data or saved state than rank 0 (rank 0 at step {}, rank {} at "
        "step {}): give every rank the same flags, data and --resume folder",
        n, r.o.dist.world, first[1].item<int64_t>(), r.o.dist.rank, r.step);
}

// Global gradient-norm clip at `norm` (gradient_norm's).
void clip_grads(const std::vector<at::Tensor>& grads, double clip, double norm) {
  if (clip > 0 && norm > clip)
    for (const at::Tensor& g : grads) g.mul_(clip / (norm + 1e-6));
}

}  // namespace

double gradient_norm(const std::vector<at::Tensor>& grads) {
  double sq = 0;
  for (const at::Tensor& g : grads) {
    const float* p = g.data_ptr<float>();
    for (int64_t i = 0; i < g.numel(); ++i) sq += static_cast<double>(p[i]) * p[i];
  }
  return std::sqrt(sq);
}

ModelConfig default_train_model() {
  ModelConfig m;
  m.arch = "gpt2";
  m.layers = 4;
  m.dim = 256;
  m.heads = 8;
  m.batch = 16;
  m.seq = 128;
  m.vocab = kByteVocab;
  return m;
}

namespace {

// "--policy budget:N MiB fits", or that no policy does and the smallest peak any policy reaches: what
// a report of memory that ran out ends with. Planned on placeholder costs (plan_on_placeholder_costs):
// nothing measured, nothing allocated.
std::string plan_that_fits(const TrainOptions& o, int64_t limit) {
  const int64_t budget = planned_share(limit);
  try {
    const ModelSpec spec = make_model(o.model);
    const Plan p = plan_on_placeholder_costs(o.model, spec, Budget{budget, 0}, keep_everything(spec.block), o.threads);
    if (p.fits)  // rounded down: MiB, or KiB for a budget under one MiB
      return budget >= (1 << 20) ? fmt::format("--policy budget:{}MiB fits", budget >> 20)
                                 : fmt::format("--policy budget:{}KiB fits", budget >> 10);
    return fmt::format("no policy fits {}: the smallest peak any policy reaches is {}", bytes_str(budget),
                       bytes_str(p.min_budget));
  } catch (const Error& e) {
    return fmt::format("no policy fits {}: {}", bytes_str(budget), e.what());
  }
}

// The saved run's options, with what `given` may change (explicit_flags: the flags given now, which
// must not change the saved run's trajectory).
TrainOptions resumed_options(const TrainOptions& given, const TrainState& saved, const std::string& resume_dir,
                             const std::vector<std::string>& explicit_flags) {
  const Json& was = saved.header.at("options");
  TrainOptions o = options_from(was, given);
  // Without --data, the saved run's text: its id is "PATH:BYTES:HASH" ("fortunes:..." for the default).
  if (std::find(explicit_flags.begin(), explicit_flags.end(), "data") == explicit_flags.end()) {
    const std::string id = was.at("data").get<std::string>();
    const auto data = split_corpus_id(id);
    if (!data) fail("train state '{}' names no data ('{}'); give --data", resume_dir, id);
    o.data = data->first == "fortunes" ? std::string() : data->first;
  }
  // Left out, the settings that may change are the saved run's as well, and the run goes on saving
  // into the folder it resumes from.
  auto named = [&](const char* flag) {
    return std::find(explicit_flags.begin(), explicit_flags.end(), flag) != explicit_flags.end();
  };
  if (!named("policy") && was.contains("policy")) o.policy = was.at("policy").get<std::string>();
  if (!named("eval-every") && was.contains("eval-every")) o.eval_every = was.at("eval-every");
  if (!named("eval-batches") && was.contains("eval-batches")) o.eval_batches = was.at("eval-batches");
  if (!named("save-every") && was.contains("save-every")) o.save_every = was.at("save-every");
  if (!named("zero") && was.contains("zero")) o.zero = was.at("zero");
  if (!named("bucket-mb") && was.contains("bucket-mb")) {
    const double mb = was.at("bucket-mb").get<double>();
    if (!(mb > 0 && mb <= 4096))
      fail("train state in '{}' is corrupt: its bucket-mb {} is not in (0, 4096]", resume_dir, mb);
    o.bucket_bytes = static_cast<int64_t>(mb * (1 << 20));
  }
  if (!named("save") && o.save_dir.empty()) {
    if (::access(resume_dir.c_str(), W_OK) != 0)
      fail(
          "a resumed run saves into the folder it resumes from, and '{}' cannot be written ({}); give --save with "
          "another folder",
          resume_dir, std::strerror(errno));
    o.save_dir = resume_dir;
  }
  const Json now = options_json(given, was.at("data").get<std::string>());
  // A key a state of an earlier release lacks held its default then.
  const Json defaults = options_json(TrainOptions(), was.at("data").get<std::string>());
  // The decoder's choices compare as the blocks they build: --bias on continues a gpt2 run saved
  // with the kind's own biases ("default").
  const TrainOptions saved_run = options_from(was, TrainOptions());
  TrainOptions this_run = saved_run;
  ModelConfig& mine = this_run.model;
  const ModelConfig& asked = given.model;
  mine.norm = asked.norm, mine.positions = asked.positions, mine.mlp = asked.mlp;
  mine.bias = asked.bias, mine.tied = asked.tied, mine.fused_qkv = asked.fused_qkv;
  mine.loss = asked.loss, mine.loss_chunks = asked.loss_chunks;
  auto built = [&](TrainOptions t) {
    t.model = with_choices_resolved(t.model);
    return options_json(t, was.at("data").get<std::string>());
  };
  const Json built_now = built(this_run), built_then = built(saved_run);
  for (const std::string& flag : explicit_flags) {
    // (The BLAS kernel is check_same_arithmetic's: it matters only where the saved GEMM runs the BLAS.)
    if (!now.contains(flag) || may_change(flag) || flag == "data" || flag == "blas-kernel") continue;
    // States before 0.4 name the GEMM "blas" or "onednn": compared as the tables they stand for.
    if (flag == "gemm" && was.contains("gemm") &&
        detail::parse_gemm_table(was.at("gemm").get<std::string>()) == detail::gemm_table())
      continue;
    const bool choice = flag == "norm" || flag == "positions" || flag == "mlp" || flag == "bias" || flag == "tied" ||
                        flag == "qkv" || flag == "loss";
    const Json& before = choice ? built_then.at(flag) : was.contains(flag) ? was.at(flag) : defaults.at(flag);
    if ((choice ? built_now.at(flag) : now.at(flag)) != before)
      fail("--{} {} differs from the run saved in '{}' ({}); drop the flag to continue that run, or --save elsewhere",
           flag, now.at(flag).dump(), resume_dir, before.dump());
  }
  // (Only a balancing loss, or one expert per token whose weight was normalised, changed.)
  const ModelConfig& mc = o.model;
  const bool changed = mc.aux_loss != 0 || (mc.top_k == 1 && mc.norm_topk);
  if (mc.arch == "moe" && mc.router == Router::Sigmoid && changed &&
      was.value("router-arithmetic", 1) != kRouterArithmetic)
    fail(
        "the run in '{}' was trained with the sigmoid router's earlier arithmetic (its balancing loss on raw scores, "
        "one expert's weight divided by itself); resume it with remat 0.19, or train it again",
        resume_dir);
  // The world size lays out the batches; the ATen thread count sums some gradients in another order.
  const int world = was.contains("nproc") ? was.at("nproc").get<int>() : 1;
  if (world != o.dist.world)
    fail("the run in '{}' was trained on {} process(es); resume it with --nproc {} (this is {})", resume_dir, world,
         world, o.dist.world);
  check_same_arithmetic(was, o, resume_dir);
  return o;
}

// This rank's step as the memory model replays it: its micro-batches, the ranks and ZeRO.
StepShape step_shape(const TrainOptions& o) {
  return trainer_step_shape(static_cast<int>(o.accum), o.dist.world, o.dist.rank, o.zero);
}

// The policy, the model, its optimizer and (data parallelism) the communicator and buckets. Budgets
// are planned with costs estimated from this machine's rates (no profiling pass before training).
void build_model(Run& r) {
  ResolveOptions ro;
  ro.costs = CostSource::Estimated;
  ro.threads = r.o.threads;
  const Resolution res = resolve_policy(Policy::parse(r.o.policy), r.o.model, ro);
  r.policy = res.policy;
  r.policy_text = res.text;
  r.shape = step_shape(r.o);
  at::manual_seed(r.o.seed);
  // The step divides each micro-batch's loss by the micro-batches it sums (train_step); the
  // router's load-balancing loss, whose gradient its backward adds, is divided the same way.
  ModelConfig engine_model = r.o.model;
  engine_model.aux_loss /= static_cast<double>(r.o.accum * r.o.dist.world);
  r.model = GPT(engine_model, r.policy);
  make_optimizer(r);
  if (!r.parallel()) return;
  r.comm = std::make_unique<Communicator>(r.o.dist);
  r.buckets = std::make_unique<GradientBuckets>(r.model->compiled_step(), r.params, r.o.bucket_bytes,
                                                static_cast<int>(r.o.accum), *r.comm);
  r.model->set_grad_sink(r.buckets->sink());
  r.loss_sum = at::zeros({1}, at::kDouble);
  if (r.loss_sum.nbytes() != static_cast<size_t>(r.shape.extra_buffers))
    REMAT_INTERNAL("the loss all-reduce holds {} B; the step shape counts {}", r.loss_sum.nbytes(),
                   r.shape.extra_buffers);
}

// The memory guard: `step` (of `shape`) predicted against TrainOptions.memory_limit, with `outside`
// bytes held before, or else against the memory this machine has; returns the predicted peak.
int64_t guard_memory(const TrainOptions& o, const CompiledStep& step, const StepShape& shape, int64_t outside) {
  const int64_t needs = simulate_memory(step, o.threads, nullptr, shape).total_peak();
  if (o.memory_limit > 0) {
    if (outside + needs > o.memory_limit)
      fail("policy '{}' peaks at {} per step{}, over TrainOptions.memory_limit {}; {}", o.policy, bytes_str(needs),
           outside > 0 ? " with " + bytes_str(outside) + " held before" : std::string(), bytes_str(o.memory_limit),
           plan_that_fits(o, o.memory_limit - outside));
  } else if (const int64_t usable = usable_memory(); usable > 0 && needs * o.dist.world > usable) {
    fail(
        "policy '{}' needs about {} per step on each of {} process(es) and runs here may take {} (nine tenths of "
        "what this machine has available); try --policy budget:{}MiB (the planner then recomputes what it must)",
        o.policy, bytes_str(needs), o.dist.world, bytes_str(usable), planned_share(usable) / o.dist.world / (1 << 20));
  }
  return needs;
}

// The forward and backward of this rank's micro-batches of the step; their summed loss.
double accumulate(Run& r, int64_t outside) {
  const int64_t micro_per_step = r.o.accum * r.o.dist.world;
  double loss = 0;
  try {
    for (int64_t micro = 0; micro < r.o.accum; ++micro) {
      // Micro-batch `global` of the step: its data and its dropout are pure functions of
      // (seed, step, global), whichever rank runs it.
      const int64_t global = r.o.dist.rank * r.o.accum + micro;
      auto [x, y] = train_batch(r.corpus, r.o.model, r.o.seed, r.step, global);
      at::manual_seed(dropout_seed(r.o.seed, r.step, global));
      at::Tensor l = r.model->forward(x, y);
      if (r.shape.scaled_loss) l = l / static_cast<double>(micro_per_step);
      l.backward();
      loss += l.item<double>();
    }
  } catch (const OutOfMemory& e) {
    const int64_t limit = (e.limit() > 0 ? e.limit() : usable_memory()) - outside;
    fail_runtime("out of memory in step {} under policy '{}': {}; the step was predicted to peak at {}; {}", r.step + 1,
                 r.policy_text, e.detail(), bytes_str(r.predicted_peak), plan_that_fits(r.o, limit));
  }
  return loss;
}

// Data parallelism: waits for the buckets still in flight and sums the loss over the ranks;
// records how long the reductions took and how much of that the backward did not hide.
double all_reduce_step(Run& r, double loss, TrainRecord& rec) {
  const double backward_end = r.comm->now();
  r.buckets->wait();  // only what is still in flight
  rec.exposed_s = r.comm->now() - backward_end;
  double first = 1e300, last = 0;
  for (const GradientBuckets::Timing& t : r.buckets->timings()) {
    first = std::min(first, t.launched);
    last = std::max(last, t.finished);
  }
  rec.reduce_s = std::max(0.0, last - first);
  r.loss_sum.fill_(loss);
  r.comm->all_reduce(r.loss_sum, "the loss all-reduce").wait();
  return r.loss_sum.item<double>();
}

// TrainOptions::should_stop, polled once per step; in a parallel run the ranks' largest, so that all
// stop after the same step. The votes are a few bytes of the process's own, outside the tensor
// accounting (the step's memory is the same with and without them).
int stop_request(Run& r) {
  const int mine = r.o.should_stop ? r.o.should_stop() : 0;
  if (!r.parallel()) return mine;
  std::vector<double> votes(static_cast<size_t>(r.o.dist.world), 0.0);
  votes[static_cast<size_t>(r.o.dist.rank)] = mine;
  at::Tensor t = at::from_blob(votes.data(), {r.o.dist.world}, at::kDouble);
  r.comm->all_reduce(t, "the stop vote").wait();
  return static_cast<int>(*std::max_element(votes.begin(), votes.end()));
}

// One optimizer step: the micro-batches, the reductions, the finite-loss check, the update.
// last_saved: the step of the last state saved (-1: none), for the error.
TrainRecord train_step(Run& r, int64_t outside, int64_t last_saved) {
  const auto t0 = Clock::now();
  MemoryTracker::reset_peak();
  TrainRecord rec;
  rec.lr = lr_at(r.o, r.step);
  r.adam->set_lr(rec.lr);
  for (at::Tensor& p : r.params) p.mutable_grad() = at::Tensor();
  rec.loss = accumulate(r, outside);
  if (r.parallel()) rec.loss = all_reduce_step(r, rec.loss, rec);
  const std::string kept = r.o.save_dir.empty() ? "no train state was being saved"
                           : last_saved >= 0
                               ? fmt::format("the last good state (step {}) is kept in '{}'", last_saved, r.o.save_dir)
                               : "no state had been saved yet";
  if (!std::isfinite(rec.loss))
    fail_runtime("loss is {} at step {} (lr {:.3g}); stopped before the update; {}; lower --lr or set --clip", rec.loss,
                 r.step + 1, rec.lr, kept);
  std::vector<at::Tensor> grads;
  if (r.buckets) {
    grads = r.buckets->grads();
  } else {
    for (const at::Tensor& p : r.params) grads.push_back(p.grad());
  }
  // A finite loss may still come with an overflowed gradient, which the update would write into
  // every weight it reaches (and a clip at an infinite norm would make NaN).
  const double norm = gradient_norm(grads);
  if (!std::isfinite(norm))
    fail_runtime(
        "the gradient norm is {} at step {} (lr {:.3g}, loss {:.4f}); stopped before the update; {}; lower --lr", norm,
        r.step + 1, rec.lr, rec.loss, kept);
  clip_grads(grads, r.o.clip, norm);
  r.adam->step(grads);
  if (r.parallel() && r.o.zero == 1) exchange_owned(r.params, *r.comm);
  ++r.step;
  rec.step = r.step;
  rec.peak_bytes = MemoryTracker::peak();
  const double step_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const int64_t tokens_per_step = r.o.model.batch * r.o.model.seq * r.o.accum * r.o.dist.world;
  rec.tokens_per_s = static_cast<double>(tokens_per_step) / step_s;
  return rec;
}

// steps_run and seconds: this call's (a resumed run's earlier steps took another process's time).
void report_progress(const Run& r, const TrainRecord& rec, double last_val, size_t steps_run, double seconds) {
  TrainProgress p;
  p.step = r.step;
  p.steps = r.o.steps;
  p.loss = rec.loss;
  p.val_loss = last_val;
  p.tokens_per_s = rec.tokens_per_s;
  p.peak_bytes = rec.peak_bytes;
  p.eta_s = seconds / static_cast<double>(steps_run) * static_cast<double>(r.o.steps - r.step);
  r.o.progress(p);
}

// Every rank's measured and predicted peak, to rank 0.
void gather_peaks(Run& r, int64_t my_peak, TrainResult& result) {
  at::Tensor peaks = at::zeros({2 * r.o.dist.world}, at::kLong);
  peaks[2 * r.o.dist.rank] = my_peak;
  peaks[2 * r.o.dist.rank + 1] = r.predicted_peak;
  if (r.parallel()) r.comm->all_reduce(peaks, "the memory report").wait();
  for (int q = 0; q < r.o.dist.world; ++q) {
    result.rank_peaks.push_back(peaks[2 * q].item<int64_t>());
    result.rank_predicted.push_back(peaks[2 * q + 1].item<int64_t>());
  }
}

// The allocator's limit for one run only.
class ScopedLimit {
 public:
  explicit ScopedLimit(int64_t bytes) : before_(MemoryTracker::limit()) { MemoryTracker::set_limit(bytes); }
  ~ScopedLimit() { MemoryTracker::set_limit(before_); }
  ScopedLimit(const ScopedLimit&) = delete;
  ScopedLimit& operator=(const ScopedLimit&) = delete;

 private:
  int64_t before_;
};

// Reads a field of a saved run's header: one of the wrong type or missing (a state whose checksum
// holds but was not written by remat) is refused naming the folder.
template <typename F>
auto read_header(const std::string& resume_dir, const F& read) {
  try {
    return read();
  } catch (const nlohmann::json::exception& e) {
    fail("train state in '{}' is corrupt: malformed header ({})", resume_dir, e.what());
  }
}

// check_resume less check_train_options, on a state already loaded.
TrainOptions resolve_resume(const TrainOptions& given, const TrainState& saved, const std::string& resume_dir,
                            const std::vector<std::string>& explicit_flags) {
  TrainOptions o = read_header(resume_dir, [&] { return resumed_options(given, saved, resume_dir, explicit_flags); });
  // (Before the corpus and the model: the header says it.) Adam steps once a step, so a header whose
  // counts differ (or are negative) was not written by remat, however its checksum came out.
  const int64_t step = read_header(resume_dir, [&] { return saved.header.at("step").get<int64_t>(); });
  const int64_t adam_steps = read_header(resume_dir, [&] { return saved.header.at("adam_steps").get<int64_t>(); });
  if (step < 0 || adam_steps != step)
    fail("train state in '{}' is corrupt: its step {} and Adam's steps {} must be equal and >= 0", resume_dir, step,
         adam_steps);
  if (step >= o.steps) fail("the run in '{}' already finished its {} steps", resume_dir, o.steps);
  return o;
}

}  // namespace

TrainOptions check_resume(const TrainOptions& given, const std::string& resume_dir,
                          const std::vector<std::string>& explicit_flags) {
  const TrainOptions o = resolve_resume(given, load_train_state(resume_dir), resume_dir, explicit_flags);
  check_train_options(o, resume_dir);
  return o;
}

void check_train_memory(const TrainOptions& given) {
  TrainOptions o = given;
  o.model.vocab = kByteVocab;
  const Policy policy = Policy::parse(o.policy);
  if (policy.is_budget()) {  // a budget no policy meets, refused as build_model's planner would, measuring nothing
    check_policy(policy, o.model, o.threads);
    return;
  }
  const auto spec = std::make_shared<const ModelSpec>(make_model(o.model));
  guard_memory(o, compile_step(spec, policy.resolve(spec->block, o.model.layers)), step_shape(o),
               MemoryTracker::live());
}

TrainResult train(const TrainOptions& given, const std::string& resume_dir,
                  const std::vector<std::string>& explicit_flags) {
  const int64_t outside = MemoryTracker::live();  // what the process held before this run
  Run r;
  r.o = given;
  r.o.model.vocab = kByteVocab;
  std::optional<TrainState> saved;
  if (!resume_dir.empty()) {
    saved = load_train_state(resume_dir);
    r.o = resolve_resume(r.o, *saved, resume_dir, explicit_flags);
  }
  check_train_options(r.o, resume_dir);
  apply_threads(r.o.threads);
  r.corpus = load_corpus(r.o.data, r.o.val_fraction, r.o.model.seq);
  const std::string saved_data =
      saved ? read_header(resume_dir, [&] { return saved->header.at("options").at("data").get<std::string>(); }) : "";
  // The same bytes under another path (a resume from another folder) are the same data.
  auto content = [](const std::string& id) {
    const auto parts = split_corpus_id(id);
    return parts ? parts->second : id;
  };
  if (saved && content(saved_data) != content(r.corpus.id))
    fail("--data differs from the run saved in '{}': it trained on {}, this is {}", resume_dir, saved_data,
         r.corpus.id);
  build_model(r);
  r.predicted_peak = guard_memory(r.o, r.model->compiled_step(), r.shape, outside);
  // A budget is planned on one micro-batch of one process; gradient accumulation and data
  // parallelism keep more (the gradients or buckets beside a later micro-batch).
  if (const Policy asked = Policy::parse(r.o.policy);
      asked.is_budget() && asked.budget().bytes > 0 && r.predicted_peak > asked.budget().bytes)
    fail(
        "--policy {} is planned on one micro-batch, and this run's step (--accum {}, --nproc {}) peaks at {} under "
        "its plan; give a budget that leaves room for that, or a policy",
        r.o.policy, r.o.accum, r.o.dist.world, bytes_str(r.predicted_peak));
  const ScopedLimit limit(r.o.memory_limit > 0 ? r.o.memory_limit : MemoryTracker::limit());
  const bool resumed = saved.has_value();
  if (saved) {
    r.step = read_header(resume_dir, [&] {
      restore(r, *saved, resume_dir);
      return saved->header.at("step").get<int64_t>();
    });
    saved.reset();  // restored: the file's tensors (weights, moments) would be held through every step
  }

  if (r.parallel()) check_ranks_agree(r);

  // One writer per run folder; a run saved there since the checks above is not written over.
  std::optional<RunLock> lock;
  if (!r.o.save_dir.empty() && r.leader()) {
    lock.emplace(r.o.save_dir);
    check_state_dir(r.o.save_dir, resume_dir);
  }
  if (r.o.started && r.leader()) r.o.started(r.o, r.step);

  TrainResult result;
  result.policy_text = r.policy_text;
  result.options = r.o;
  result.predicted_peak = r.predicted_peak;
  if (r.buckets) result.buckets = r.buckets->buckets();
  int64_t last_saved = resumed ? r.step : -1;
  int64_t my_peak = 0;
  double last_val = std::numeric_limits<double>::quiet_NaN();
  const auto t_start = Clock::now();
  const size_t restored = r.log.size();
  const double elapsed_before = r.log.empty() ? 0.0 : r.log.back().elapsed_s;  // a resumed run's clock goes on
  while (r.step < r.o.steps) {
    TrainRecord rec = train_step(r, outside, last_saved);
    my_peak = std::max(my_peak, rec.peak_bytes);
    const bool last = r.step == r.o.steps;
    if (r.leader() && (last || (r.o.eval_every > 0 && r.step % r.o.eval_every == 0)))
      last_val = rec.val_loss = val_loss(r);
    const double seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
    rec.elapsed_s = elapsed_before + seconds;
    r.log.push_back(rec);
    if (!r.o.save_dir.empty() && (last || (r.o.save_every > 0 && r.step % r.o.save_every == 0))) {
      save(r);
      last_saved = r.step;
    }
    // A stop saves before the progress line: a hung-up terminal (SIGHUP) fails that write.
    const int stop = last ? 0 : stop_request(r);
    if (stop != 0 && !r.o.save_dir.empty() && last_saved != r.step) save(r);
    if (r.o.progress && r.leader()) report_progress(r, rec, last_val, r.log.size() - restored, seconds);
    if (stop != 0) {
      result.stopped = stop;
      break;
    }
  }
  result.log = std::move(r.log);
  result.restored = restored;
  result.final_val_loss = last_val;
  result.weights_digest = digest(r.params);
  gather_peaks(r, my_peak, result);
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
