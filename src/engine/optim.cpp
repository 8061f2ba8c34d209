#include "remat/optim.h"

#include <cmath>

#include <ATen/ATen.h>

#include "remat/error.h"

namespace remat {

Adam::Adam(std::vector<at::Tensor> params, const AdamOptions& options)
    : params_(std::move(params)), options_(options) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (p.scalar_type() != at::kFloat || !p.is_contiguous())
      fail("remat::Adam: parameter {} is {} (contiguous={}); it needs contiguous float32", i,
           c10::toString(p.scalar_type()), p.is_contiguous());
    m_.push_back(at::zeros_like(p));
    v_.push_back(at::zeros_like(p));
  }
}

void Adam::step() {
  ++steps_;
  const float b1 = static_cast<float>(options_.beta1);
  const float b2 = static_cast<float>(options_.beta2);
  const float eps = static_cast<float>(options_.eps);
  const float lr = static_cast<float>(options_.lr);
  const float wd = static_cast<float>(options_.weight_decay);
  const float step_size = lr / static_cast<float>(1.0 - std::pow(options_.beta1, steps_));
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(options_.beta2, steps_)));
  const bool decoupled = options_.decoupled;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    const at::Tensor g_c = grad.contiguous();
    at::NoGradGuard no_grad;
    float* __restrict w = p.data_ptr<float>();
    const float* __restrict g = g_c.data_ptr<float>();
    float* __restrict m = m_[i].data_ptr<float>();
    float* __restrict v = v_[i].data_ptr<float>();
    const int64_t n = p.numel();
    const float decay = decoupled ? 1.0f - lr * wd : 1.0f;
    const float l2 = decoupled ? 0.0f : wd;
    for (int64_t j = 0; j < n; ++j) {
      const float gj = g[j] + l2 * w[j];
      const float mj = b1 * m[j] + (1.0f - b1) * gj;
      const float vj = b2 * v[j] + (1.0f - b2) * gj * gj;
      m[j] = mj;
      v[j] = vj;
      w[j] = w[j] * decay - step_size * mj / (std::sqrt(vj) * inv_sqrt_bc2 + eps);
    }
  }
}

void Adam::zero_grad() {
  for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
}

}  // namespace remat
