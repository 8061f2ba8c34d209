#include "remat/model.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "remat/checkpoint.h"
#include "remat/error.h"
#include "remat/ops.h"

namespace remat {

namespace {

// A parameter registered under its table name ("qkv.weight" -> "qkv_weight"; dots are reserved).
std::string param_name(const std::string& name) {
  std::string s = name;
  for (char& c : s)
    if (c == '.') c = '_';
  return s;
}

// GPT-2's initialisation, by parameter name.
at::Tensor init_param(const ParamSpec& p, int64_t layers) {
  const std::string& n = p.name;
  const bool bias = n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
  const bool norm = n.rfind("ln", 0) == 0;
  if (bias) return at::zeros(p.shape);
  if (norm) return at::ones(p.shape);
  double std = 0.02;
  if (n == "proj.weight" || n == "mlp.weight") std /= std::sqrt(2.0 * static_cast<double>(layers));
  return at::randn(p.shape).mul_(std);
}

LayerPolicy keep_all(const BlockSpec& spec) { return Policy::parse("none").resolve(spec, 1).layers[0]; }

}  // namespace

GPTImpl::GPTImpl(const ModelConfig& cfg, const Policy& policy, ExecOptions options)
    : GPTImpl(cfg, policy.resolve(make_block((validate(cfg), cfg)), cfg.layers), std::move(options)) {}

GPTImpl::GPTImpl(const ModelConfig& cfg, const ResolvedPolicy& policy, ExecOptions options)
    : cfg_(cfg), options_(std::move(options)) {
  validate(cfg_);
  if (cfg_.dtype != DType::F32)
    fail("the engine runs --dtype fp32 on this build, got {}; other dtypes are for `remat plan`",
         to_string(cfg_.dtype));
  if (cfg_.attention != AttentionImpl::Math)
    fail("--attention {} needs LibTorch 2.x on CUDA; the engine runs --attention math here",
         to_string(cfg_.attention));
  spec_ = make_model(cfg_);
  if (static_cast<int64_t>(policy.layers.size()) != cfg_.layers)
    fail("the policy has {} layers; the model has {}", policy.layers.size(), cfg_.layers);
  policy_ = policy;

  auto make = [&](const BlockSpec& stage, const std::string& prefix, std::vector<at::Tensor>& out) {
    for (const ParamSpec& p : stage.params) {
      if (p.name == "wte" && !stem_params_.empty()) {  // the LM head is tied to the embedding
        out.push_back(stem_params_[0]);
        continue;
      }
      out.push_back(register_parameter(prefix + param_name(p.name), init_param(p, cfg_.layers)));
    }
  };
  if (spec_.has_stem) make(spec_.stem, "", stem_params_);
  block_params_.resize(cfg_.layers);
  for (int64_t l = 0; l < cfg_.layers; ++l) make(spec_.block, "h" + std::to_string(l) + "_", block_params_[l]);
  make(spec_.head, "", head_params_);
  build_executors();
}

void GPTImpl::build_executors() {
  ExecOptions untimed = options_;  // the timer is sized for the block's ops
  untimed.timer = nullptr;
  if (spec_.has_stem) stem_exec_ = std::make_shared<BlockExecutor>(spec_.stem, keep_all(spec_.stem), untimed);
  head_exec_ = std::make_shared<BlockExecutor>(spec_.head, keep_all(spec_.head), untimed);
  block_exec_.clear();
  for (int64_t l = 0; l < cfg_.layers; ++l) {
    // Layers with the same policy share one executor (and one schedule).
    std::shared_ptr<const BlockExecutor> same;
    for (int64_t k = 0; k < l; ++k) {
      bool equal = true;
      for (size_t t = 0; t < spec_.block.tensors.size() && equal; ++t)
        equal = policy_.layers[k].saves(static_cast<int>(t)) == policy_.layers[l].saves(static_cast<int>(t));
      if (equal) same = block_exec_[k];
    }
    block_exec_.push_back(same ? same : std::make_shared<BlockExecutor>(spec_.block, policy_.layers[l], options_));
  }
  if (cfg_.dropout > 0) {
    ModelConfig no_dropout = cfg_;
    no_dropout.dropout = 0;
    const ModelSpec eval = make_model(no_dropout);
    if (eval.has_stem) eval_stem_exec_ = std::make_shared<BlockExecutor>(eval.stem, keep_all(eval.stem), untimed);
    eval_block_exec_ = std::make_shared<BlockExecutor>(eval.block, keep_all(eval.block), untimed);
    eval_head_exec_ = std::make_shared<BlockExecutor>(eval.head, keep_all(eval.head), untimed);
  }
}

void GPTImpl::set_policy(const Policy& policy) { set_policy(policy.resolve(spec_.block, cfg_.layers)); }

void GPTImpl::set_policy(const ResolvedPolicy& policy) {
  if (static_cast<int64_t>(policy.layers.size()) != cfg_.layers)
    fail("the policy has {} layers; the model has {}", policy.layers.size(), cfg_.layers);
  policy_ = policy;
  build_executors();
}

std::vector<at::Tensor> GPTImpl::block_params(int64_t layer) const { return block_params_.at(layer); }

at::Tensor GPTImpl::forward(const at::Tensor& input, const at::Tensor& target) {
  if (!is_training() && eval_block_exec_) {  // dropout off: the dropout-free stages, no recompute
    at::Tensor x = input;
    if (spec_.has_stem) x = run_stage(eval_stem_exec_, {input}, stem_params_, -1);
    for (int64_t l = 0; l < cfg_.layers; ++l) x = run_stage(eval_block_exec_, {x}, block_params_[l], l);
    return run_stage(eval_head_exec_, {x, target}, head_params_, cfg_.layers);
  }
  at::Tensor x = input;
  if (spec_.has_stem) x = run_stage(stem_exec_, {input}, stem_params_, -1);
  const int64_t chunk = policy_.chunk;
  for (int64_t first = 0; first < cfg_.layers;) {
    if (chunk == 0) {
      x = run_stage(block_exec_[first], {x}, block_params_[first], first);
      ++first;
      continue;
    }
    const int64_t last = std::min(first + chunk, cfg_.layers);
    std::vector<at::Tensor> params;
    for (int64_t l = first; l < last; ++l) params.insert(params.end(), block_params_[l].begin(), block_params_[l].end());
    auto execs = block_exec_;
    auto ps = block_params_;
    x = checkpoint(
        [execs, ps, first, last](const at::Tensor& h) {
          at::Tensor t = h;
          for (int64_t l = first; l < last; ++l) t = run_stage(execs[l], {t}, ps[l], l);
          return t;
        },
        x, params);
    first = last;
  }
  return run_stage(head_exec_, {x, target}, head_params_, cfg_.layers);
}

at::Tensor GPTImpl::logits(const at::Tensor& tokens) {
  if (!spec_.has_stem) fail("logits() needs a gpt2 model (token input); this one is {}", to_string(cfg_.arch));
  at::NoGradGuard no_grad;
  const auto& stem = eval_stem_exec_ ? eval_stem_exec_ : stem_exec_;
  const bool eval_blocks = static_cast<bool>(eval_block_exec_);
  at::Tensor x = run_stage(stem, {tokens}, stem_params_, -1);
  for (int64_t l = 0; l < cfg_.layers; ++l) x = run_stage(eval_blocks ? eval_block_exec_ : block_exec_[l], {x}, block_params_[l], l);
  // The head without its loss: final LayerNorm, then the LM head tied to wte.
  const ops::LayerNormOut lnf = ops::layer_norm_forward(x, head_params_[0], head_params_[1]);
  return ops::linear_forward(lnf.y, head_params_[2], at::Tensor());
}

std::pair<at::Tensor, at::Tensor> random_batch(const ModelConfig& cfg) {
  if (cfg.arch == Arch::Gpt2) {
    at::Tensor input = at::randint(0, cfg.vocab, {cfg.batch, cfg.seq}, at::kLong);
    return {input, at::randint(0, cfg.vocab, {cfg.batch, cfg.seq}, at::kLong)};
  }
  at::Tensor input = at::randn({cfg.batch, cfg.seq, cfg.dim});
  return {input, at::randn({cfg.batch, cfg.seq, cfg.dim})};
}

int64_t GPTImpl::predicted_saved_bytes() const {
  auto output_bytes = [](const BlockSpec& s) { return s.tensors[s.output].bytes(); };
  int64_t bytes = 0;
  if (spec_.has_stem) bytes += stem_exec_->schedule().saved_bytes(spec_.stem) + output_bytes(spec_.stem);
  if (policy_.chunk == 0) {
    for (const auto& e : block_exec_) bytes += e->schedule().saved_bytes(spec_.block) + output_bytes(spec_.block);
  } else {
    // A checkpointed chunk keeps its input (counted as the previous output) and the CPU RNG state.
    const int64_t rng = static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
    const int64_t chunks = (cfg_.layers + policy_.chunk - 1) / policy_.chunk;
    bytes += chunks * (rng + output_bytes(spec_.block));
  }
  return bytes + head_exec_->schedule().saved_bytes(spec_.head) + output_bytes(spec_.head);
}

}  // namespace remat
