#include "remat/optim.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "remat/error.h"
#include "util/parallel.h"

namespace remat {

namespace {

void check_lr(const char* who, double lr) {
  if (!(lr >= 0 && std::isfinite(lr))) fail("{}: lr must be finite and >= 0, got {}", who, lr);
}

void check_steps(const char* who, int64_t steps) {
  if (steps < 0) fail("{}: steps must be >= 0 (the bias corrections' count), got {}", who, steps);
}

// The options, and each parameter a contiguous float32 CPU tensor (the update is a CPU loop).
void check(const char* who, const AdamOptions& o, const std::vector<at::Tensor>& params) {
  check_lr(who, o.lr);
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
    fail("{}: beta1 and beta2 must be in [0, 1), got {} and {}", who, o.beta1, o.beta2);
  // 0 would divide 0 by 0 for a parameter whose gradient and moments are all 0 (an unused token row).
  // (The update runs in float32: an eps that rounds to 0 there is 0.)
  if (!(o.eps > 0 && std::isfinite(o.eps) && static_cast<float>(o.eps) > 0))
    fail("{}: eps must be finite and > 0 in float32, got {}", who, o.eps);
  if (!(o.weight_decay >= 0 && std::isfinite(o.weight_decay)))
    fail("{}: weight_decay must be finite and >= 0, got {}", who, o.weight_decay);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.defined()) fail("{}: parameter {} is an undefined tensor", who, i);
    if (p.scalar_type() != at::kFloat || !p.is_contiguous() || !p.device().is_cpu())
      fail("{}: parameter {} is {} on {} (contiguous={}); it needs contiguous float32 on the CPU", who, i,
           c10::toString(p.scalar_type()), p.device().str(), p.is_contiguous());
  }
}

// A gradient for parameter i: float32 with the parameter's element count.
void check_grad(const char* who, size_t i, const at::Tensor& g, int64_t numel) {
  if (!g.defined()) fail("{}: parameter {} has no gradient; give one for every parameter", who, i);
  if (g.scalar_type() != at::kFloat || g.numel() != numel || !g.device().is_cpu())
    fail("{}: the gradient of parameter {} is {} {} on {}; it needs float32 with {} elements on the CPU", who, i,
         c10::toString(g.scalar_type()), g.sizes(), g.device().str(), numel);
}

}  // namespace

Adam::Adam(std::vector<at::Tensor> params, const AdamOptions& options) : params_(std::move(params)), options_(options) {
  check("remat::Adam", options_, params_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    m_.push_back(at::zeros_like(p));
    v_.push_back(at::zeros_like(p));
  }
  updates_.assign(params_.size(), 0);
}

void Adam::set_lr(double lr) {
  check_lr("remat::Adam::set_lr", lr);
  options_.lr = lr;
}

void Adam::set_steps(int64_t steps) {
  check_steps("remat::Adam::set_steps", steps);
  steps_ = steps;
  updates_.assign(params_.size(), steps);
}

void ShardedAdam::set_lr(double lr) {
  check_lr("remat::ShardedAdam::set_lr", lr);
  options_.lr = lr;
}

void ShardedAdam::set_steps(int64_t steps) {
  check_steps("remat::ShardedAdam::set_steps", steps);
  steps_ = steps;
}

namespace detail {

AdamStep adam_step(const AdamOptions& o, int64_t step, double weight_decay) {
  AdamStep s;
  s.b1 = static_cast<float>(o.beta1);
  s.b2 = static_cast<float>(o.beta2);
  s.eps = static_cast<float>(o.eps);
  s.lr = static_cast<float>(o.lr);
  const float wd = static_cast<float>(weight_decay);
  s.step_size = s.lr / static_cast<float>(1.0 - std::pow(o.beta1, step));
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(o.beta2, step)));
  s.decay = o.decoupled ? 1.0f - s.lr * wd : 1.0f;
  s.l2 = o.decoupled ? 0.0f : wd;
  return s;
}

namespace {

// No FMA in any clone (avx2 does not imply it, and avx512f is not offered): the bits are those of
// the plain x86-64 loop on every CPU.
__attribute__((target_clones("avx2", "default"))) void adam_range(const AdamStep& s, float* __restrict w,
                                                                  const float* __restrict g, float* __restrict m,
                                                                  float* __restrict v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float gj = g[j] + s.l2 * w[j];
    const float mj = s.b1 * m[j] + (1.0f - s.b1) * gj;
    const float vj = s.b2 * v[j] + (1.0f - s.b2) * gj * gj;
    m[j] = mj;
    v[j] = vj;
    w[j] = w[j] * s.decay - s.step_size * mj / (std::sqrt(vj) * s.inv_sqrt_bc2 + s.eps);
  }
}

}  // namespace

// Elementwise, so any split over remat's kernel threads gives the same bits: 18.9 M parameters of
// the seed model are ~530 MB of traffic a step, which one core does not stream at full speed.
void adam_update(const AdamStep& s, float* w, const float* g, float* m, float* v, int64_t n) {
  parallel_chunks(n, int64_t{1} << 16, [&](int64_t b, int64_t e) { adam_range(s, w + b, g + b, m + b, v + b, e - b); });
}

}  // namespace detail

void Adam::step() {
  ++steps_;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    check_grad("remat::Adam", i, grad, p.numel());
    const detail::AdamStep s = detail::adam_step(options_, ++updates_[i], options_.weight_decay);
    const at::Tensor g = grad.contiguous();
    at::NoGradGuard no_grad;
    detail::adam_update(s, p.data_ptr<float>(), g.data_ptr<float>(), m_[i].data_ptr<float>(), v_[i].data_ptr<float>(),
                        p.numel());
  }
}

ShardedAdam::ShardedAdam(std::vector<at::Tensor> params, std::vector<bool> decays, const AdamOptions& options,
                         int64_t first, int64_t last)
    : params_(std::move(params)), decays_(std::move(decays)), options_(options), first_(first), last_(last) {
  if (decays_.size() != params_.size())
    fail("remat::ShardedAdam: {} decay flags for {} parameters; give one per parameter", decays_.size(),
         params_.size());
  check("remat::ShardedAdam", options_, params_);
  int64_t flat = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const int64_t begin = std::max(first, flat), end = std::min(last, flat + p.numel());
    if (begin < end) slices_.push_back({static_cast<int>(i), begin - flat, end - flat, begin});
    flat += p.numel();
  }
  if (first < 0 || first > last || last > flat)
    fail("remat::ShardedAdam: the range [{}, {}) must lie in the parameters' {} elements, first <= last", first, last,
         flat);
  m_ = at::zeros({last - first});
  v_ = at::zeros({last - first});
}

void ShardedAdam::step(const std::vector<at::Tensor>& grads) {
  if (grads.size() != params_.size())
    fail("remat::ShardedAdam::step: {} gradients for {} parameters; give one per parameter", grads.size(),
         params_.size());
  for (size_t i = 0; i < grads.size(); ++i) check_grad("remat::ShardedAdam::step", i, grads[i], params_[i].numel());
  ++steps_;
  at::NoGradGuard no_grad;
  for (const Slice& s : slices_) {
    const detail::AdamStep c = detail::adam_step(options_, steps_, decays_[s.param] ? options_.weight_decay : 0.0);
    const at::Tensor g = grads[s.param].contiguous();
    detail::adam_update(c, params_[s.param].data_ptr<float>() + s.begin, g.data_ptr<float>() + s.begin,
                        m_.data_ptr<float>() + (s.flat - first_), v_.data_ptr<float>() + (s.flat - first_),
                        s.end - s.begin);
  }
}

void Adam::zero_grad() {
  for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
}

}  // namespace remat
