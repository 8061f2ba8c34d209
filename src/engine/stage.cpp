// run_stage: one stage as one autograd node. Its forward runs the executor with grad off; its
// backward hands autograd's output gradient to the executor and returns the input and parameter
// gradients (autograd accumulates the parameters' into .grad).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "remat/error.h"
#include "remat/executor.h"

namespace remat {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct StageClosure : torch::CustomClassHolder {
  std::shared_ptr<const BlockExecutor> exec;
  int64_t layer = 0;
  BlockContext ctx;
  std::shared_ptr<const GradSink> sink;
  std::vector<int> param_ids;
  // For a forward a backward may follow: the version counters of the inputs that have one (not
  // the tensors: the executor decides what stays alive), by input index, and their versions then.
  std::vector<std::pair<size_t, c10::VariableVersion>> input_versions;
  std::vector<uint32_t> forward_versions;
};

class StageFunction : public torch::autograd::Function<StageFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<StageClosure> closure, at::TensorList inputs,
                               at::TensorList params) {
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
      fail(
          "the remat engine does not support double backward (create_graph=true); compute higher-order gradients "
          "without the engine");
    auto closure = c10::static_intrusive_pointer_cast<StageClosure>(ctx->saved_data["closure"].toCapsule());
    const int64_t n_inputs = ctx->saved_data["n_inputs"].toInt();
    for (size_t k = 0; k < closure->input_versions.size(); ++k)
      if (const auto& [i, counter] = closure->input_versions[k];
          counter.current_version() != closure->forward_versions[k])
        fail(
            "input {} of stage '{}'{} was changed in place between its forward and its backward, which reads it; "
            "change a copy, or run the backward first",
            i, closure->exec->spec().kind, closure->layer >= 0 ? fmt::format(" (layer {})", closure->layer) : "");
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : ctx->get_saved_variables()) params.push_back(p.detach());
    variable_list result(1 + n_inputs + params.size());
    if (!grad_outputs[0].defined()) return result;
    std::vector<bool> need(n_inputs);
    for (int64_t i = 0; i < n_inputs; ++i) need[i] = ctx->needs_input_grad(i);  // edges: tensor args only
    BlockExecutor::Grads g = closure->exec->backward(grad_outputs[0], params, closure->ctx, need, closure->layer);
    for (int64_t i = 0; i < n_inputs; ++i) result[1 + i] = g.inputs[i];
    for (size_t j = 0; j < g.params.size(); ++j) {
      if (closure->sink)
        (*closure->sink)(closure->param_ids[j], std::move(g.params[j]));
      else
        result[1 + n_inputs + j] = std::move(g.params[j]);
    }
    return result;
  }
};

}  // namespace

at::Tensor run_stage(std::shared_ptr<const BlockExecutor> exec, at::TensorList inputs, at::TensorList params,
                     int64_t layer, std::shared_ptr<const GradSink> sink, const std::vector<int>* param_ids) {
  auto closure = c10::make_intrusive<StageClosure>();
  closure->exec = std::move(exec);
  closure->layer = layer;
  if (sink) {
    if (param_ids == nullptr || param_ids->size() != params.size())
      REMAT_INTERNAL("a gradient sink needs the model id of each of the stage's {} parameters", params.size());
    closure->sink = std::move(sink);
    closure->param_ids = *param_ids;
  }
  // (Function::forward runs with grad off: whether a backward can follow is known only here.
  // Undefined inputs are the executor's to refuse; inference tensors keep no version.)
  if (at::GradMode::is_enabled())
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined() && !inputs[i].is_inference()) {
        closure->input_versions.emplace_back(i, torch::autograd::impl::version_counter(inputs[i]));
        closure->forward_versions.push_back(inputs[i]._version());
      }
  return StageFunction::apply(std::move(closure), inputs, params)[0];
}

}  // namespace remat
