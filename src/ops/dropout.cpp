// dropout: y = x * mask / (1 - p). Backward reads the mask only.
//
// The mask op has no inputs: the CPU mask is a counter-based hash of (seed, element index)
// (ops/kernels.h), so a recompute regenerates it exactly, in any order, from an 8-byte seed.
#include <algorithm>

#include <ATen/ATen.h>

#ifdef REMAT_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "ops/kernels.h"
#include "ops/op_env.h"
#include "remat/error.h"
#include "remat/ops.h"

namespace remat::ops {

at::Tensor dropout_mask(at::IntArrayRef shape, double p, uint64_t seed, at::Device device) {
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(at::kBool).device(device));
  if (device.is_cpu()) {
    kernels::dropout_mask(mask.data_ptr<bool>(), mask.numel(), p, seed);
  } else {
#ifdef REMAT_CUDA
    at::Generator gen = at::make_generator<at::CUDAGeneratorImpl>(device.index());
    gen.set_current_seed(seed);
    mask.bernoulli_(1.0 - p, gen);
#else
    fail("dropout on {} needs a CUDA build of remat", device.str());
#endif
  }
  return mask;
}

// y = x * mask / (1 - p), into y (x itself allowed) or a new tensor. CPU float32 runs one loop;
// elsewhere at::mul, which first converts the mask to x's dtype (a temporary the size of x;
// block.cpp's scratch bytes assume the CPU path).
at::Tensor apply_mask(const at::Tensor& x, const at::Tensor& mask, double p, at::Tensor y = {}) {
  const double scale = 1.0 / (1.0 - p);
  if (!y.defined()) y = at::empty_like(x);
  if (x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && mask.is_contiguous() &&
      y.is_contiguous()) {
    kernels::dropout_apply(x.data_ptr<float>(), mask.data_ptr<bool>(), static_cast<float>(scale), y.data_ptr<float>(),
                           x.numel());
    return y;
  }
  return at::mul_out(y, x, mask).mul_(scale);
}

at::Tensor dropout_forward(const at::Tensor& x, const at::Tensor& mask, double p) { return apply_mask(x, mask, p); }

at::Tensor dropout_backward(const at::Tensor& dy, const at::Tensor& mask, double p, at::Tensor dx) {
  return apply_mask(dy, mask, p, std::move(dx));
}

}  // namespace remat::ops

namespace remat::detail {
namespace {

void mask_fwd(OpEnv& e, const OpNode& op) {
  e.set_out(op, 0, ops::dropout_mask(e.out_shape(op, 0), op.p, e.seed(op), e.device()));
}
void mask_bwd(OpEnv&, const OpNode&) {}  // no inputs, nothing to propagate

void forward(OpEnv& e, const OpNode& op) { e.set_out(op, 0, ops::dropout_forward(e.in(op, 0), e.in(op, 1), op.p)); }
void backward(OpEnv& e, const OpNode& op) {
  at::Tensor dx = e.take_grad_out(op);  // undefined unless dy is this op's alone
  e.add_grad(op, 0, ops::dropout_backward(dx.defined() ? dx : e.grad_out(op, 0), e.saved_in(op, 1), op.p, dx));
}

}  // namespace
extern const OpImpl kDropoutMaskImpl{mask_fwd, mask_bwd};
extern const OpImpl kDropoutImpl{forward, backward};
}  // namespace remat::detail
