#include "remat/module_model.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "remat/block.h"
#include "remat/checkpoint.h"
#include "remat/error.h"

namespace remat {

namespace {

struct SeedBlockImpl : torch::nn::Module {
  SeedBlockImpl(int64_t dim, int64_t heads, int64_t hidden)
      : attn(register_module("attn", torch::nn::MultiheadAttention(dim, heads))),
        fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor a = std::get<0>(attn->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false));
    at::Tensor h = x + a;
    return h + fc2->forward(fc1->forward(h).relu());
  }

  std::vector<at::Tensor> params() const {
    return {attn->in_proj_weight, attn->in_proj_bias, attn->out_proj->weight,
            attn->out_proj->bias, fc1->weight,        fc1->bias,
            fc2->weight,          fc2->bias};
  }

  torch::nn::MultiheadAttention attn;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(SeedBlock);

// A run of consecutive layers [first, last]; a checkpointed run keeps only its input.
struct Run {
  int64_t first, last;
  bool checkpointed;
};

std::vector<Run> plan_runs(const ModelConfig& cfg, const Policy& policy) {
  validate(cfg);
  if (cfg.arch != "seed")
    fail("the module path builds the seed model only, got ModelConfig.arch {}; run {} on the ops engine", cfg.arch,
         cfg.arch);
  const BlockSpec spec = make_block(cfg);
  const ResolvedPolicy resolved = policy.resolve(spec, cfg.layers);
  std::vector<Run> runs;
  if (resolved.segment > 0) {
    for (int64_t first = 0; first < cfg.layers; first += resolved.segment)
      runs.push_back({first, std::min(first + resolved.segment, cfg.layers) - 1, true});
  } else {
    for (int64_t i = 0; i < cfg.layers; ++i) {
      const LayerPolicy& lp = resolved.layers[i];
      if (!lp.keeps_all(spec) && !lp.drops_all(spec))
        fail(
            "policy '{}' recomputes only some tensors of layer {} ({}); the module path checkpoints "
            "whole layers (none, full, every:K, block:N, uniform:N); run it on the ops engine",
            policy.text(), i, lp.dropped_names(spec));
      runs.push_back({i, i, lp.drops_all(spec)});
    }
  }
  return runs;
}

}  // namespace

struct ModuleModel::Impl {
  std::vector<SeedBlock> blocks;
  std::vector<Run> runs;
};

void ModuleModel::check(const ModelConfig& cfg, const Policy& policy) { plan_runs(cfg, policy); }

ModuleModel::ModuleModel(const ModelConfig& cfg, const Policy& policy) : impl_(std::make_unique<Impl>()) {
  impl_->runs = plan_runs(cfg, policy);
  for (int64_t i = 0; i < cfg.layers; ++i) impl_->blocks.push_back(SeedBlock(cfg.dim, cfg.heads, cfg.hidden()));
}

ModuleModel::~ModuleModel() = default;
ModuleModel::ModuleModel(ModuleModel&&) noexcept = default;
ModuleModel& ModuleModel::operator=(ModuleModel&&) noexcept = default;

at::Tensor ModuleModel::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (const Run& run : impl_->runs) {
    if (!run.checkpointed) {
      for (int64_t i = run.first; i <= run.last; ++i) h = impl_->blocks[i]->forward(h);
      continue;
    }
    std::vector<at::Tensor> params;
    std::vector<SeedBlock> blocks;
    for (int64_t i = run.first; i <= run.last; ++i) {
      blocks.push_back(impl_->blocks[i]);
      for (const at::Tensor& p : impl_->blocks[i]->params()) params.push_back(p);
    }
    h = checkpoint(
        [blocks](const at::Tensor& in) mutable {
          at::Tensor t = in;
          for (SeedBlock& b : blocks) t = b->forward(t);
          return t;
        },
        h, params);
  }
  return h;
}

std::vector<at::Tensor> ModuleModel::parameters() const {
  std::vector<at::Tensor> all;
  for (const SeedBlock& b : impl_->blocks)
    for (const at::Tensor& p : b->params()) all.push_back(p);
  return all;
}

std::vector<bool> ModuleModel::checkpointed() const {
  std::vector<bool> flags(impl_->blocks.size());
  for (const Run& run : impl_->runs)
    for (int64_t i = run.first; i <= run.last; ++i) flags[i] = run.checkpointed;
  return flags;
}

}  // namespace remat
