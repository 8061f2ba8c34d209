// The op-level engine: runs one stage (any BlockSpec) under a LayerPolicy.
//
// Forward keeps only what the policy saves. Backward walks the ops in reverse; before each op's
// backward it recomputes whatever that backward reads and is missing, from the nearest kept
// tensors, running each op at most once, and frees every tensor right after its last use. Both
// passes follow a Schedule compiled once from (spec, policy). The memory accounting (and the
// planner) replays the same Schedule on byte sizes. See docs/design.md, NOTE [Recompute order].
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"
#include "remat/policy.h"

namespace remat {

struct Step {
  enum class Kind : uint8_t {
    Forward,    // run op `index` in the forward pass
    Recompute,  // rerun op `index` in the backward pass
    Backward,   // run the backward of op `index`
    Free,       // drop tensor `index`
    FreeGrad,   // drop the gradient of tensor `index`
  };
  Kind kind;
  int index;
  // Backward only: bit i set when input i of the op dies with this step (no later step reads it
  // and it is not a stage input), so a GradKind::OverInput gradient may be written over it.
  uint8_t last_read = 0;
};

struct Schedule {
  std::vector<Step> forward;
  std::vector<Step> backward;
  std::vector<bool> saved;       // per tensor id: kept from the forward to the backward
  std::vector<int> recomputed;   // op ids rerun in the backward, in order

  // Bytes of the saved tensors that are not stage inputs: what the stage adds to memory between
  // its forward and its backward (its output is counted by whoever keeps it).
  int64_t saved_bytes(const BlockSpec& spec) const;
};

// REQUIRES: policy.tensors.size() == spec.tensors.size().
Schedule compile_schedule(const BlockSpec& spec, const LayerPolicy& policy);

// Per-op wall time, filled when an ExecOptions::timer is given (the planner's profiling pass and
// `remat bench --profile`).
struct OpTimes {
  std::vector<double> forward_ms;    // by op id, summed over calls
  std::vector<double> recompute_ms;
  std::vector<double> backward_ms;
  std::vector<int64_t> calls;        // forward calls

  void zero();                       // keeps the sizes
};

struct ExecOptions {
  // Keep a copy of every tensor the backward will recompute and check that the recompute is
  // bitwise equal to it; throws remat::Error naming the tensor and layer otherwise.
  bool verify = false;
  // When set, every op's time is added here (one OpTimes per stage kind).
  std::shared_ptr<OpTimes> timer;
};

// What a forward leaves for its backward.
struct BlockContext {
  std::vector<at::Tensor> tensors;   // by tensor id; defined while held
  std::vector<uint64_t> seeds;       // by op id: dropout seeds drawn in the forward
  std::vector<at::Tensor> reference; // verify mode: forward values of tensors to be recomputed
};

class BlockExecutor {
 public:
  BlockExecutor(BlockSpec spec, LayerPolicy policy, ExecOptions options = {});

  const BlockSpec& spec() const { return spec_; }
  const LayerPolicy& policy() const { return policy_; }
  const Schedule& schedule() const { return schedule_; }

  // Runs the forward. `inputs` in spec().inputs order, `params` in spec().params order. Returns
  // the output; ctx keeps the saved tensors. `layer` names the layer in errors.
  at::Tensor forward(at::TensorList inputs, at::TensorList params, BlockContext& ctx, int64_t layer) const;

  struct Grads {
    std::vector<at::Tensor> inputs;  // undefined where not needed
    std::vector<at::Tensor> params;
  };
  // Runs the backward from the output gradient; consumes ctx.
  Grads backward(const at::Tensor& dy, at::TensorList params, BlockContext& ctx,
                 const std::vector<bool>& need_input_grad, int64_t layer) const;

 private:
  BlockSpec spec_;
  LayerPolicy policy_;
  Schedule schedule_;
  ExecOptions options_;
};

// Runs `exec` as one autograd node: output = stage(inputs, params); its backward calls
// BlockExecutor::backward. Throws remat::Error on double backward.
at::Tensor run_stage(std::shared_ptr<const BlockExecutor> exec, at::TensorList inputs, at::TensorList params,
                     int64_t layer);

}  // namespace remat
