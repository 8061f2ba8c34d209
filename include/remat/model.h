// remat::GPT: a transformer whose stages run on the op-level engine under a recompute policy.
//
//   remat::GPT model(cfg, remat::Policy::parse("attn+mlp-act"));
//   at::Tensor loss = model->forward(tokens, targets);   // gpt2: (B, T) int64 each
//   loss.backward();                                      // trains with torch::optim or remat::Adam
//
// cfg.arch = gpt2: token + position embedding, cfg.layers pre-LN blocks, final LayerNorm, LM head
// tied to the embedding, cross-entropy. cfg.arch = seed: the seed note's stack (inputs are (B, T, C)
// floats, the loss is MSE to a (B, T, C) target), the engine's twin of ModuleModel.
// Each stage is one autograd node; a uniform:N policy wraps chunks of N blocks in remat::checkpoint.
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

namespace remat {

class GPTImpl : public torch::nn::Module {
 public:
  // Weights: GPT-2's initialisation (normal 0.02, residual projections scaled by 1/sqrt(2L), zero
  // biases, unit norms), drawn from the default generator. Throws remat::Error for a bad config or
  // a policy that does not resolve for this block kind.
  GPTImpl(const ModelConfig& cfg, const Policy& policy, ExecOptions options = {});
  // With per-layer choices already made (a plan from planner.h).
  GPTImpl(const ModelConfig& cfg, const ResolvedPolicy& policy, ExecOptions options = {});

  // The mean loss of one batch. gpt2: input and target (B, T) int64; seed: both (B, T, C) float.
  // In eval mode (module.eval()) dropout is off.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& target);

  // gpt2: the LM head's output (B, T, V) for (B, T) tokens, without grad and without dropout.
  at::Tensor logits(const at::Tensor& tokens);

  // Switches the recompute policy (weights are kept).
  void set_policy(const Policy& policy);
  void set_policy(const ResolvedPolicy& policy);

  const ModelConfig& config() const { return cfg_; }
  const ModelSpec& spec() const { return spec_; }
  const ResolvedPolicy& policy() const { return policy_; }

  // Bytes that forward() leaves allocated until backward(), from the tensor table and the compiled
  // schedules: every stage's saved tensors, the stage outputs that the next stage keeps, the loss,
  // and the RNG states of checkpointed chunks. Equals MemoryTracker's measurement on CPU.
  int64_t predicted_saved_bytes() const;

  // Per-op times of the block stage (summed over layers), when options.timer was given.
  std::shared_ptr<OpTimes> block_times() const { return options_.timer; }

  // Parameters of stage `layer` in its BlockSpec's order (tied ones included).
  std::vector<at::Tensor> block_params(int64_t layer) const;

 private:
  void build_executors();

  ModelConfig cfg_;
  ModelSpec spec_;
  ResolvedPolicy policy_;
  ExecOptions options_;
  std::vector<at::Tensor> stem_params_, head_params_;
  std::vector<std::vector<at::Tensor>> block_params_;
  std::shared_ptr<const BlockExecutor> stem_exec_, head_exec_;
  std::vector<std::shared_ptr<const BlockExecutor>> block_exec_;
  // Eval mode, when the model has dropout: the same stages with it removed (no parameters change).
  std::shared_ptr<const BlockExecutor> eval_stem_exec_, eval_block_exec_, eval_head_exec_;
};
TORCH_MODULE(GPT);

// A batch of random data for `cfg`, from the default generator: (B, T) token ids for input and
// target (gpt2), or (B, T, C) floats (seed).
std::pair<at::Tensor, at::Tensor> random_batch(const ModelConfig& cfg);

}  // namespace remat
