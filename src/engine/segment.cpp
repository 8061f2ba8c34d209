// run_segment: a uniform:N segment of stages as one autograd node (NOTE [Segments]). Its forward
// keeps the segment's input and each stage's seeds; its backward reruns the stages' forwards, then
// runs their backwards from the last, as the memory model replays it.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "remat/error.h"
#include "remat/executor.h"

namespace remat {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SegmentClosure : torch::CustomClassHolder {
  std::vector<SegmentStage> stages;  // (their params are also the node's inputs, saved by autograd)
  std::shared_ptr<const GradSink> sink;
  bool verify = false;
  std::vector<std::vector<uint64_t>> seeds;  // by stage: what its first forward drew
  std::vector<at::Tensor> outputs;           // verify: each stage's first output
};

std::vector<at::Tensor> detached(at::TensorList ts, size_t first, size_t n) {
  std::vector<at::Tensor> out;
  for (size_t i = first; i < first + n; ++i) out.push_back(ts[i].detach());
  return out;
}

class SegmentFunction : public torch::autograd::Function<SegmentFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentClosure> closure, at::Tensor x,
                               at::TensorList params) {
    SegmentClosure& c = *closure;
    at::Tensor h = x.detach();
    size_t p = 0;
    for (const SegmentStage& st : c.stages) {
      const std::vector<at::Tensor> ps = detached(params, p, st.params.size());
      p += st.params.size();
      BlockContext bc;  // what the first forward keeps goes when it ends
      h = st.first->forward({h}, ps, bc, st.layer);
      c.seeds.push_back(std::move(bc.seeds));
      if (c.verify) c.outputs.push_back(h.clone());
    }
    std::vector<at::Tensor> saved = {x};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["closure"] = c10::IValue::make_capsule(std::move(closure));
    ctx->set_materialize_grads(false);
    return {h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (at::GradMode::is_enabled())
      fail(
          "the remat engine does not support double backward (create_graph=true); compute higher-order gradients "
          "without the engine");
    auto closure = c10::static_intrusive_pointer_cast<SegmentClosure>(ctx->saved_data["closure"].toCapsule());
    SegmentClosure& c = *closure;
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = c.stages.size();
    variable_list result(2 + saved.size() - 1);
    if (!grad_outputs[0].defined()) return result;
    // The rerun: each stage's forward with its own schedule and its first forward's seeds.
    std::vector<BlockContext> contexts(n);
    std::vector<std::vector<at::Tensor>> params(n);
    at::Tensor h = saved[0].detach();
    for (size_t j = 0, p = 1; j < n; p += c.stages[j].params.size(), ++j) {
      const SegmentStage& st = c.stages[j];
      params[j] = detached(saved, p, st.params.size());
      contexts[j].seeds = c.seeds[j];
      h = st.exec->forward({h}, params[j], contexts[j], st.layer, /*replay_seeds=*/true);
      if (c.verify && !at::equal(h, c.outputs[j]))
        fail("--verify: layer {}'s output differs when its uniform:N segment reruns it", st.layer);
      if (c.verify) c.outputs[j] = at::Tensor();
    }
    h = at::Tensor();
    // The backwards, from the last stage; the input's gradient goes on to the stage before.
    at::Tensor dy = grad_outputs[0];
    std::vector<std::vector<at::Tensor>> grads(n);
    for (size_t j = n; j-- > 0;) {
      const SegmentStage& st = c.stages[j];
      const bool first = j == 0;
      const std::vector<bool> need = {first ? ctx->needs_input_grad(0) : true};  // (edges: tensor args only)
      BlockExecutor::Grads g = st.exec->backward(dy, params[j], contexts[j], need, st.layer);
      dy = g.inputs[0];
      if (c.sink)
        for (size_t k = 0; k < g.params.size(); ++k) (*c.sink)(st.param_ids[k], std::move(g.params[k]));
      else
        grads[j] = std::move(g.params);
    }
    result[1] = dy;
    if (!c.sink)
      for (size_t j = 0, p = 2; j < n; p += c.stages[j].params.size(), ++j)
        for (size_t k = 0; k < grads[j].size(); ++k) result[p + k] = std::move(grads[j][k]);
    return result;
  }
};

}  // namespace

at::Tensor run_segment(std::vector<SegmentStage> stages, const at::Tensor& x, std::shared_ptr<const GradSink> sink,
                       bool verify) {
  auto closure = c10::make_intrusive<SegmentClosure>();
  std::vector<at::Tensor> params;
  for (const SegmentStage& st : stages) {
    if (sink && st.param_ids.size() != st.params.size())
      REMAT_INTERNAL("a gradient sink needs the model id of each of layer {}'s {} parameters", st.layer,
                     st.params.size());
    params.insert(params.end(), st.params.begin(), st.params.end());
  }
  closure->stages = std::move(stages);
  closure->sink = std::move(sink);
  closure->verify = verify;
  return SegmentFunction::apply(std::move(closure), x, at::TensorList(params))[0];  // (a list: one edge each)
}

}  // namespace remat
