// remat::GPT: a transformer whose stages run on the op-level engine under a recompute policy.
//
//   remat::GPT model(cfg, remat::Policy::parse("attn+mlp-act"));
//   at::Tensor loss = model->forward(tokens, targets);   // token models: (B, T) int64 each
//   loss.backward();                                      // trains with torch::optim or remat::Adam
//
// Any block kind (cfg.arch): seed (inputs and targets are (B, T, C) floats, MSE loss, the engine's
// twin of ModuleModel), gpt2, llama and moe (tokens in, cross-entropy out). The model runs the CompiledStep
// compiled from (cfg, policy): each stage is one autograd node, and each uniform:N segment of N
// blocks one node too (run_segment, NOTE [Segments]).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "remat/block.h"
#include "remat/config.h"
#include "remat/executor.h"
#include "remat/policy.h"
#include "remat/schedule.h"

namespace remat {

class GPTImpl : public torch::nn::Module {
 public:
  // Weights as the block kind's parameter roles say (GPT-2's initialisation: normal 0.02, residual
  // projections scaled by 1/sqrt(2L), zero biases, unit norms), drawn from the default generator
  // in registration order. Throws remat::Error for a bad config, a policy that does not resolve for
  // this block kind (budget policies resolve through resolve_policy, resolve.h), or a config the
  // engine does not run (fp32 only on this build).
  GPTImpl(const ModelConfig& cfg, const Policy& policy, ExecOptions options = {});
  // With per-layer choices already made (a plan from planner.h).
  GPTImpl(const ModelConfig& cfg, const ResolvedPolicy& policy, ExecOptions options = {});

  // The mean loss of one batch. Token models: input and target (B, T) int64, ids in [0, vocab);
  // seed: both (B, T, C) float; B, T and C as the config says (remat::Error otherwise). In eval
  // mode (module.eval()) dropout is off and nothing is recomputed.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);

  // Token models: the head's output without its loss, (B, T, V) for (B, T) tokens, without grad
  // and without dropout.
  at::Tensor logits(const at::Tensor& tokens);

  // Switches the recompute policy (weights are kept).
  void set_policy(const Policy& policy);
  void set_policy(const ResolvedPolicy& policy);

  // The configuration it was built for, its blocks' tensor tables, and the per-layer policy it runs.
  const ModelConfig& config() const { return cfg_; }
  const ModelSpec& spec() const { return *spec_; }
  const ResolvedPolicy& policy() const { return policy_; }
  // The compiled training step this model runs (what the memory model replays).
  const CompiledStep& compiled_step() const { return plan_; }
  [[deprecated("renamed compiled_step()")]] const CompiledStep& step_plan() const { return plan_; }

  // Bytes that forward() leaves allocated until backward(), from the tensor table and the compiled
  // schedules: every stage's saved tensors and the stage outputs that the next stage keeps (of a
  // uniform:N segment, its output alone), and the loss. Equals MemoryTracker's measurement on CPU.
  int64_t predicted_saved_bytes() const;

  // Per-op times of the block stage (summed over layers), when options.timer was given.
  std::shared_ptr<OpTimes> block_times() const { return options_.timer; }

  // Parameters of block `layer` in its BlockSpec's order.
  std::vector<at::Tensor> block_params(int64_t layer) const;
  // For each of parameters(): whether AdamW's weight decay applies (the parameter's role).
  std::vector<bool> decays() const;

  // From now on the backward hands every parameter gradient to `sink` (with its index in
  // parameters()) instead of accumulating it into .grad: data parallelism's buckets. Null: autograd.
  void set_grad_sink(GradSink sink);

 private:
  void build_executors();
  std::vector<at::Tensor> stage_params(const CompiledStage& stage) const;

  ModelConfig cfg_;
  std::shared_ptr<const ModelSpec> spec_;
  ResolvedPolicy policy_;
  CompiledStep plan_;
  ExecOptions options_;
  std::vector<at::Tensor> params_;                                 // by model parameter id
  std::vector<std::shared_ptr<const BlockExecutor>> execs_;        // by stage
  std::vector<std::shared_ptr<const BlockExecutor>> first_execs_;  // by stage: a segment's first forward, or null
  std::shared_ptr<const GradSink> sink_;
  // Eval mode: the same stages without dropout, keeping everything; and the logits head.
  CompiledStep eval_plan_;
  std::vector<std::shared_ptr<const BlockExecutor>> eval_execs_;
  std::shared_ptr<const BlockExecutor> logits_exec_;
};
TORCH_MODULE(GPT);

// Throws remat::Error unless the engine runs `cfg` on this build (validate(cfg); fp32; tp, cp, ep
// and etp 1; neither eager_ops nor deterministic): what GPT's constructor checks first, without
// building anything.
void check_engine(const ModelConfig& cfg);

// A batch of random data for `cfg`, from the default generator: (B, T) token ids for input and
// target (token models), or (B, T, C) floats (seed).
std::pair<at::Tensor, at::Tensor> random_batch(const ModelConfig& cfg);

}  // namespace remat
