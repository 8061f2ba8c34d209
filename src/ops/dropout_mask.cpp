// dropout_mask: a keep-mask (bool, true = keep) drawn from the op's own seed.
//   in: (none)   out: mask   the backward has nothing to do.
// On CPU the mask is a counter-based hash of (seed, element index) (kernels.h), a pure function of
// the seed: a recompute regenerates it exactly, in any order, from 8 bytes (NOTE [RNG]). On CUDA it
// is drawn with bernoulli_ from a generator seeded with the op's seed.
#include <ATen/ATen.h>

#ifdef REMAT_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "ops/kernels.h"
#include "ops/op_env.h"
#include "remat/error.h"

namespace remat::ops {
namespace {

void forward(detail::OpEnv& e, const OpNode& op) {
  const at::Device device = e.device();
  at::Tensor mask = at::empty(e.out_shape(op, 0), at::TensorOptions().dtype(at::kBool).device(device));
  const uint64_t seed = e.seed(op);
  if (device.is_cpu()) {
    kernels::dropout_mask(mask.data_ptr<bool>(), mask.numel(), op.p, seed);
  } else {
#ifdef REMAT_CUDA
    at::Generator gen = at::make_generator<at::CUDAGeneratorImpl>(device.index());
    gen.set_current_seed(seed);
    mask.bernoulli_(1.0 - op.p, gen);
#else
    fail("dropout on {} needs a CUDA build of remat", device.str());
#endif
  }
  e.set_out(op, 0, std::move(mask));
}

void backward(detail::OpEnv&, const OpNode&) {}  // no inputs, nothing to propagate

}  // namespace

extern const OpDef kDropoutMask = [] {
  OpDef d;
  d.name = "dropout_mask";
  d.n_in = 0, d.n_out = 1;
  d.forward = forward;
  d.backward = backward;
  return d;
}();

}  // namespace remat::ops
