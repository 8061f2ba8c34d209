// remat::GPT: runs a CompiledStep. Parameters are made from their roles in the tensor table; stages
// run in the plan's order; nothing here knows a tensor's or a parameter's name.
#include "remat/model.h"

#include <cmath>
#include <map>

#include <ATen/ATen.h>

#include "remat/error.h"

namespace remat {

namespace {

// A parameter registered under its model name ("h0.qkv.weight" -> "h0_qkv_weight"; dots are reserved).
std::string module_name(const std::string& name) {
  std::string s = name;
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

at::Tensor init_param(const ParamSpec& p, int64_t layers) {
  switch (p.init) {
    case Init::Zeros:
      return at::zeros(p.shape);
    case Init::Ones:
      return at::ones(p.shape);
    case Init::Normal:
      return at::randn(p.shape).mul_(p.std);
    case Init::ResidualNormal:
      return at::randn(p.shape).mul_(p.std / std::sqrt(2.0 * static_cast<double>(layers)));
  }
  return at::Tensor();
}

ResolvedPolicy resolve_for_engine(const ModelConfig& cfg, const Policy& policy) {
  return policy.resolve(make_block(cfg), cfg.layers);
}

}  // namespace

GPTImpl::GPTImpl(const ModelConfig& cfg, const Policy& policy, ExecOptions options)
    : GPTImpl(cfg, resolve_for_engine(cfg, policy), std::move(options)) {}

void check_engine(const ModelConfig& cfg) {
  validate(cfg);
  if (cfg.dtype != DType::F32)
    fail("the engine runs ModelConfig.dtype fp32 on this build, got {}; other dtypes are for `remat plan`",
         to_string(cfg.dtype));
  if (cfg.tp > 1)
    fail("ModelConfig.tp {}: tensor parallelism is planned (remat plan --tp), not run; the engine runs tp 1", cfg.tp);
  if (cfg.cp > 1)
    fail("ModelConfig.cp {}: context parallelism is planned (remat plan --cp), not run; the engine runs cp 1", cfg.cp);
  if (cfg.ep > 1)
    fail("ModelConfig.ep {}: expert parallelism is planned (remat plan --ep), not run; the engine runs ep 1", cfg.ep);
  if (cfg.etp > 1)
    fail("ModelConfig.etp {}: expert tensor parallelism is planned (remat plan --etp), not run; the engine runs etp 1",
         cfg.etp);
  if (cfg.eager_ops)
    fail(
        "ModelConfig.eager_ops plans a GPU framework's unfused ops (remat plan --framework torchtitan); the engine "
        "runs its own, so it must be false");
  if (cfg.deterministic)
    fail(
        "ModelConfig.deterministic plans PyTorch's deterministic algorithms on a GPU (remat plan --deterministic); "
        "the engine's ops are deterministic already, so it must be false");
}

GPTImpl::GPTImpl(const ModelConfig& cfg, const ResolvedPolicy& policy, ExecOptions options)
    : cfg_(cfg), options_(std::move(options)) {
  check_engine(cfg_);
  spec_ = std::make_shared<const ModelSpec>(make_model(cfg_));
  policy_ = policy;
  plan_ = compile_step(spec_, policy_);
  for (const ModelParam& p : plan_.params)
    params_.push_back(register_parameter(module_name(p.name), init_param(*p.spec, cfg_.layers)));
  build_executors();
}

void GPTImpl::build_executors() {
  ExecOptions untimed = options_;  // the timer is sized for the block's ops
  untimed.timer = nullptr;
  // uniform:N segments' first forwards check nothing: no recompute of them ever runs (the rerun is
  // checked against them instead).
  ExecOptions unverified = options_;
  unverified.verify = false;
  // Layers that share a compiled schedule share one executor.
  using Made = std::map<const Schedule*, std::shared_ptr<const BlockExecutor>>;
  Made made, made_first;
  auto executor = [](Made& m, const CompiledStage& st, const std::shared_ptr<const Schedule>& s, const ExecOptions& o) {
    std::shared_ptr<const BlockExecutor>& e = m[s.get()];
    if (!e) e = std::make_shared<BlockExecutor>(*st.spec, s, o);
    return e;
  };
  execs_.clear();
  first_execs_.clear();
  for (const CompiledStage& st : plan_.stages) {
    execs_.push_back(executor(made, st, st.schedule, st.role == CompiledStage::Role::Block ? options_ : untimed));
    first_execs_.push_back(st.first_pass ? executor(made_first, st, st.first_pass, unverified) : nullptr);
  }
  // Eval mode: the dropout-free twin of the model, keeping everything. Its parameters are ours, in
  // the same order. Sinkhorn balances the experts' load in training only: outside it a token's
  // experts are the top of its own scores, whatever the batch around it (Megatron-LM's router).
  eval_execs_.clear();
  ModelConfig no_dropout = cfg_;
  no_dropout.dropout = 0;
  ModelSpec eval_model = make_model(no_dropout);
  for (OpNode& op : eval_model.block.ops) op.routing.sinkhorn = false;
  auto eval_spec = std::make_shared<const ModelSpec>(std::move(eval_model));
  ResolvedPolicy keep;
  keep.layers.assign(cfg_.layers, keep_everything(eval_spec->block));
  eval_plan_ = compile_step(eval_spec, keep);
  for (size_t i = 0; i < eval_plan_.params.size(); ++i)
    if (eval_plan_.params[i].name != plan_.params[i].name)
      REMAT_INTERNAL("the dropout-free model's parameter {} is '{}', not '{}'", i, eval_plan_.params[i].name,
                     plan_.params[i].name);
  for (const CompiledStage& st : eval_plan_.stages)
    eval_execs_.push_back(std::make_shared<BlockExecutor>(*st.spec, st.schedule, untimed));
  if (!eval_spec->logits.kind.empty())
    logits_exec_ = std::make_shared<BlockExecutor>(eval_spec->logits, keep_everything(eval_spec->logits), untimed);
}

void GPTImpl::set_policy(const Policy& policy) { set_policy(policy.resolve(spec_->block, cfg_.layers)); }

void GPTImpl::set_policy(const ResolvedPolicy& policy) {
  policy_ = policy;
  CompiledStep plan = compile_step(spec_, policy_);
  for (size_t i = 0; i < plan.params.size(); ++i)
    if (plan.params[i].name != plan_.params[i].name) REMAT_INTERNAL("the parameters changed with the policy");
  plan_ = std::move(plan);
  build_executors();
}

std::vector<at::Tensor> GPTImpl::stage_params(const CompiledStage& stage) const {
  std::vector<at::Tensor> ps;
  for (int id : stage.params) ps.push_back(params_[id]);
  return ps;
}

std::vector<at::Tensor> GPTImpl::block_params(int64_t layer) const {
  if (layer < 0 || layer >= cfg_.layers)
    fail("block_params: layer {} is not one of the model's 0..{}", layer, cfg_.layers - 1);
  return stage_params(plan_.block(layer));
}

void GPTImpl::set_grad_sink(GradSink sink) {
  sink_ = sink ? std::make_shared<const GradSink>(std::move(sink)) : nullptr;
}

std::vector<bool> GPTImpl::decays() const {
  std::vector<bool> d;
  for (const ModelParam& p : plan_.params) d.push_back(p.spec->decay);
  return d;
}

namespace {

// Token ids index the embedding and the loss's rows unchecked: each must be in [0, vocab).
void check_ids(const at::Tensor& ids, const char* what, int64_t vocab) {
  if (!ids.defined() || ids.scalar_type() != at::kLong || ids.numel() == 0) return;  // the stage names a bad tensor
  const auto [min, max] = at::aminmax(ids);
  const int64_t lo = min.item<int64_t>(), hi = max.item<int64_t>();
  if (lo < 0 || hi >= vocab)
    fail("{} holds token id {}; ids must be in [0, {}) (ModelConfig.vocab {})", what, lo < 0 ? lo : hi, vocab, vocab);
}

}  // namespace

at::Tensor GPTImpl::forward(const at::Tensor& batch_input, const at::Tensor& batch_target) {
  // The ops index their inputs as laid out row after row: a view (targets narrowed from a buffer
  // of T + 1 tokens) is copied once here.
  const at::Tensor input = batch_input.defined() ? batch_input.contiguous() : batch_input;
  const at::Tensor target = batch_target.defined() ? batch_target.contiguous() : batch_target;
  check_ids(input, "the input", cfg_.vocab);
  check_ids(target, "the target", cfg_.vocab);
  const bool eval = !is_training();
  const CompiledStep& plan = eval ? eval_plan_ : plan_;
  const auto& execs = eval ? eval_execs_ : execs_;
  const size_t n = plan.stages.size();
  at::Tensor x = input;
  for (size_t i = 0; i < n;) {
    const CompiledStage& st = plan.stages[i];
    const std::shared_ptr<const GradSink> sink = eval ? nullptr : sink_;
    if (st.role == CompiledStage::Role::Head) {
      x = run_stage(execs[i], {x, target}, stage_params(st), st.layer, sink, &st.params);
      ++i;
      continue;
    }
    if (st.segment < 0 || eval) {
      x = run_stage(execs[i], {x}, stage_params(st), st.layer, sink, &st.params);
      ++i;
      continue;
    }
    // uniform:N: the blocks of one segment, one node.
    std::vector<SegmentStage> segment;
    for (; i < n && plan.stages[i].segment == st.segment; ++i) {
      const CompiledStage& s = plan.stages[i];
      segment.push_back({first_execs_[i], execs[i], stage_params(s), s.layer, s.params});
    }
    x = run_segment(std::move(segment), x, sink, options_.verify);
  }
  return x;
}

at::Tensor GPTImpl::logits(const at::Tensor& tokens) {
  if (!logits_exec_) fail("logits() needs a token model (gpt2, llama); this one is {}", cfg_.arch);
  check_ids(tokens, "the tokens", cfg_.vocab);
  at::NoGradGuard no_grad;
  at::Tensor x = tokens.defined() ? tokens.contiguous() : tokens;
  for (size_t i = 0; i + 1 < eval_plan_.stages.size(); ++i)
    x = run_stage(eval_execs_[i], {x}, stage_params(eval_plan_.stages[i]), eval_plan_.stages[i].layer);
  return run_stage(logits_exec_, {x}, stage_params(eval_plan_.stages.back()), cfg_.layers);
}

std::pair<at::Tensor, at::Tensor> random_batch(const ModelConfig& cfg) {
  const ModelSpec spec = make_model(cfg);
  const BlockSpec& first = spec.has_stem ? spec.stem : spec.block;
  const TensorSpec& in = first.tensors[first.inputs[0]];
  const TensorSpec& target = spec.head.tensors[spec.head.inputs[1]];
  auto draw = [&](const TensorSpec& t) {
    return t.dtype == DType::I64 ? at::randint(0, cfg.vocab, t.shape, at::kLong) : at::randn(t.shape);
  };
  at::Tensor input = draw(in);
  return {input, draw(target)};
}

int64_t GPTImpl::predicted_saved_bytes() const {
  auto output_bytes = [](const BlockSpec& s) { return s.tensors[s.output].bytes(); };
  int64_t bytes = 0;
  for (size_t i = 0; i < plan_.stages.size(); ++i) {
    const CompiledStage& st = plan_.stages[i];
    const bool segment_ends = i + 1 == plan_.stages.size() || plan_.stages[i + 1].segment != st.segment;
    if (st.segment < 0)
      bytes += st.schedule->saved_bytes(*st.spec) + output_bytes(*st.spec);
    else if (segment_ends)  // a segment keeps its input (the stage before's output) and its output
      bytes += output_bytes(*st.spec);
  }
  return bytes;
}

}  // namespace remat
