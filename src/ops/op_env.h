// How an op sees one stage run (internal).
//
// Each op file under src/ops/ defines its forward and backward against OpEnv and nothing else.
// OpEnv checks every access against the op's definition (a backward that reads a tensor its row
// does not list fails loudly instead of keeping alive memory the accounting does not know about)
// and carries out the gradient plan the schedule compiler chose for the running step.
//
// The rules for a backward:
//   1. Read only saved_in / saved_out / grad_out of what the definition lists.
//   2. For an input whose kind is OverDy or OverInput, ask grad_buffer(): it returns the memory to
//      write the gradient over (dy, or the input itself) when the plan says so, else an undefined
//      tensor (allocate a fresh one). Read the input before writing over it.
//   3. For a Slot input, add into grad_slot(); it is already zeroed or copied as the plan says.
//   4. Compute every gradient first, then hand each over with set_grad / add_param_grad: the
//      memory model counts them as alive together.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"
#include "remat/schedule.h"

namespace remat::detail {

// The ATen dtype of a table dtype.
at::ScalarType scalar_type(DType t);

class OpEnv {
 public:
  // `tensors` (by tensor id) and `seeds` (by op id) are the stage's; `reference` holds the forward
  // values to check recomputes against in verify mode (null otherwise).
  using RecomputeHook = std::function<void(const TensorSpec&, int64_t layer, at::Tensor&)>;
  OpEnv(const BlockSpec& spec, std::vector<at::Tensor>& tensors, std::vector<uint64_t>& seeds,
        std::vector<at::Tensor>* reference, at::TensorList params, int64_t layer, const RecomputeHook* hook = nullptr);

  // The step about to run: its kind decides recompute behaviour, its gradient plan the backward's.
  void begin(const Step& step) { step_ = &step; }

  // --- forward (and recompute) ---
  const at::Tensor& in(const OpNode& op, int i) const;
  const at::Tensor& param(const OpNode& op, int i) const;
  bool has_param(const OpNode& op, int i) const { return i < static_cast<int>(op.params.size()); }
  // Stores output i after checking its shape against the table. During a recompute, an output the
  // schedule marks as still held keeps its forward value (verify mode checks the new one equals it).
  void set_out(const OpNode& op, int i, at::Tensor t);
  const std::vector<int64_t>& out_shape(const OpNode& op, int i) const { return spec_.tensors[op.out[i]].shape; }
  // Input i's shape from the table: known in the backward whether or not the input was kept.
  const std::vector<int64_t>& in_shape(const OpNode& op, int i) const { return spec_.tensors[op.in[i]].shape; }
  // The device the stage runs on (for ops with no inputs).
  at::Device device() const;
  // The op's random seed: drawn from the default generator in the forward, replayed in a recompute
  // and in the backward, and in a forward after replay_seeds().
  uint64_t seed(const OpNode& op);
  void replay_seeds() { replay_seeds_ = true; }
  bool recomputing() const { return step_ != nullptr && step_->kind == Step::Kind::Recompute; }

  // --- backward ---
  const at::Tensor& saved_in(const OpNode& op, int i) const;   // only inputs the definition lists
  const at::Tensor& saved_out(const OpNode& op, int i) const;  // only outputs the definition lists
  const at::Tensor& grad_out(const OpNode& op, int i) const;   // may be undefined
  // Does input i get a gradient in this run?
  bool needs_grad(const OpNode& op, int i) const;
  // OverDy / OverInput inputs: the tensor to write input i's gradient over, handed over, when the
  // plan says so; otherwise undefined (write a fresh tensor).
  at::Tensor grad_buffer(const OpNode& op, int i);
  // Slot inputs: input i's gradient, ready to add into.
  at::Tensor& grad_slot(const OpNode& op, int i);
  // Hands over input i's gradient; it joins the input's slot as the plan says.
  void set_grad(const OpNode& op, int i, at::Tensor g);
  void add_param_grad(const OpNode& op, int i, at::Tensor g);

  // Executor state.
  std::vector<at::Tensor> grads;        // by tensor id
  std::vector<at::Tensor> param_grads;  // by stage parameter id

 private:
  const GradStep& plan(const OpNode& op, int i) const;

  const BlockSpec& spec_;
  std::vector<at::Tensor>& tensors_;
  std::vector<uint64_t>& seeds_;
  bool replay_seeds_ = false;
  std::vector<at::Tensor>* reference_;
  at::TensorList params_;
  int64_t layer_;
  const RecomputeHook* hook_;
  const Step* step_ = nullptr;
  const void* handed_[kMaxOpInputs] = {};  // memory grad_buffer() handed over
};

}  // namespace remat::detail
