#include "remat/checkpoint.h"

#include <algorithm>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef REMAT_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "remat/error.h"

namespace remat {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The RNG state to replay: the CPU generator's, and the current CUDA device's when an input or a
// parameter lives on a GPU.
struct RngState {
  at::Tensor cpu;
  at::Tensor cuda;

  static at::Generator cpu_generator() { return at::detail::getDefaultCPUGenerator(); }
#ifdef REMAT_CUDA
  static at::Generator cuda_generator() { return at::cuda::detail::getDefaultCUDAGenerator(); }
#endif

  static RngState capture(bool with_cuda) {
    RngState s;
    at::Generator cpu = cpu_generator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      s.cpu = cpu.get_state();
    }
#ifdef REMAT_CUDA
    if (with_cuda) {
      at::Generator cuda = cuda_generator();
      std::lock_guard<std::mutex> lock(cuda.mutex());
      s.cuda = cuda.get_state();
    }
#endif
    return s;
  }

  void restore() const {
    at::Generator cpu = cpu_generator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      cpu.set_state(this->cpu);
    }
#ifdef REMAT_CUDA
    if (cuda.defined()) {
      at::Generator g = cuda_generator();
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(cuda);
    }
#endif
  }
};

// While alive, the generators run from `forward` (the forward's state); the state they had before
// is put back when it ends, however the scope is left (a callable that throws included).
class RngFork {
 public:
  explicit RngFork(const std::optional<RngState>& forward) {
    if (!forward) return;
    outer_ = RngState::capture(forward->cuda.defined());
    forward->restore();
  }
  ~RngFork() {
    if (outer_) outer_->restore();
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::optional<RngState> outer_;
};

// What the backward needs besides the saved tensors. Lives in ctx->saved_data as a capsule
// (IValue has no case for std::function).
struct Closure : torch::CustomClassHolder {
  CheckpointFn fn;
  CheckpointOptions options;
  std::optional<RngState> rng;
  size_t n_inputs = 0;
  std::vector<bool> input_requires_grad;
  std::vector<size_t> param_index;  // per parameter given to the node: its index in the caller's list
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // Arguments: closure, inputs..., params... Backward returns one gradient per argument (each
  // TensorList element counts), undefined for the closure.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Closure> closure, at::TensorList inputs,
                               at::TensorList params) {
    bool on_cuda = false;
    for (at::TensorList list : {inputs, params})
      for (const at::Tensor& t : list) on_cuda = on_cuda || (t.defined() && t.is_cuda());
    if (closure->options.preserve_rng_state) closure->rng = RngState::capture(on_cuda);
    closure->n_inputs = inputs.size();
    for (const at::Tensor& t : inputs) closure->input_requires_grad.push_back(t.defined() && t.requires_grad());

    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    // A recompute starts from what the inputs and parameters hold when the backward runs: fn must
    // leave them as it found them.
    // (Inference tensors keep no version, and take part in no backward.)
    auto versions = [&] {
      std::vector<uint32_t> v;
      for (at::TensorList list : {inputs, params})
        for (const at::Tensor& t : list) v.push_back(t.is_inference() ? 0 : t._version());
      return v;
    };
    const std::vector<uint32_t> before = versions();
    variable_list outputs = closure->fn(in);  // Function::forward already runs with grad off
    const std::vector<uint32_t> after = versions();
    for (size_t k = 0; k < before.size(); ++k)
      if (after[k] != before[k])
        fail(
            "remat::checkpoint: fn changed {} {} in place; its recompute would start from the changed values: "
            "change a clone of it inside fn instead",
            k < inputs.size() ? "input" : "parameter", k < inputs.size() ? k : closure->param_index[k - inputs.size()]);

    variable_list to_save(inputs.begin(), inputs.end());
    to_save.insert(to_save.end(), params.begin(), params.end());
    ctx->save_for_backward(to_save);
    ctx->set_materialize_grads(false);
    variable_list non_diff;
    for (const at::Tensor& o : outputs)
      if (o.defined() && !at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type()))
        non_diff.push_back(o);
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    ctx->saved_data["closure"] = c10::IValue::make_capsule(std::move(closure));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (at::GradMode::is_enabled())
      fail(
          "remat::checkpoint does not support double backward (create_graph=true); "
          "compute higher-order gradients without checkpointing");
    auto closure = c10::static_intrusive_pointer_cast<Closure>(ctx->saved_data["closure"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    const size_t n_in = closure->n_inputs;

    // Fresh leaves for the inputs that need gradients; the parameters are used as they are.
    std::vector<at::Tensor> inputs(saved.begin(), saved.begin() + static_cast<std::ptrdiff_t>(n_in));
    variable_list targets;
    std::vector<size_t> target_slot;  // index into the result list
    for (size_t i = 0; i < n_in; ++i) {
      if (!inputs[i].defined()) continue;
      inputs[i] = inputs[i].detach();
      if (closure->input_requires_grad[i]) {
        inputs[i].requires_grad_(true);
        targets.push_back(inputs[i]);
        target_slot.push_back(1 + i);
      }
    }
    for (size_t j = n_in; j < saved.size(); ++j) {
      if (saved[j].defined() && saved[j].requires_grad()) {
        targets.push_back(saved[j]);
        target_slot.push_back(1 + j);
      }
    }

    variable_list outputs;
    {
      RngFork fork(closure->rng);
      at::AutoGradMode grad_on(true);
      outputs = closure->fn(inputs);
    }

    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    variable_list result(1 + saved.size());
    if (roots.empty() || targets.empty()) return result;
    const variable_list grads = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                                      /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < grads.size(); ++k) result[target_slot[k]] = grads[k];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, at::TensorList inputs, at::TensorList params,
                                   const CheckpointOptions& options) {
  if (!fn) fail("remat::checkpoint: fn is empty; pass a callable");
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!inputs[i].defined()) fail("remat::checkpoint: input {} is an undefined tensor; pass defined tensors", i);
  for (size_t i = 0; i < params.size(); ++i)
    if (!params[i].defined()) fail("remat::checkpoint: parameter {} is an undefined tensor; pass defined tensors", i);
  // A parameter listed twice (a layer used twice in a segment) is one edge: its gradient once.
  auto closure = c10::make_intrusive<Closure>();
  std::vector<at::Tensor> unique;
  for (size_t i = 0; i < params.size(); ++i)
    if (std::none_of(unique.begin(), unique.end(), [&](const at::Tensor& u) { return u.is_same(params[i]); })) {
      unique.push_back(params[i]);
      closure->param_index.push_back(i);
    }
  closure->fn = fn;
  closure->options = options;
  return CheckpointFunction::apply(std::move(closure), inputs, at::TensorList(unique));
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                      at::TensorList params, const CheckpointOptions& options) {
  if (!fn) fail("remat::checkpoint: fn is empty; pass a callable");
  CheckpointFn wrapped = [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; };
  return checkpoint(wrapped, {x}, params, options)[0];
}

at::Tensor checkpoint_sequential(const std::vector<Layer>& layers, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options) {
  const int64_t n = static_cast<int64_t>(layers.size());
  if (segments < 1 || segments > n)
    fail("checkpoint_sequential: segments={} must be in 1..{} (the number of layers)", segments, n);
  for (int64_t i = 0; i < n; ++i)
    if (!layers[i].fn) fail("checkpoint_sequential: layer {}'s fn is empty; give every layer a callable", i);
  const int64_t size = n / segments;
  at::Tensor h = x;
  int64_t start = 0;
  for (int64_t s = 0; s + 1 < segments; ++s, start += size) {
    std::vector<at::Tensor> params;
    for (int64_t i = start; i < start + size; ++i)
      params.insert(params.end(), layers[i].params.begin(), layers[i].params.end());
    // The closure outlives this call (it reruns in backward), so it owns copies of its layers.
    std::vector<Layer> run_layers(layers.begin() + start, layers.begin() + start + size);
    auto run = [run_layers = std::move(run_layers)](const at::Tensor& in) {
      at::Tensor t = in;
      for (const Layer& layer : run_layers) t = layer.fn(t);
      return t;
    };
    h = checkpoint(run, h, params, options);
  }
  for (int64_t i = start; i < n; ++i) h = layers[i].fn(h);
  return h;
}

}  // namespace remat
