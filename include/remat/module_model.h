// The seed note's model on LibTorch modules ("the module path").
//
// N blocks of torch::nn::MultiheadAttention(dim, heads) and an FFN Linear(dim, hidden), ReLU,
// Linear(hidden, dim), each with a residual, no norm. Whole layers are checkpointed with
// remat::checkpoint as a whole-layer policy says: none, full, every:K, block:N, uniform:N,
// layers:I-J=full. Per-tensor policies (attn, mlp-act, ...) need the op-level engine.
//
//   remat::ModuleModel model(cfg, remat::Policy::parse("every:2"));
//   at::Tensor y = model.forward(x);            // x: (T, B, C), as MultiheadAttention expects
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/config.h"
#include "remat/policy.h"

namespace remat {

class ModuleModel {
 public:
  // Builds cfg.layers seed blocks with LibTorch's default initialisation (seed it first with
  // at::manual_seed for reproducible weights). Throws remat::Error if cfg.arch is not seed or if
  // the policy chooses per tensor inside a layer.
  ModuleModel(const ModelConfig& cfg, const Policy& policy);
  // The same checks as the constructor, without building anything.
  static void check(const ModelConfig& cfg, const Policy& policy);
  ~ModuleModel();
  ModuleModel(ModuleModel&&) noexcept;
  ModuleModel& operator=(ModuleModel&&) noexcept;

  // (T, B, C) -> (T, B, C).
  at::Tensor forward(const at::Tensor& x);

  // All parameters; per block in the engine's order: qkv.weight, qkv.bias, proj.weight, proj.bias,
  // fc.weight, fc.bias, mlp.weight, mlp.bias (MultiheadAttention's in_proj is q, k, v stacked).
  std::vector<at::Tensor> parameters() const;

  // For each layer: true when it runs under remat::checkpoint (alone or as part of a chunk).
  std::vector<bool> checkpointed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remat
