// The memory model: the exact bytes of one training step, from the tensor table and the compiled
// CompiledStep alone, without running anything (no ATen here: a 175B shape is replayed in
// milliseconds).
//
//   remat::StepMemory m = remat::simulate_memory(model->compiled_step());
//   m.total_peak()   // == MemoryTracker's peak of a real step on CPU, to the byte
//
// It is a fold over the same schedules the executor runs: each step's allocations and frees follow
// from the step itself (an op's outputs, its gradient plan, its scratch), and the rules that are
// LibTorch's own (autograd keeps the loss gradient until the backward ends; a tied parameter's
// second gradient is added into the first) are written once, here. The memory tests hold it equal
// to the tracker for every block kind and policy. See docs/design.md, NOTE [One plan].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "remat/block.h"
#include "remat/policy.h"
#include "remat/schedule.h"

namespace remat {

// Bytes of one training step as remat's engine and Adam run it. fp32: weights 4, gradients 4,
// Adam moments 8 bytes per parameter. bf16/fp16 (planning only; mixed precision as Megatron):
// weights 2, gradients 2, fp32 master weights and Adam moments 12.
struct StepMemory {
  int64_t params = 0;         // weights
  int64_t expert_params = 0;  // of `params`: the routed experts' (their gradients are reduced over
                              // the expert-data-parallel ranks, StepShape::expert_world)
  int64_t grads = 0;          // parameter gradients: alive from the backward to the next step, or (data
                              // parallelism) the persistent buckets, counted in `buffers`
  int64_t optimizer = 0;      // optimizer state (with ZeRO-1: this rank's share)
  int64_t data = 0;           // one batch: input and target
  int64_t buffers = 0;        // persistent communication buffers (data parallelism: gradient buckets)
  int64_t fixed = 0;          // a GPU framework's fixed allocations (workspaces, the batch: layout.h,
                              // RankPlan::fixed names them); 0 for remat's own engine
  int64_t saved = 0;          // live after the forward, above base()
  int64_t peak = 0;           // highest live during the step, above base()
  std::string peak_at;        // where the peak falls: "backward of layer 5, op 'fc'"
  // With StepShape::cuda: PyTorch's caching allocator over two steps (caching_allocator.h): the
  // peak of the blocks it hands out (each request rounded, unsplit tails included) and of the
  // segments it reserves. 0 otherwise.
  int64_t allocated_peak = 0;
  int64_t reserved_peak = 0;
  // Not memory: the bytes this rank's Adam step reads and writes (costs.h, adam_bytes_per_param of
  // each parameter it updates), which the planner's optimizer time is made of; counted here, from
  // the same shares and element sizes as `optimizer`.
  int64_t optimizer_traffic = 0;

  // Live before a step: weights, optimizer state, data, buffers, fixed allocations (gradients were freed).
  int64_t base() const { return params + optimizer + data + buffers + fixed; }
  int64_t total_peak() const { return base() + peak; }
};

// How a training step runs beyond one forward and one backward: gradient accumulation, a scaled
// loss, data parallelism (data_parallel.h), and the layouts of large runs (layout.h). With
// gradient buffers (always so with world > 1), each stage's parameter gradients are handed to
// persistent flat buffers, and freed, as the stage's backward returns; ZeRO shards what each rank
// keeps. A pipeline rank (stages > 1) runs the 1F1B schedule (interleaved with chunks > 1) over the
// chunks of its CompiledStep: it receives each micro-batch's activations and output gradients and
// frees what it sent. The default is the step remat bench and the planner run: one micro-batch,
// one process. See docs/design.md, NOTE [Parallel layouts].
struct StepShape {
  int micro = 1;             // micro-batches per optimizer step on this rank (--accum)
  bool scaled_loss = false;  // the loss is divided before its backward (micro-batches in all > 1)
  int world = 1;             // data-parallel ranks
  int rank = 0;              // this one's data-parallel rank
  // ZeRO stage: 1 shards the optimizer state (master weights and moments) over the world's ranks
  // (shard_first), 2 the gradient buffers too, 3 the weights too (each stage's whole weights are
  // gathered for its forward and again for its backward).
  int zero = 0;
  // Ranks the routed experts' parameters are sharded over instead (Megatron-LM's expert-data-parallel
  // group, Layout::expert_shards); 0: world.
  int expert_world = 0;
  // The ranks a parameter is sharded over: expert_world for a routed expert's (when set), else world.
  int world_of(bool expert) const { return expert && expert_world > 0 ? expert_world : world; }
  int64_t extra_buffers = 0;  // other persistent buffers of the trainer (the loss's all-reduce)
  bool grad_buffers = false;  // gradients go to persistent buffers even with world 1 (Megatron's main_grad)
  int grad_bytes = 0;         // bytes per element of the gradient buffers; 0: the weights' dtype
  int stages = 1;             // pipeline ranks
  int stage = 0;              // this rank's pipeline stage
  int chunks = 1;             // model chunks per pipeline rank (CompiledStep::chunks)
  // Linear weight gradients are accumulated by their GEMM straight into the gradient buffers
  // (Megatron-LM's gradient_accumulation_fusion): no weight-gradient tensor is made for them.
  bool fused_wgrad = false;
  // FSDP2 (fully_shard on each block, and on the model: its root unit, the embedding, the final
  // norm and the head, gathered and reduced as one): each rank keeps 1 / world of every parameter
  // in fp32 (the master copy) with its Adam state; a unit's bf16 weights are all-gathered for its
  // forward (a flat buffer on the all-gather stream, copied out into the parameters, kept until
  // the next copy-out or the end of the forward) and again for its backward (the next unit's
  // gathered ahead), and its gradients are reduce-scattered after its backward (the root's when
  // the whole backward is done) through an fp32 copy kept until the next unit's. Sharded gradients
  // exist from a unit's first backward of the step on. NOTE [FSDP2] in docs/design.md.
  bool fsdp = false;
  bool fsdp_reshard = true;       // weights freed after each block's forward (torchtitan: not with pipelines)
  bool fsdp_keep_last = false;    // but the last block's (torchtitan: its backward comes next)
  bool fsdp_root_reshard = true;  // the root's freed after the forward too (PyTorch 2.8 on; before, kept)
  // torch.optim's foreach Adam (torchtitan's): its step makes sqrt(v) of every parameter of the
  // rank at once (one fp32 tensor each), freed when the step ends, with the gradients still alive.
  bool foreach_adam = false;
  bool pure_dtype = false;  // no fp32 copies: weights, gradients and Adam states in the model's dtype
  // Replay the step through a model of PyTorch's CUDA caching allocator (StepMemory::allocated_peak,
  // reserved_peak): `fixed_blocks` first (a framework's workspaces and batch), the weights and
  // gradient buffers, then two steps in pipeline order with the optimizer state allocated at the
  // first optimizer step, as PyTorch's optimizers do. Slower: every op of every micro-batch.
  bool cuda = false;
  bool expandable_segments = false;  // PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  std::vector<int64_t> fixed_blocks;
  // The batch (input and target) is a GPU framework's own allocation, in StepMemory::fixed (its
  // "micro-batch" term): StepMemory::data stays 0, so that the batch is counted once.
  bool batch_in_fixed = false;
  bool op_by_op = false;  // with gradient buffers: replay every op of every micro-batch instead
                          // of folding the pipeline order over each chunk's passes (the same
                          // bytes, for the tests that say so)

  bool bucketed() const { return world > 1 || grad_buffers || stages > 1; }
};

// The step `remat train` runs on data-parallel rank `rank` of `world`: `accum` micro-batches, the
// loss scaled when there is more than one in all; with world > 1, gradient buckets, ZeRO-1 when
// zero is 1, and the loss's all-reduce buffer (one double).
StepShape trainer_step_shape(int accum, int world, int rank, int zero);

// The order in which pipeline stage `stage` of `stages` runs `micro` micro-batches over `chunks`
// model chunks: Megatron-LM's 1F1B, interleaved when chunks > 1 (then micro % stages == 0).
struct PipelineStep {
  bool forward = true;  // a forward pass, or a backward
  int micro = 0;        // the micro-batch, 0 .. micro - 1
  int chunk = 0;        // the model chunk, 0 .. chunks - 1
};
std::vector<PipelineStep> pipeline_order(int stages, int stage, int chunks, int micro);

// Levels of one simulated step, above base(), per stage; for the planner's constraints.
struct MemoryTrace {
  std::vector<int64_t> fwd_start, fwd_peak;  // per layer
  std::vector<int64_t> bwd_start, bwd_peak;  // per layer
  int64_t head_peak = 0;                     // forward and backward of the head: grows with every layer's saved bytes
  int64_t stem_peak = 0;                     // forward and backward of the stem: no layer's saved bytes are alive
};

// Replays one step of `plan`: forward of every stage, backward in reverse (each micro-batch, in
// pipeline order), the optimizer step. Fills `trace` when given (of the first micro-batch; steps
// without gradient buffers only).
// REQUIRES: plan.chunks.size() == shape.chunks. Throws remat::Error for uniform:N segments (NOTE
// [Segments]) under FSDP, ZeRO-3 or pipeline stages, which gather or send per stage.
StepMemory simulate_memory(const CompiledStep& plan, const ThreadConfig& ctx = {}, MemoryTrace* trace = nullptr,
                           const StepShape& shape = {});

// The same for `cfg` under `policy`.
StepMemory simulate_memory(const ModelConfig& cfg, const ResolvedPolicy& policy, const ThreadConfig& ctx = {});

// Bytes per element of FSDP's gradient reduce-scatter for a model of `dtype`: fp32 (gradients
// up-cast), or the model's dtype when nothing is kept in fp32 (StepShape::pure_dtype).
int64_t fsdp_reduce_bytes(DType dtype, bool pure_dtype);

// One block alone, fed a stand-in output gradient: the bytes it keeps after its forward and its
// working sets above the level at its start.
struct BlockMemory {
  int64_t saved = 0;           // Schedule::saved_bytes
  int64_t forward_extra = 0;   // peak above the start, during its forward
  int64_t backward_extra = 0;  // peak above the start of its backward, during its backward
};
BlockMemory simulate_block(const BlockSpec& spec, const Schedule& schedule, const ThreadConfig& ctx = {});

}  // namespace remat
