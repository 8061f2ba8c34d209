// remat::Adam: Adam and AdamW as one fused pass over each parameter.
//
// LibTorch 1.13's C++ torch::optim::Adam runs about ten ATen ops per parameter, each allocating a
// temporary; on the seed model (19M parameters) its step took 400 ms here against 14 ms for this
// loop. Same update rule as torch.optim.Adam / AdamW (bias-corrected, eps outside the sqrt).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace remat {

struct AdamOptions {
  double lr = 1e-3;            // learning rate
  double beta1 = 0.9;          // first-moment decay
  double beta2 = 0.999;        // second-moment decay
  double eps = 1e-8;           // added to sqrt(v_hat)
  double weight_decay = 0.0;   // 0 = none
  bool decoupled = false;      // true: AdamW (p -= lr * wd * p); false: L2 added to the gradient
};

class Adam {
 public:
  // REQUIRES: every param is a float32 leaf tensor.
  Adam(std::vector<at::Tensor> params, const AdamOptions& options);

  // One update of every parameter whose grad is defined.
  void step();
  // Sets every grad to undefined, freeing it (PyTorch's set_to_none=True).
  void zero_grad();

  double lr() const { return options_.lr; }
  void set_lr(double lr) { options_.lr = lr; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // First and second moments, one pair per parameter (for checkpoints).
  std::vector<at::Tensor>& exp_avg() { return m_; }
  std::vector<at::Tensor>& exp_avg_sq() { return v_; }

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> m_, v_;
  AdamOptions options_;
  int64_t steps_ = 0;
};

}  // namespace remat
