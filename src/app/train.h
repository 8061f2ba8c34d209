// remat train: train a GPT (gpt2 blocks, byte tokens) on text with any recompute policy.
//
//   remat::TrainOptions o;                       // defaults: ~10 minutes on 2 cores
//   o.policy = "attn+mlp-act";
//   o.save_dir = "runs/a";
//   remat::TrainResult r = remat::train(o);      // r.log: loss, val loss, tokens/s, peak memory
//
// The policy changes memory and time, never the result: the loss trajectory is bitwise the same
// under every policy, and a run resumed from its saved state continues it bitwise.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "remat/config.h"
#include "remat/data_parallel.h"
#include "remat/runtime.h"

namespace remat {

struct TrainProgress {
  int64_t step = 0, steps = 0;
  double loss = 0;
  double val_loss = std::numeric_limits<double>::quiet_NaN();  // the latest, NaN before the first
  double tokens_per_s = 0;
  int64_t peak_bytes = 0;  // this step's true peak: weights, optimizer, activations, gradients
  double eta_s = 0;
};

struct TrainOptions {
  ModelConfig model;            // a token model (gpt2, llama); vocab 256 (bytes) is forced; see default_train_model()
  std::string policy = "none";  // any policy, budget: included
  std::string data;             // a text file; "" = Debian's English fortunes (/usr/share/games/fortunes)
  int64_t steps = 1500;         // optimizer steps
  int64_t accum = 1;            // micro-batches per step, gradients accumulated
  double lr = 3e-3;             // peak learning rate
  double min_lr = 3e-4;         // the cosine schedule's floor
  int64_t warmup = 100;         // linear warm-up steps
  double weight_decay = 0.1;    // AdamW, on weight matrices only
  double beta1 = 0.9, beta2 = 0.95;
  double clip = 1.0;          // global gradient-norm clip; 0 = off
  int64_t eval_every = 100;   // validation loss every N steps and at the end; 0 = only at the end
  int64_t eval_batches = 8;   // batches of the held-out text per validation
  double val_fraction = 0.1;  // the corpus tail held out for validation
  uint64_t seed = 1234;       // weights, batches, dropout
  std::string save_dir;       // where the train state goes ("" = nowhere)
  int64_t save_every = 0;     // steps between saves; 0 = only at the end
  ThreadConfig threads = default_threads();
  // Data parallelism: this process is rank dist.rank of dist.world (world 1: one process). Each rank
  // trains on its own micro-batches of every step, `accum` of them, and the gradients are summed
  // over ranks: world ranks with accum 1 take the steps one process takes with accum = world.
  DistConfig dist;
  int zero = 0;                    // 1: ZeRO-1, each rank keeps the Adam moments of its share only
  int64_t bucket_bytes = 2 << 20;  // gradient buckets close at the first stage boundary past this
  // Bytes of tensor storage this process may hold (MemoryTracker::set_limit), as a GPU's memory
  // would bound it; 0 = this machine's memory. A policy whose exact prediction is over it is refused
  // before the first step; an allocation over it during a step stops the run with a report of the
  // policy, the bytes the step needed and the plan that fits.
  int64_t memory_limit = 0;
  std::function<void(const TrainProgress&)> progress;  // called after every step on rank 0; may be empty
  // Called once on rank 0 before the first step, with the options the run trains with (on --resume,
  // the saved run's, not the defaults of the flags left out) and the step it starts at. May be empty.
  std::function<void(const TrainOptions&, int64_t first_step)> started;
  // Polled once per step: 0 goes on; another value (the CLI gives a signal's number) ends the run
  // after that step, saving its state first when save_dir is set (TrainResult::stopped). The ranks
  // of a parallel run vote each step and all stop after the same one with the largest value any
  // gave (a rank without it votes 0). May be empty.
  std::function<int()> should_stop;
};

// The default shape for `remat train`: 4 layers, dim 256, 8 heads, batch 16, seq 128.
ModelConfig default_train_model();

struct TrainRecord {
  int64_t step = 0;  // optimizer steps done
  double lr = 0;
  double loss = 0;  // mean over the step's micro-batches, of every rank
  double val_loss = std::numeric_limits<double>::quiet_NaN();
  double tokens_per_s = 0;
  int64_t peak_bytes = 0;
  double elapsed_s = 0;
  // Data parallelism: seconds the gradient all-reduces ran (first launch to last finish), and
  // what of that the backward did not hide (the optimizer waited).
  double reduce_s = 0, exposed_s = 0;
};

struct TrainResult {
  std::vector<TrainRecord> log;  // one record per step of the run: a resumed run's saved ones first
  size_t restored = 0;           // how many of them came from the saved run (measured by another process)
  int stopped = 0;               // what TrainOptions::should_stop gave (the ranks' largest) when it ended the
                                 // run early, its state saved with save_dir; 0: not stopped
  double final_val_loss = 0;
  std::string weights_digest;           // remat::digest of the final weights
  std::string policy_text;              // the policy as resolved (a budget shows the plan)
  int64_t predicted_peak = 0;           // the memory model's total peak for one step, of this rank
  std::vector<int64_t> rank_peaks;      // measured peak of each rank (its largest step), on rank 0
  std::vector<int64_t> rank_predicted;  // and predicted
  int buckets = 0;                      // gradient buckets (data parallelism)
  TrainOptions options;                 // what ran: a resume's are the saved run's where the caller left them out

  std::string csv() const;
  // Training and validation loss against step (.png or .svg).
  void write_chart(const std::string& path, const std::string& title) const;
};

// The global norm of the gradients: their squares summed in float64, in the order given (every
// rank holds the same summed gradients, so every rank computes the same norm). Without allocating:
// a step's memory is predicted to the byte. train() clips at it (--clip) and stops before an
// update when it is not finite.
double gradient_norm(const std::vector<at::Tensor>& grads);

// Throws remat::Error naming the first bad option (a count, a rate, a policy that does not parse, a
// float-data arch, a ZeRO stage for the world size, a --save folder this process cannot write or
// that holds another saved run than `resume_dir`: checked before any step). train() calls it; the CLI also calls it
// before it may re-execute itself for the BLAS kernel.
void check_train_options(const TrainOptions& options, const std::string& resume_dir = "");

// Refuses, before a model is built or anything measured, a policy that names no budget and whose step
// is predicted to peak over TrainOptions.memory_limit or over what this machine may take: the rule
// train() applies to the model it builds. A budget policy is planned, and guarded, by train(); one
// that no policy meets is refused here (check_policy).
void check_train_memory(const TrainOptions& options);

// A resumed run's options as train() resolves them before its first step: the saved run's
// (resume_dir/state.bin) with the `explicit_flags` of `given` (their long names), checked: a flag
// that would change the trajectory, a run that has finished its steps, check_train_options.
// Throws remat::Error (usage) naming the flag or the folder. `remat train --nproc` calls it once
// before it starts the ranks, so that a refusal reads as one process's.
TrainOptions check_resume(const TrainOptions& given, const std::string& resume_dir,
                          const std::vector<std::string>& explicit_flags);

// Bounds on counts that multiply a step's work: micro-batches per step and validation batches.
inline constexpr int64_t kMaxAccum = 65536;
inline constexpr int64_t kMaxEvalBatches = 65536;

// Runs training, or continues the run saved in `resume_dir`. When resuming, the saved options
// are used; `explicit_flags` names the options the user gave on the command line ("dim", "lr"), and
// any of them that would change the trajectory must equal the saved value. The policy, the saving
// and the validation cadence may change. Throws remat::Error for bad options, a corrupt or
// mismatched train state, a policy whose predicted peak does not fit this machine's memory (the
// message suggests a budget), and a NaN or infinite loss (the last good state is kept).
TrainResult train(const TrainOptions& options, const std::string& resume_dir = "",
                  const std::vector<std::string>& explicit_flags = {});

// The dropout seed of micro-batch `micro` of `step` (micro counts over all ranks): a pure function,
// so any rank of any world size draws what one process would.
uint64_t dropout_seed(uint64_t seed, int64_t step, int64_t micro);

// The options a train state recorded (its header's "options"), over `base` for the rest.
TrainOptions options_from(const nlohmann::json& saved, TrainOptions base);

// The most bytes one `remat sample` generates (each is a forward of the whole model).
inline constexpr int64_t kMaxSampleTokens = 1000000;

struct SampleOptions {
  std::string prompt;        // "" starts from a newline
  int64_t tokens = 300;      // bytes to generate, 0..kMaxSampleTokens
  double temperature = 0.8;  // > 0
  int64_t top_k = 40;        // 0 = all 256
  uint64_t seed = 1;
  // Called about once a second with the bytes generated so far and the total; may be empty.
  std::function<void(int64_t done, int64_t total)> progress;
};

// Throws remat::Error naming the first bad option (temperature, top-k, tokens); sample() calls it.
void check_sample_options(const SampleOptions& options);

// Generates text with the weights saved in `dir`. Returns the prompt followed by the new bytes.
std::string sample(const std::string& dir, const SampleOptions& options);

}  // namespace remat
