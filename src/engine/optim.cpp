#include "remat/optim.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "util/parallel.h"

namespace remat {

Adam::Adam(std::vector<at::Tensor> params, const AdamOptions& options) : params_(std::move(params)), options_(options) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (p.scalar_type() != at::kFloat || !p.is_contiguous())
      fail("remat::Adam: parameter {} is {} (contiguous={}); it needs contiguous float32", i,
           c10::toString(p.scalar_type()), p.is_contiguous());
    m_.push_back(at::zeros_like(p));
    v_.push_back(at::zeros_like(p));
  }
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
  const detail::AdamStep s = detail::adam_step(options_, steps_, options_.weight_decay);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
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
    REMAT_INTERNAL("ShardedAdam has {} decay flags for {} parameters", decays_.size(), params_.size());
  int64_t flat = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (p.scalar_type() != at::kFloat || !p.is_contiguous())
      fail("remat::ShardedAdam: parameter {} is {} (contiguous={}); it needs contiguous float32", i,
           c10::toString(p.scalar_type()), p.is_contiguous());
    const int64_t begin = std::max(first, flat), end = std::min(last, flat + p.numel());
    if (begin < end) slices_.push_back({static_cast<int>(i), begin - flat, end - flat, begin});
    flat += p.numel();
  }
  if (first < 0 || first > last || last > flat)
    REMAT_INTERNAL("ShardedAdam range [{}, {}) of {} elements", first, last, flat);
  m_ = at::zeros({last - first});
  v_ = at::zeros({last - first});
}

void ShardedAdam::step(const std::vector<at::Tensor>& grads) {
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
