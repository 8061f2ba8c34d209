// The op-level engine: runs one stage (any BlockSpec) as its compiled Schedule says.
//
// Forward keeps only what the schedule saves. Backward walks the schedule: recomputes what each
// op's backward reads and is missing, runs the backward with the gradient plan the schedule chose
// (fresh, over dy, over the input, alias, into a slot), and frees every tensor right after its last
// use. Nothing is decided here that the memory model would have to decide again.
//
//   auto exec = std::make_shared<remat::BlockExecutor>(block, policy.layers[0]);
//   at::Tensor y = remat::run_stage(exec, {x}, params, /*layer=*/0);   // one autograd node
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"
#include "remat/policy.h"
#include "remat/schedule.h"

namespace remat {

// Per-op wall time, filled when an ExecOptions::timer is given (the planner's profiling pass and
// `remat bench --profile`).
struct OpTimes {
  std::vector<double> forward_ms;  // by op id, summed over calls
  std::vector<double> recompute_ms;
  std::vector<double> backward_ms;
  std::vector<int64_t> calls;  // forward calls

  void resize(size_t ops);  // zeroed, `ops` entries each
  void zero();              // keeps the sizes
};

struct ExecOptions {
  // Keep a copy of every tensor the backward will recompute and check that the recompute is
  // bitwise equal to it; throws remat::Error naming the tensor and layer otherwise.
  bool verify = false;
  // When set, every op's time is added here (sized for the block stage's ops).
  std::shared_ptr<OpTimes> timer;
  // When set, called with each tensor a recompute produces, before it is checked and kept (for
  // debugging, and for the tests that show --verify catches a wrong recompute).
  std::function<void(const TensorSpec& tensor, int64_t layer, at::Tensor& value)> after_recompute;
};

// What a forward leaves for its backward.
struct BlockContext {
  std::vector<at::Tensor> tensors;    // by tensor id; defined while held
  std::vector<uint64_t> seeds;        // by op id: random seeds drawn in the forward (dropout)
  std::vector<at::Tensor> reference;  // verify mode: forward values of tensors to be recomputed
};

class BlockExecutor {
 public:
  // Compiles `policy` for `spec` (both gradient variants lazily).
  BlockExecutor(BlockSpec spec, LayerPolicy policy, ExecOptions options = {});
  // Runs a schedule compiled elsewhere (a CompiledStep's). REQUIRES: it was compiled for `spec`.
  BlockExecutor(const BlockSpec& spec, std::shared_ptr<const Schedule> schedule, ExecOptions options = {});

  // The block's table, and the schedule compiled from it and the policy (every input needing a
  // gradient).
  const BlockSpec& spec() const { return spec_; }
  const Schedule& schedule() const { return *schedule_; }

  // Runs the forward. `inputs` in spec().inputs order, `params` in spec().params order. Returns
  // the output; ctx keeps the saved tensors. `layer` names the layer in errors. With replay_seeds,
  // ctx.seeds already holds the seeds an earlier forward of this stage drew (a uniform:N segment's
  // rerun) and the random ops use them; otherwise they are drawn from the default generator.
  at::Tensor forward(at::TensorList inputs, at::TensorList params, BlockContext& ctx, int64_t layer,
                     bool replay_seeds = false) const;

  struct Grads {
    std::vector<at::Tensor> inputs;  // undefined where not needed
    std::vector<at::Tensor> params;
  };
  // Runs the backward from the output gradient (the output's shape); consumes ctx, so a second
  // backward without a forward is refused. need_input_grad has one flag per input; a variant other
  // than the schedule's is compiled on first use. Throws remat::Error for a wrong shape or count.
  Grads backward(const at::Tensor& dy, at::TensorList params, BlockContext& ctx,
                 const std::vector<bool>& need_input_grad, int64_t layer) const;

 private:
  // The schedule compiled for `need`: schedule_, or another variant compiled on first use and
  // kept (one at a time; a backward holds its own reference while it runs).
  std::shared_ptr<const Schedule> schedule_for(const std::vector<bool>& need) const;

  BlockSpec spec_;
  LayerPolicy policy_;                             // empty when built from a schedule
  std::shared_ptr<const Schedule> schedule_;       // the variant every input needs a gradient for
  mutable std::mutex other_mutex_;                 // two backwards at once may both ask for one
  mutable std::shared_ptr<const Schedule> other_;  // another variant, compiled on first use
  ExecOptions options_;
};

// Where a stage's parameter gradients go instead of to autograd (data parallelism's buckets): called
// with each one's model parameter id as the stage's backward returns; autograd then sees none.
using GradSink = std::function<void(int param, at::Tensor grad)>;

// Runs `exec` as one autograd node: output = stage(inputs, params); its backward calls
// BlockExecutor::backward. With a sink, the parameter gradients go to it (param_ids: the model id
// of each of `params`). Throws remat::Error on double backward.
at::Tensor run_stage(std::shared_ptr<const BlockExecutor> exec, at::TensorList inputs, at::TensorList params,
                     int64_t layer, std::shared_ptr<const GradSink> sink = nullptr,
                     const std::vector<int>* param_ids = nullptr);

// One stage of a uniform:N segment (CompiledStage::segment).
struct SegmentStage {
  std::shared_ptr<const BlockExecutor> first;  // runs CompiledStage::first_pass: keeps nothing
  std::shared_ptr<const BlockExecutor> exec;   // runs CompiledStage::schedule: the rerun and the backward
  std::vector<at::Tensor> params;
  int64_t layer = 0;
  std::vector<int> param_ids;  // with a sink: the model id of each of `params`
};

// Runs consecutive one-input stages as one segment, one autograd node (NOTE [Segments]): the
// forward runs each stage's `first` executor and keeps the segment's input and the random seeds
// drawn; the backward reruns the forwards with `exec` (the same seeds, so the same bits), then runs
// their backwards from the last stage. verify: the rerun's stage outputs are checked bitwise against
// the first forward's (throws remat::Error naming the layer). Parameter gradients go to `sink` as each
// stage's backward returns, or to autograd when the segment's does.
at::Tensor run_segment(std::vector<SegmentStage> stages, const at::Tensor& x, std::shared_ptr<const GradSink> sink,
                       bool verify);

}  // namespace remat
