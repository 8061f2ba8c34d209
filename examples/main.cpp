// The README's library example, built as another project would build it: checkpoint a LibTorch
// module, then train a GPT on the op-level engine under a per-tensor policy, and check that the
// policy changed the memory and not the gradients.
#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "remat/checkpoint.h"
#include "remat/memory.h"
#include "remat/model.h"

int main() {
  remat::MemoryTracker::install();  // first thing: every tensor after this is counted

  // 1. Checkpoint any callable: only x is kept; the block's parameters still get gradients.
  torch::nn::Linear block(64, 64);
  at::Tensor x = at::randn({8, 64});
  at::Tensor y =
      remat::checkpoint([&](const at::Tensor& in) { return block->forward(in).relu(); }, x, block->parameters());
  y.sum().backward();
  std::printf("checkpoint: weight gradient defined: %s\n", block->weight.grad().defined() ? "yes" : "no");

  // 2. A GPT on the op-level engine, with a per-tensor policy.
  remat::ModelConfig cfg;
  cfg.arch = "gpt2";
  cfg.layers = 2, cfg.dim = 64, cfg.heads = 4, cfg.batch = 2, cfg.seq = 64;
  auto grads = [&](const char* policy, int64_t* saved, int64_t* predicted) {
    at::manual_seed(1);
    remat::GPT model(cfg, remat::Policy::parse(policy));
    at::manual_seed(2);
    auto [tokens, targets] = remat::random_batch(cfg);
    remat::MemoryScope scope;
    at::Tensor loss = model->forward(tokens, targets);
    *saved = scope.delta();
    *predicted = model->predicted_saved_bytes();
    loss.backward();
    std::vector<at::Tensor> g;
    for (const at::Tensor& p : model->parameters()) g.push_back(p.grad());
    return g;
  };
  int64_t saved_none, pred_none, saved_attn, pred_attn;
  const auto none = grads("none", &saved_none, &pred_none);
  const auto attn = grads("attn+mlp-act", &saved_attn, &pred_attn);
  bool equal = none.size() == attn.size();
  for (size_t i = 0; equal && i < none.size(); ++i)
    equal = std::memcmp(none[i].data_ptr(), attn[i].data_ptr(), none[i].nbytes()) == 0;
  std::printf("GPT: saved %lld bytes under none (predicted %lld), %lld under attn+mlp-act (predicted %lld)\n",
              static_cast<long long>(saved_none), static_cast<long long>(pred_none), static_cast<long long>(saved_attn),
              static_cast<long long>(pred_attn));
  std::printf("GPT: gradients bitwise equal: %s\n", equal ? "yes" : "no");
  const bool ok = block->weight.grad().defined() && equal && saved_none == pred_none && saved_attn == pred_attn &&
                  saved_attn < saved_none;
  std::printf("%s\n", ok ? "example: ok" : "example: FAILED");
  return ok ? 0 : 1;
}
