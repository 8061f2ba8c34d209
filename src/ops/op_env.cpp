#include "ops/op_env.h"

#include <cstring>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "ops/kernels.h"
#include "remat/error.h"
#include "remat/units.h"

namespace remat::detail {

at::ScalarType scalar_type(DType t) {
  switch (t) {
    case DType::F32:
      return at::kFloat;
    case DType::BF16:
      return at::kBFloat16;
    case DType::F16:
      return at::kHalf;
    case DType::Bool:
      return at::kBool;
    case DType::I64:
      return at::kLong;
  }
  return at::kFloat;
}

namespace {

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (a.device().is_cpu() && a.is_contiguous() && b.is_contiguous())
    return std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
  return at::equal(a, b);
}

std::string describe_tensor(const at::Tensor& t) {
  return fmt::format("{} {}", shape_str(t.sizes().vec()), c10::toString(t.scalar_type()));
}

// Nothing but the executor's own slot refers to t's memory: writing over it is invisible elsewhere.
bool sole_owner(const at::Tensor& t) {
  return t.defined() && t.use_count() == 1 && t.storage().use_count() == 1 && t.storage_offset() == 0;
}

}  // namespace

OpEnv::OpEnv(const BlockSpec& spec, std::vector<at::Tensor>& tensors, std::vector<uint64_t>& seeds,
             std::vector<at::Tensor>* reference, at::TensorList params, int64_t layer, const RecomputeHook* hook)
    : spec_(spec),
      tensors_(tensors),
      seeds_(seeds),
      reference_(reference),
      params_(params),
      layer_(layer),
      hook_(hook) {}

const at::Tensor& OpEnv::in(const OpNode& op, int i) const {
  const at::Tensor& t = tensors_[op.in[i]];
  if (!t.defined())
    REMAT_INTERNAL("op '{}' (layer {}) reads '{}', which is not held", op.name, layer_, spec_.tensors[op.in[i]].name);
  return t;
}

const at::Tensor& OpEnv::param(const OpNode& op, int i) const { return params_[op.params[i]]; }

void OpEnv::set_out(const OpNode& op, int i, at::Tensor t) {
  const int id = op.out[i];
  const TensorSpec& spec = spec_.tensors[id];
  const bool float_table = spec.dtype == DType::F32 || spec.dtype == DType::BF16 || spec.dtype == DType::F16;
  if (t.sizes().vec() != spec.shape || (!float_table && t.scalar_type() != scalar_type(spec.dtype)))
    fail_runtime("{} of '{}' (layer {}) produced {}; the table says {} {}", recomputing() ? "recompute" : "forward",
                 spec.name, layer_, describe_tensor(t), shape_str(spec.shape), to_string(spec.dtype));
  if (recomputing()) {
    if (hook_ && *hook_) (*hook_)(spec, layer_, t);
    const bool verify = reference_ != nullptr;
    if (step_->discard & (1u << i)) {  // still held from the forward: keep that value
      if (verify && !bitwise_equal(t, tensors_[id]))
        fail_runtime("recompute of '{}' (layer {}) differs from the saved value", spec.name, layer_);
      return;
    }
    if (verify && (*reference_)[id].defined() && !bitwise_equal(t, (*reference_)[id]))
      fail_runtime("recompute of '{}' (layer {}) differs from its forward value: max abs diff {}", spec.name, layer_,
                   (t.to(at::kDouble) - (*reference_)[id].to(at::kDouble)).abs().max().item<double>());
  }
  tensors_[id] = std::move(t);
}

at::Device OpEnv::device() const {
  for (int in : spec_.inputs)
    if (tensors_[in].defined()) return tensors_[in].device();
  return params_.empty() ? at::Device(at::kCPU) : params_[0].device();
}

uint64_t OpEnv::seed(const OpNode& op) {
  const size_t id = static_cast<size_t>(&op - spec_.ops.data());
  if (step_ != nullptr && step_->kind == Step::Kind::Forward && !replay_seeds_) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    seeds_[id] = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  return seeds_[id];
}

const at::Tensor& OpEnv::saved_in(const OpNode& op, int i) const {
  if (!(op_def(op.kind).reads_in(op) & (1u << i)))
    REMAT_INTERNAL("backward of '{}' reads input {}, which its definition does not list", op.name, i);
  return in(op, i);
}

const at::Tensor& OpEnv::saved_out(const OpNode& op, int i) const {
  if (!(op_def(op.kind).bwd_reads_out & (1u << i)))
    REMAT_INTERNAL("backward of '{}' reads output {}, which its definition does not list", op.name, i);
  const at::Tensor& t = tensors_[op.out[i]];
  if (!t.defined())
    REMAT_INTERNAL("backward of '{}' (layer {}) reads '{}', which is not held", op.name, layer_,
                   spec_.tensors[op.out[i]].name);
  return t;
}

const at::Tensor& OpEnv::grad_out(const OpNode& op, int i) const { return grads[op.out[i]]; }

const GradStep& OpEnv::plan(const OpNode& op, int i) const {
  if (step_ == nullptr || step_->kind != Step::Kind::Backward || &spec_.ops[step_->index] != &op)
    REMAT_INTERNAL("op '{}' asked for its gradient plan outside its backward step", op.name);
  return step_->grads[i];
}

bool OpEnv::needs_grad(const OpNode& op, int i) const { return plan(op, i).source != GradSource::None; }

at::Tensor OpEnv::grad_buffer(const OpNode& op, int i) {
  const GradSource source = plan(op, i).source;
  if (source != GradSource::OverDy && source != GradSource::OverInput) return at::Tensor();
  at::Tensor& t = source == GradSource::OverDy ? grads[op.out[0]] : tensors_[op.in[i]];
  if (!sole_owner(t))
    REMAT_INTERNAL("the plan writes the gradient of '{}' (layer {}) over {}, but that memory is shared",
                   spec_.tensors[op.in[i]].name, layer_, source == GradSource::OverDy ? "dy" : "the input");
  handed_[i] = t.data_ptr();
  return std::move(t);
}

at::Tensor& OpEnv::grad_slot(const OpNode& op, int i) {
  const GradStep& g = plan(op, i);
  const int t = op.in[i];
  if (g.source != GradSource::Slot)
    REMAT_INTERNAL("op '{}' adds into the gradient slot of input {}, which its plan does not allow", op.name, i);
  at::Tensor& slot = grads[t];
  switch (g.prep) {
    case SlotPrep::Zeros:  // like the input, strides too (a Slot input is one its backward reads: held)
      if (!tensors_[t].defined())
        slot = ops::kernels::zeros(spec_.tensors[t].shape,
                                   at::TensorOptions().dtype(scalar_type(spec_.tensors[t].dtype)).device(device()));
      else if (tensors_[t].is_contiguous())
        slot = ops::kernels::zeros(tensors_[t].sizes(), tensors_[t].options());
      else
        slot = at::zeros_like(tensors_[t]);
      break;
    case SlotPrep::Copy:
      slot = slot.clone();
      break;
    case SlotPrep::Existing:
      break;
  }
  if (!slot.defined()) REMAT_INTERNAL("the gradient slot of '{}' is empty", spec_.tensors[t].name);
  return slot;
}

void OpEnv::set_grad(const OpNode& op, int i, at::Tensor g) {
  const GradStep& plan_i = plan(op, i);
  const int t = op.in[i];
  const TensorSpec& spec = spec_.tensors[t];
  if (plan_i.source == GradSource::None || plan_i.source == GradSource::Slot)
    REMAT_INTERNAL("op '{}' hands over a gradient for '{}', which its plan does not make", op.name, spec.name);
  if (g.sizes().vec() != spec.shape)
    fail_runtime("backward of '{}' (layer {}) produced {} for '{}'; the table says {}", op.name, layer_,
                 describe_tensor(g), spec.name, shape_str(spec.shape));
  if ((plan_i.source == GradSource::OverDy || plan_i.source == GradSource::OverInput) && g.data_ptr() != handed_[i])
    REMAT_INTERNAL("the backward of '{}' did not write over the memory it was handed", op.name);
  at::Tensor& slot = grads[t];
  switch (plan_i.merge) {
    case GradMerge::Set:
      slot = std::move(g);
      break;
    case GradMerge::AddIntoSlot:
      slot.add_(g);
      break;
    case GradMerge::AddSlotIntoIt:
      g.add_(slot);  // never write into a shared gradient (a + b == b + a)
      slot = std::move(g);
      break;
    case GradMerge::Sum:
      slot = slot + g;
      break;
  }
}

void OpEnv::add_param_grad(const OpNode& op, int i, at::Tensor g) {
  at::Tensor& slot = param_grads[op.params[i]];
  if (!slot.defined())
    slot = std::move(g);
  else
    slot.add_(g);
}

}  // namespace remat::detail
