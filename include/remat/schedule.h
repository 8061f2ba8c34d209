// The compiled step: every decision about what runs, what is kept and how each gradient buffer is
// made is taken here, once. The executor carries a Schedule out; the memory model replays it on
// byte sizes (memory_model.h). See docs/design.md, NOTE [Recompute order] and NOTE [One plan].
//
//   remat::Schedule s = remat::compile_schedule(block, policy.layers[0]);
//   for (const remat::Step& st : s.backward) ...   // Recompute, Backward (with its gradient plan), Free
//
// A CompiledStep is one training step of a whole model: its stages in forward order, each with its
// schedule, and the parameters they share (a tied LM head). GPT runs it; simulate_memory replays it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "remat/block.h"
#include "remat/policy.h"

namespace remat {

// Where a backward step's gradient for one input comes from (the op's GradKind, decided).
enum class GradSource : uint8_t {
  None,       // the input needs no gradient (an int or bool tensor, or a data input)
  Fresh,      // the op allocates a new tensor
  OverDy,     // written over the op's output gradient, which is handed over to the op
  OverInput,  // written over the input itself, which dies at this step (its Free is dropped)
  Alias,      // the output gradient itself, shared (residual add)
  Slot,       // added in place into the input's gradient, prepared as `prep` says
};

// Slot only: the state the input's gradient is put in before the op adds into it.
enum class SlotPrep : uint8_t {
  Zeros,     // no gradient yet: a zeroed tensor
  Copy,      // the slot holds a shared gradient (an alias): a private copy first
  Existing,  // the slot holds a gradient of its own: add into it
};

// Every source but Slot and None: how the new gradient g joins the input's gradient slot.
enum class GradMerge : uint8_t {
  Set,            // the slot is empty: slot = g
  AddIntoSlot,    // the slot owns its memory: slot += g, g is dropped
  AddSlotIntoIt,  // the slot is shared and g is the op's own: g += slot, slot = g
  Sum,            // both are shared: slot = slot + g, a new tensor
};

struct GradStep {
  GradSource source = GradSource::None;
  SlotPrep prep = SlotPrep::Zeros;
  GradMerge merge = GradMerge::Set;
};

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
  // Recompute: bit i set when output i is still held from the forward; the recomputed value is
  // dropped at once, so a backward always reads exactly what the forward produced.
  uint8_t discard = 0;
  // Backward: the gradient plan of each input.
  GradStep grads[kMaxOpInputs];
  // Backward and FreeGrad: the gradient bytes allocated (> 0) and freed (< 0) at this step, in
  // order, as the plan makes them (NOTE [One plan]). made: while the op makes its input gradients,
  // before its parameter gradients and scratch (after the scratch of an op that names its
  // tensors, OpDef::scratch_tensors); joined: as they join their inputs' slots (a
  // FreeGrad's release, when it is the buffer's last reference).
  std::vector<int64_t> made, joined;
};

struct Schedule {
  std::vector<Step> forward;
  std::vector<Step> backward;          // backward steps with no gradient to propagate are left out
  std::vector<bool> saved;             // per tensor id: kept from the forward to the backward
  std::vector<int> recomputed;         // op ids rerun in the backward, in order
  std::vector<bool> need_input_grad;   // per stage input: the variant this schedule was compiled for
  std::vector<bool> input_grad_is_dy;  // per stage input: its gradient is the stage's incoming dy itself

  // Bytes of the saved tensors that are not stage inputs: what the stage adds to memory between
  // its forward and its backward (its output is counted by whoever keeps it).
  int64_t saved_bytes(const BlockSpec& spec) const;
};

// Compiles `policy` for `spec`. need_input_grad: per stage input (empty: all that can have one).
// REQUIRES: policy.tensors.size() == spec.tensors.size().
Schedule compile_schedule(const BlockSpec& spec, const LayerPolicy& policy, std::vector<bool> need_input_grad = {});

// One stage of a CompiledStep.
struct CompiledStage {
  enum class Role : uint8_t { Stem, Block, Head };
  Role role = Role::Block;
  int64_t layer = 0;                // blocks: 0..layers-1; the stem -1; the head `layers`
  const BlockSpec* spec = nullptr;  // points into CompiledStep::model
  std::shared_ptr<const Schedule> schedule;
  std::vector<int> params;     // model parameter id of each of the stage's parameters
  std::vector<bool> external;  // per stage input: data owned by the caller (needs no gradient)
  int chunk = 0;               // pipeline parallelism: the model chunk it belongs to (CompiledStep::chunks)
  // uniform:N (NOTE [Segments]): the segment of blocks this one runs in (layer / N; consecutive
  // blocks with one number form it), -1 outside one; and the schedule of the segment's first
  // forward, which keeps nothing (every choosable tensor recomputed). `schedule` then runs the rerun
  // and the backward.
  int64_t segment = -1;
  std::shared_ptr<const Schedule> first_pass;
};

// A parameter of the model, once (a tied parameter is one entry used by two stages).
struct ModelParam {
  std::string name;  // "wte", "h0.qkv.weight", "lnf.weight"
  const ParamSpec* spec = nullptr;
  int uses = 0;  // stages that read it: 2 for a tied parameter
};

// Consecutive layers [first, end) of a model: one pipeline rank's model chunk.
struct LayerRange {
  int64_t first = 0, end = 0;
};

struct CompiledStep {
  std::shared_ptr<const ModelSpec> model;
  std::vector<ModelParam> params;     // in registration order: stem, blocks, head
  std::vector<CompiledStage> stages;  // forward order: stem, blocks, head
  int64_t segment = 0;                // ResolvedPolicy::segment (uniform:N): N, 0 for none
  // The layers of each model chunk, in the order the stages list them: one chunk of every layer
  // for a whole model; a pipeline rank's chunks otherwise (the stem goes with layer 0, the head
  // with the last layer).
  std::vector<LayerRange> chunks;

  // REQUIRES: the plan holds every layer (one chunk).
  const CompiledStage& block(int64_t layer) const {
    return stages[static_cast<size_t>(layer) + (model->has_stem ? 1 : 0)];
  }
};

// Compiled schedules by (block, saved set, gradient variant): layers with equal choices share one.
// The planner keeps one across its many simulations. Not thread-safe.
class ScheduleCache {
 public:
  std::shared_ptr<const Schedule> get(const BlockSpec& spec, const LayerPolicy& policy,
                                      const std::vector<bool>& need_input_grad);

 private:
  std::unordered_map<std::string, std::shared_ptr<const Schedule>> entries_;  // by key(): block, saves, need
  std::string key_;
};

// The step of `model` under `policy`: stem and head keep everything, block l runs policy.layers[l].
// REQUIRES: policy.layers.size() == model->layers.
CompiledStep compile_step(std::shared_ptr<const ModelSpec> model, const ResolvedPolicy& policy,
                          ScheduleCache* cache = nullptr);

// One pipeline rank's part of the step: the layers of `chunks` (ascending, disjoint), with the
// stem when they hold layer 0 and the head when they hold the last. A rank with the head but not
// the stem keeps its own copy of a tied parameter (Megatron's copy of the word embedding).
CompiledStep compile_step(std::shared_ptr<const ModelSpec> model, const ResolvedPolicy& policy,
                          const std::vector<LayerRange>& chunks, ScheduleCache* cache = nullptr);

// The former names of CompiledStep and CompiledStage, for one release.
using StepPlan [[deprecated("renamed remat::CompiledStep")]] = CompiledStep;
using StagePlan [[deprecated("renamed remat::CompiledStage")]] = CompiledStage;

}  // namespace remat
