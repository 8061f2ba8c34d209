// BlockExecutor: carries a compiled Schedule out on real tensors (NOTE [One plan]).
#include "remat/executor.h"

#include <chrono>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ops/op_env.h"
#include "remat/error.h"
#include "remat/runtime.h"
#include "util/gemm.h"
#include "util/parallel.h"

namespace remat {

void OpTimes::resize(size_t ops) {
  forward_ms.assign(ops, 0.0);
  recompute_ms.assign(ops, 0.0);
  backward_ms.assign(ops, 0.0);
  calls.assign(ops, 0);
}

void OpTimes::zero() { resize(forward_ms.size()); }

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A policy that saves exactly what `saved` says (to compile another variant of a schedule).
LayerPolicy policy_of(const BlockSpec& spec, const std::vector<bool>& saved) {
  LayerPolicy lp = keep_everything(spec);
  for (int t : spec.choosable())
    if (!saved[t]) lp.tensors[t] = {Choice::Recompute, Strength::Prefer};
  return lp;
}

}  // namespace

BlockExecutor::BlockExecutor(BlockSpec spec, LayerPolicy policy, ExecOptions options)
    : spec_(std::move(spec)), policy_(std::move(policy)), options_(std::move(options)) {
  schedule_ = std::make_shared<const Schedule>(compile_schedule(spec_, policy_));
  if (options_.timer && options_.timer->forward_ms.size() != spec_.ops.size()) options_.timer->resize(spec_.ops.size());
}

BlockExecutor::BlockExecutor(const BlockSpec& spec, std::shared_ptr<const Schedule> schedule, ExecOptions options)
    : spec_(spec), schedule_(std::move(schedule)), options_(std::move(options)) {
  if (!schedule_) fail("BlockExecutor: the schedule is null; give one compile_schedule made for this block");
  bool fits =
      schedule_->saved.size() == spec_.tensors.size() && schedule_->need_input_grad.size() == spec_.inputs.size();
  for (const std::vector<Step>* steps : {&schedule_->forward, &schedule_->backward})
    for (const Step& st : *steps) {
      const bool on_tensor = st.kind == Step::Kind::Free || st.kind == Step::Kind::FreeGrad;
      const size_t n = on_tensor ? spec_.tensors.size() : spec_.ops.size();
      fits = fits && st.index >= 0 && static_cast<size_t>(st.index) < n;
    }
  if (!fits)
    fail("BlockExecutor: the schedule was compiled for another block than '{}'; give one compiled for it", spec_.kind);
  policy_ = policy_of(spec_, schedule_->saved);
  if (options_.timer && options_.timer->forward_ms.size() != spec_.ops.size()) options_.timer->resize(spec_.ops.size());
}

std::shared_ptr<const Schedule> BlockExecutor::schedule_for(const std::vector<bool>& need) const {
  if (need == schedule_->need_input_grad) return schedule_;
  const std::lock_guard<std::mutex> lock(other_mutex_);
  if (!other_ || other_->need_input_grad != need)
    other_ = std::make_shared<const Schedule>(compile_schedule(spec_, policy_, need));
  return other_;
}

namespace {

// `t`, given for the `role` named `name` ("input", "x"), has the table's shape, and its dtype's
// kind: any floating dtype for a floating one (the ops run in float64 too, for references), the very
// dtype otherwise (token ids). The message is made only on failure: this runs on every stage.
void check_tensor(const BlockSpec& spec, const at::Tensor& t, const char* role, const std::string& name,
                  const std::vector<int64_t>& shape, DType dtype) {
  if (!t.defined()) fail("'{}' stage: {} '{}' is an undefined tensor; give a {} tensor", spec.kind, role, name, shape);
  const at::ScalarType want = detail::scalar_type(dtype);
  const bool dtype_ok = at::isFloatingType(want) ? at::isFloatingType(t.scalar_type()) : t.scalar_type() == want;
  if (t.sizes() != at::IntArrayRef(shape) || !dtype_ok)
    fail("'{}' stage: {} '{}' is {} {}; its table says {} {} (build the block for this shape)", spec.kind, role, name,
         c10::toString(t.scalar_type()), t.sizes(), c10::toString(want), shape);
}

}  // namespace

at::Tensor BlockExecutor::forward(at::TensorList inputs, at::TensorList params, BlockContext& ctx, int64_t layer,
                                  bool replay_seeds) const {
  if (inputs.size() != spec_.inputs.size() || params.size() != spec_.params.size())
    fail("'{}' stage takes {} inputs and {} parameters, got {} and {}", spec_.kind, spec_.inputs.size(),
         spec_.params.size(), inputs.size(), params.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorSpec& t = spec_.tensors[spec_.inputs[i]];
    check_tensor(spec_, inputs[i], "input", t.name, t.shape, t.dtype);
  }
  for (size_t i = 0; i < params.size(); ++i)
    check_tensor(spec_, params[i], "parameter", spec_.params[i].name, spec_.params[i].shape, spec_.dtype);
  const Schedule& s = *schedule_;
  ctx.tensors.assign(spec_.tensors.size(), at::Tensor());
  if (!replay_seeds)
    ctx.seeds.assign(spec_.ops.size(), 0);
  else if (ctx.seeds.size() != spec_.ops.size())
    REMAT_INTERNAL("a rerun of '{}' (layer {}) has {} seeds for {} ops", spec_.kind, layer, ctx.seeds.size(),
                   spec_.ops.size());
  ctx.reference.assign(options_.verify ? spec_.tensors.size() : 0, at::Tensor());
  for (size_t i = 0; i < inputs.size(); ++i) ctx.tensors[spec_.inputs[i]] = inputs[i];

  detail::OpEnv env(spec_, ctx.tensors, ctx.seeds, nullptr, params, layer);
  if (replay_seeds) env.replay_seeds();
  detail::KernelThreadsAwake awake(detail::pass_owns_the_cores());
  for (const Step& step : s.forward) {
    if (step.kind == Step::Kind::Free) {
      ctx.tensors[step.index] = at::Tensor();
      continue;
    }
    const OpNode& op = spec_.ops[step.index];
    const auto t0 = Clock::now();
    env.begin(step);
    op_def(op.kind).forward(env, op);
    if (options_.timer && replay_seeds) {  // a segment's rerun: time spent recomputing
      options_.timer->recompute_ms[step.index] += ms(t0);
    } else if (options_.timer) {
      options_.timer->forward_ms[step.index] += ms(t0);
      options_.timer->calls[step.index] += 1;
    }
    if (options_.verify)
      for (int t : op.out)
        if (spec_.tensors[t].read_by_backward && !s.saved[t]) ctx.reference[t] = ctx.tensors[t].clone();
  }
  at::Tensor y = ctx.tensors[spec_.output];
  if (!s.saved[spec_.output]) ctx.tensors[spec_.output] = at::Tensor();
  return y;
}

BlockExecutor::Grads BlockExecutor::backward(const at::Tensor& dy, at::TensorList params, BlockContext& ctx,
                                             const std::vector<bool>& need_input_grad, int64_t layer) const {
  if (ctx.tensors.size() != spec_.tensors.size())
    fail(
        "'{}' stage (layer {}) has no forward to take the backward of: its backward already ran (retain_graph is "
        "not supported) or its forward did not; run the forward again",
        spec_.kind, layer);
  if (need_input_grad.size() != spec_.inputs.size() || params.size() != spec_.params.size())
    fail("'{}' stage's backward takes {} input flags and {} parameters, got {} and {}", spec_.kind, spec_.inputs.size(),
         spec_.params.size(), need_input_grad.size(), params.size());
  const TensorSpec& out = spec_.tensors[spec_.output];
  check_tensor(spec_, dy, "the gradient of its output", out.name, out.shape, out.dtype);
  const std::shared_ptr<const Schedule> held = schedule_for(need_input_grad);
  const Schedule& s = *held;
  detail::OpEnv env(spec_, ctx.tensors, ctx.seeds, options_.verify ? &ctx.reference : nullptr, params, layer,
                    &options_.after_recompute);
  env.grads.assign(spec_.tensors.size(), at::Tensor());
  env.param_grads.assign(spec_.params.size(), at::Tensor());
  env.grads[spec_.output] = dy;
  detail::KernelThreadsAwake awake(detail::pass_owns_the_cores());

  for (const Step& step : s.backward) {
    switch (step.kind) {
      case Step::Kind::Free:
        ctx.tensors[step.index] = at::Tensor();
        break;
      case Step::Kind::FreeGrad:
        env.grads[step.index] = at::Tensor();
        break;
      case Step::Kind::Recompute: {
        const OpNode& op = spec_.ops[step.index];
        const auto t0 = Clock::now();
        env.begin(step);
        op_def(op.kind).forward(env, op);
        if (options_.timer) options_.timer->recompute_ms[step.index] += ms(t0);
        break;
      }
      case Step::Kind::Backward: {
        const OpNode& op = spec_.ops[step.index];
        const auto t0 = Clock::now();
        env.begin(step);
        op_def(op.kind).backward(env, op);
        if (options_.timer) options_.timer->backward_ms[step.index] += ms(t0);
        break;
      }
      case Step::Kind::Forward:
        break;
    }
  }
  ctx = BlockContext();
  Grads g;
  for (size_t i = 0; i < spec_.inputs.size(); ++i)
    g.inputs.push_back(need_input_grad[i] ? env.grads[spec_.inputs[i]] : at::Tensor());
  g.params = std::move(env.param_grads);
  return g;
}

}  // namespace remat
