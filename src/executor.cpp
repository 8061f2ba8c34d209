#include "remat/executor.h"

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include "ops/op_env.h"
#include "remat/error.h"

namespace remat {

namespace {

at::ScalarType scalar_type(DType t) {
  switch (t) {
    case DType::F32: return at::kFloat;
    case DType::BF16: return at::kBFloat16;
    case DType::F16: return at::kHalf;
    case DType::Bool: return at::kBool;
    case DType::I64: return at::kLong;
  }
  return at::kFloat;
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (a.device().is_cpu() && a.is_contiguous() && b.is_contiguous())
    return std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
  return at::equal(a, b);
}

std::string describe_tensor(const at::Tensor& t) {
  return fmt::format("{} {}", shape_str(t.sizes().vec()), c10::toString(t.scalar_type()));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// OpEnv

namespace detail {

OpEnv::OpEnv(const BlockSpec& spec, BlockContext& ctx, at::TensorList params, int64_t layer, bool verify)
    : spec_(spec), ctx_(ctx), params_(params), layer_(layer), verify_(verify) {}

const at::Tensor& OpEnv::in(const OpNode& op, int i) const {
  const at::Tensor& t = ctx_.tensors[op.in[i]];
  if (!t.defined())
    fail_runtime("internal: op '{}' (layer {}) reads '{}', which is not held", op.name, layer_,
                 spec_.tensors[op.in[i]].name);
  return t;
}

bool OpEnv::has_out(const OpNode& op, int i) const { return ctx_.tensors[op.out[i]].defined(); }

const at::Tensor& OpEnv::out(const OpNode& op, int i) const { return ctx_.tensors[op.out[i]]; }

void OpEnv::set_out(const OpNode& op, int i, at::Tensor t) {
  const int id = op.out[i];
  const TensorSpec& spec = spec_.tensors[id];
  if (t.sizes().vec() != spec.shape || (t.scalar_type() != scalar_type(spec.dtype) && spec.dtype != DType::F32 &&
                                        spec.dtype != DType::BF16 && spec.dtype != DType::F16))
    fail_runtime("{} of '{}' (layer {}) produced {}; the table says {} {}", recomputing_ ? "recompute" : "forward",
                 spec.name, layer_, describe_tensor(t), shape_str(spec.shape), to_string(spec.dtype));
  if (recomputing_) {
    if (verify_ && ctx_.reference[id].defined() && !bitwise_equal(t, ctx_.reference[id]))
      fail_runtime("recompute of '{}' (layer {}) differs from its forward value: max abs diff {}", spec.name,
                   layer_, (t.to(at::kDouble) - ctx_.reference[id].to(at::kDouble)).abs().max().item<double>());
    if (ctx_.tensors[id].defined()) {
      if (verify_ && !bitwise_equal(t, ctx_.tensors[id]))
        fail_runtime("recompute of '{}' (layer {}) differs from the saved value", spec.name, layer_);
      return;  // keep what the forward saved: the backward reads exactly that
    }
  }
  ctx_.tensors[id] = std::move(t);
}

const at::Tensor& OpEnv::param(const OpNode& op, int i) const { return params_[op.params[i]]; }

at::Device OpEnv::device() const { return ctx_.tensors[spec_.inputs[0]].device(); }

uint64_t OpEnv::seed(const OpNode& op) {
  const size_t id = static_cast<size_t>(&op - spec_.ops.data());
  if (!recomputing_) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    ctx_.seeds[id] = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  return ctx_.seeds[id];
}

const at::Tensor& OpEnv::saved_in(const OpNode& op, int i) const {
  if (!(op_info(op.kind).bwd_reads_in & (1u << i)))
    fail_runtime("internal: backward of '{}' reads input {}, which OpInfo does not list", op.name, i);
  return in(op, i);
}

const at::Tensor& OpEnv::saved_out(const OpNode& op, int i) const {
  if (!(op_info(op.kind).bwd_reads_out & (1u << i)))
    fail_runtime("internal: backward of '{}' reads output {}, which OpInfo does not list", op.name, i);
  const at::Tensor& t = ctx_.tensors[op.out[i]];
  if (!t.defined())
    fail_runtime("internal: backward of '{}' (layer {}) reads '{}', which is not held", op.name, layer_,
                 spec_.tensors[op.out[i]].name);
  return t;
}

const at::Tensor& OpEnv::grad_out(const OpNode& op, int i) const { return grads[op.out[i]]; }

bool OpEnv::needs_grad(const OpNode& op, int i) const {
  const int t = op.in[i];
  const DType d = spec_.tensors[t].dtype;
  if (d == DType::Bool || d == DType::I64) return false;
  for (size_t k = 0; k < spec_.inputs.size(); ++k)
    if (spec_.inputs[k] == t) return need_input_grad[k];
  return true;
}

void OpEnv::add_grad(const OpNode& op, int i, at::Tensor g, bool owned) {
  const int t = op.in[i];
  at::Tensor& slot = grads[t];
  if (!slot.defined()) {
    slot = std::move(g);
    grad_owned[t] = owned;
  } else if (grad_owned[t]) {
    slot.add_(g);
  } else if (owned) {
    g.add_(slot);  // never write into a shared gradient; reuse the fresh one instead (a + b == b + a)
    slot = std::move(g);
    grad_owned[t] = true;
  } else {
    slot = slot + g;  // two shared gradients: a new tensor
    grad_owned[t] = true;
  }
}

at::Tensor& OpEnv::grad_slot(const OpNode& op, int i) {
  const int t = op.in[i];
  if (grads[t].defined() && !grad_owned[t]) grads[t] = grads[t].clone();
  grad_owned[t] = true;
  return grads[t];
}

namespace {

// Nothing but the executor's own slot refers to t's memory: writing over it is invisible elsewhere.
bool sole_owner(const at::Tensor& t) {
  return t.defined() && t.use_count() == 1 && t.storage().use_count() == 1 && t.storage_offset() == 0;
}

}  // namespace

at::Tensor OpEnv::take_grad_out(const OpNode& op) {
  if (op_info(op.kind).grad_in[0] != GradKind::OverDy)
    fail_runtime("internal: '{}' writes over dy, which OpInfo does not allow", op.name);
  const int t = op.out[0];
  if (!grad_owned[t] || !sole_owner(grads[t])) return at::Tensor();
  grad_owned[t] = false;
  return std::move(grads[t]);
}

at::Tensor OpEnv::take_in(const OpNode& op, int i) {
  if (op_info(op.kind).grad_in[i] != GradKind::OverInput)
    fail_runtime("internal: '{}' writes over input {}, which OpInfo does not allow", op.name, i);
  at::Tensor& t = ctx_.tensors[op.in[i]];
  if (!(last_read & (1u << i)) || !sole_owner(t)) return at::Tensor();
  return std::move(t);
}

void OpEnv::add_param_grad(const OpNode& op, int i, at::Tensor g) {
  at::Tensor& slot = param_grads[op.params[i]];
  if (!slot.defined()) slot = std::move(g);
  else slot.add_(g);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Schedule

int64_t Schedule::saved_bytes(const BlockSpec& spec) const {
  int64_t bytes = 0;
  for (size_t t = 0; t < saved.size(); ++t)
    if (saved[t] && !spec.is_input(static_cast<int>(t))) bytes += spec.tensors[t].bytes();
  return bytes;
}

Schedule compile_schedule(const BlockSpec& spec, const LayerPolicy& policy) {
  const int n_tensors = static_cast<int>(spec.tensors.size());
  const int n_ops = static_cast<int>(spec.ops.size());
  if (static_cast<int>(policy.tensors.size()) != n_tensors)
    fail_runtime("internal: policy has {} entries for a {}-tensor '{}' block", policy.tensors.size(), n_tensors,
                 spec.kind);
  Schedule s;
  s.saved.assign(n_tensors, false);
  for (int t = 0; t < n_tensors; ++t)
    s.saved[t] = spec.is_input(t) || (spec.tensors[t].read_by_backward && policy.saves(t));

  // Forward: run each op; drop what neither a later op nor the backward needs.
  std::vector<int> last_forward_use(n_tensors, -1);
  for (int t = 0; t < n_tensors; ++t) last_forward_use[t] = spec.tensors[t].producer;
  for (int o = 0; o < n_ops; ++o)
    for (int t : spec.ops[o].in) last_forward_use[t] = std::max(last_forward_use[t], o);
  for (int o = 0; o < n_ops; ++o) {
    s.forward.push_back({Step::Kind::Forward, o});
    for (int t = 0; t < n_tensors; ++t)
      if (last_forward_use[t] == o && !s.saved[t] && t != spec.output && !spec.is_input(t))
        s.forward.push_back({Step::Kind::Free, t});
  }

  // Backward: before each op's backward, recompute what it reads and is missing (recursively, each
  // op once); then place every free right after the tensor's last use.
  std::vector<bool> held = s.saved;
  std::vector<Step> steps;
  std::function<void(int)> ensure = [&](int t) {
    if (held[t]) return;
    const int p = spec.tensors[t].producer;
    for (int u : spec.ops[p].in) ensure(u);
    steps.push_back({Step::Kind::Recompute, p});
    s.recomputed.push_back(p);
    for (int u : spec.ops[p].out) held[u] = true;
  };
  for (int o = n_ops - 1; o >= 0; --o) {
    for (int t : spec.bwd_reads(o)) ensure(t);
    steps.push_back({Step::Kind::Backward, o});
  }
  std::vector<int> last_use(n_tensors, -1), grad_last_use(n_tensors, -1);
  for (int i = 0; i < static_cast<int>(steps.size()); ++i) {
    const Step& step = steps[i];
    const OpNode& op = spec.ops[step.index];
    if (step.kind == Step::Kind::Recompute) {
      for (int t : op.in) last_use[t] = i;
      for (int t : op.out) last_use[t] = std::max(last_use[t], i);  // unused outputs die at once
    } else {
      for (int t : spec.bwd_reads(step.index)) last_use[t] = i;
      for (int t : op.out) grad_last_use[t] = i;  // the op's backward consumes its output grads
    }
  }
  for (int i = 0; i < static_cast<int>(steps.size()); ++i) {
    if (steps[i].kind == Step::Kind::Backward) {
      const OpNode& op = spec.ops[steps[i].index];
      for (size_t k = 0; k < op.in.size(); ++k)
        if (last_use[op.in[k]] == i && !spec.is_input(op.in[k])) steps[i].last_read |= 1u << k;
    }
    s.backward.push_back(steps[i]);
    for (int t = 0; t < n_tensors; ++t) {
      if (last_use[t] == i) s.backward.push_back({Step::Kind::Free, t});
      if (grad_last_use[t] == i) s.backward.push_back({Step::Kind::FreeGrad, t});
    }
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// BlockExecutor

void OpTimes::zero() {
  std::fill(forward_ms.begin(), forward_ms.end(), 0.0);
  std::fill(recompute_ms.begin(), recompute_ms.end(), 0.0);
  std::fill(backward_ms.begin(), backward_ms.end(), 0.0);
  std::fill(calls.begin(), calls.end(), 0);
}

BlockExecutor::BlockExecutor(BlockSpec spec, LayerPolicy policy, ExecOptions options)
    : spec_(std::move(spec)), policy_(std::move(policy)), options_(std::move(options)) {
  schedule_ = compile_schedule(spec_, policy_);
  if (options_.timer) {
    options_.timer->forward_ms.assign(spec_.ops.size(), 0.0);
    options_.timer->recompute_ms.assign(spec_.ops.size(), 0.0);
    options_.timer->backward_ms.assign(spec_.ops.size(), 0.0);
    options_.timer->calls.assign(spec_.ops.size(), 0);
  }
}

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

at::Tensor BlockExecutor::forward(at::TensorList inputs, at::TensorList params, BlockContext& ctx,
                                  int64_t layer) const {
  if (inputs.size() != spec_.inputs.size() || params.size() != spec_.params.size())
    fail_runtime("internal: '{}' stage takes {} inputs and {} params, got {} and {}", spec_.kind,
                 spec_.inputs.size(), spec_.params.size(), inputs.size(), params.size());
  ctx.tensors.assign(spec_.tensors.size(), at::Tensor());
  ctx.seeds.assign(spec_.ops.size(), 0);
  ctx.reference.assign(options_.verify ? spec_.tensors.size() : 0, at::Tensor());
  for (size_t i = 0; i < inputs.size(); ++i) ctx.tensors[spec_.inputs[i]] = inputs[i];

  detail::OpEnv env(spec_, ctx, params, layer, options_.verify);
  for (const Step& step : schedule_.forward) {
    if (step.kind == Step::Kind::Free) {
      ctx.tensors[step.index] = at::Tensor();
      continue;
    }
    const OpNode& op = spec_.ops[step.index];
    const auto t0 = Clock::now();
    detail::op_impl(op.kind).forward(env, op);
    if (options_.timer) {
      options_.timer->forward_ms[step.index] += ms(t0);
      options_.timer->calls[step.index] += 1;
    }
    if (options_.verify)
      for (int t : op.out)
        if (spec_.tensors[t].read_by_backward && !schedule_.saved[t]) ctx.reference[t] = ctx.tensors[t].clone();
  }
  at::Tensor y = ctx.tensors[spec_.output];
  if (!schedule_.saved[spec_.output]) ctx.tensors[spec_.output] = at::Tensor();
  return y;
}

BlockExecutor::Grads BlockExecutor::backward(const at::Tensor& dy, at::TensorList params, BlockContext& ctx,
                                             const std::vector<bool>& need_input_grad, int64_t layer) const {
  detail::OpEnv env(spec_, ctx, params, layer, options_.verify);
  env.grads.assign(spec_.tensors.size(), at::Tensor());
  env.grad_owned.assign(spec_.tensors.size(), false);
  env.param_grads.assign(spec_.params.size(), at::Tensor());
  env.need_input_grad = need_input_grad;
  env.grads[spec_.output] = dy;

  for (const Step& step : schedule_.backward) {
    switch (step.kind) {
      case Step::Kind::Free:
        ctx.tensors[step.index] = at::Tensor();
        break;
      case Step::Kind::FreeGrad:
        if (!spec_.is_input(step.index)) env.grads[step.index] = at::Tensor();
        break;
      case Step::Kind::Recompute: {
        const OpNode& op = spec_.ops[step.index];
        const auto t0 = Clock::now();
        env.set_recomputing(true);
        detail::op_impl(op.kind).forward(env, op);
        env.set_recomputing(false);
        if (options_.timer) options_.timer->recompute_ms[step.index] += ms(t0);
        break;
      }
      case Step::Kind::Backward: {
        const OpNode& op = spec_.ops[step.index];
        bool any = false;
        for (int t : op.out) any = any || env.grads[t].defined();
        if (!any) break;  // nothing flows back through this op
        const auto t0 = Clock::now();
        env.last_read = step.last_read;
        detail::op_impl(op.kind).backward(env, op);
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

// ---------------------------------------------------------------------------------------------
// The autograd node

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct StageClosure : torch::CustomClassHolder {
  std::shared_ptr<const BlockExecutor> exec;
  int64_t layer = 0;
  BlockContext ctx;
};

class StageFunction : public torch::autograd::Function<StageFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<StageClosure> closure,
                               at::TensorList inputs, at::TensorList params) {
    std::vector<at::Tensor> in;
    for (const at::Tensor& t : inputs) in.push_back(t.detach());
    std::vector<at::Tensor> ps;
    for (const at::Tensor& p : params) ps.push_back(p.detach());
    at::Tensor y = closure->exec->forward(in, ps, closure->ctx, closure->layer);
    ctx->saved_data["closure"] = c10::IValue::make_capsule(std::move(closure));
    ctx->saved_data["n_inputs"] = static_cast<int64_t>(inputs.size());
    ctx->save_for_backward(std::vector<at::Tensor>(params.begin(), params.end()));
    ctx->set_materialize_grads(false);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (at::GradMode::is_enabled())
      fail("the remat engine does not support double backward (create_graph=true)");
    auto closure = c10::static_intrusive_pointer_cast<StageClosure>(ctx->saved_data["closure"].toCapsule());
    const int64_t n_inputs = ctx->saved_data["n_inputs"].toInt();
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : ctx->get_saved_variables()) params.push_back(p.detach());
    variable_list result(1 + n_inputs + params.size());
    if (!grad_outputs[0].defined()) return result;
    std::vector<bool> need(n_inputs);
    for (int64_t i = 0; i < n_inputs; ++i) need[i] = ctx->needs_input_grad(i);  // edges: tensor args only
    BlockExecutor::Grads g = closure->exec->backward(grad_outputs[0], params, closure->ctx, need, closure->layer);
    for (int64_t i = 0; i < n_inputs; ++i) result[1 + i] = g.inputs[i];
    for (size_t j = 0; j < g.params.size(); ++j) result[1 + n_inputs + j] = g.params[j];
    return result;
  }
};

}  // namespace

at::Tensor run_stage(std::shared_ptr<const BlockExecutor> exec, at::TensorList inputs, at::TensorList params,
                     int64_t layer) {
  auto closure = c10::make_intrusive<StageClosure>();
  closure->exec = std::move(exec);
  closure->layer = layer;
  return StageFunction::apply(std::move(closure), inputs, params)[0];
}

}  // namespace remat
