// The memory model: a fold over a CompiledStep's schedules on byte sizes (NOTE [One plan]).
//
// Every decision (what is saved, what is recomputed, how each gradient buffer is made and merged)
// is read from the schedule. What is written here is what memory does as a consequence: an
// allocation counts its bytes, a buffer shared by several gradient slots is released with its last
// reference, and five rules of LibTorch's autograd that no schedule can say:
//   1. autograd's gradient of the loss (the backward's root) lives until the whole backward ends;
//   2. a stage's incoming gradient lives until the stage returns, unless the stage hands it back
//      as its own input's gradient (a residual add), when it lives on as the next one's;
//   3. a parameter used by two stages (the tied LM head) gets its two gradients summed by the
//      autograd engine once the second stage returns (and its dy is gone): LibTorch 1.13's
//      InputBuffer adds them out of place, into a new tensor, then frees both;
//   4. a parameter's first gradient of a step becomes its .grad (AccumulateGrad steals it); later
//      micro-batches' are added into it in place and freed;
//   5. a loss divided before its backward (accumulation, data parallelism) gets its gradient through
//      the division: one more scalar alive during the head's backward.
#include "remat/memory_model.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/shard.h"
#include "plan/caching_allocator.h"
#include "plan/unshard.h"
#include "remat/costs.h"
#include "remat/error.h"

namespace remat {

namespace {

struct Where {
  const char* pass = "";  // "forward", "backward", "recompute"
  const CompiledStage* stage = nullptr;
  int op = -1;
};

class Sim {
 public:
  // With `cuda`, every allocation and free also goes to the caching allocator's model; a free of n
  // bytes releases the latest live block of n bytes on that stream (tensors of one size are alike
  // to it), unless it names its block (take, give).
  explicit Sim(detail::CachingAllocatorModel* cuda = nullptr) : cuda_(cuda) {}
  // `stream`: the CUDA stream that allocates it (FSDP2's all-gather and reduce-scatter have their own).
  void alloc(int64_t n, int stream = 0) {
    const int block = take(n, stream);
    if (block >= 0) by_size_[{n, stream}].push_back(block);
  }
  void free(int64_t n, int stream = 0) {
    int block = -1;
    if (cuda_ && n > 0) {
      std::vector<int>& live = by_size_[{n, stream}];
      if (live.empty()) REMAT_INTERNAL("the memory model frees {} bytes it never allocated", n);
      block = live.back();
      live.pop_back();
    }
    give(n, block);
  }
  // An allocation whose block is freed by name (give), for blocks of one size that die out of the
  // order they were made in; returns the block (-1 without the allocator's model).
  int take(int64_t n, int stream = 0) {
    live_ += n;
    peak_ = std::max(peak_, live_);
    if (live_ > top_) {
      top_ = live_;
      peak_at_ = where_;
    }
    return cuda_ && n > 0 ? cuda_->alloc(n, stream) : -1;
  }
  void give(int64_t n, int block) {
    live_ -= n;
    if (block < 0) return;
    if (!cuda_) REMAT_INTERNAL("the memory model frees block {} of another replay", block);
    cuda_->free(block);
  }
  void at(const char* pass, const CompiledStage* stage, int op) { where_ = {pass, stage, op}; }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  // Where the highest level of the whole run was reached, and that level.
  const Where& peak_at() const { return peak_at_; }
  int64_t top() const { return top_; }
  // Starts a new peak measurement at the current level (peak_at keeps the run's highest).
  void restart_peak() { peak_ = live_; }

 private:
  int64_t live_ = 0, peak_ = 0, top_ = 0;
  Where where_, peak_at_;
  detail::CachingAllocatorModel* cuda_ = nullptr;
  std::map<std::pair<int64_t, int>, std::vector<int>> by_size_;  // live handles by (size, stream), latest last
};

constexpr const char* kOptimizerStep = "optimizer step (foreach Adam's sqrt(v) of every parameter)";

std::string describe(const Where& w) {
  if (w.stage == nullptr) return *w.pass ? w.pass : "start of the step";
  const std::string stage = w.stage->role == CompiledStage::Role::Stem   ? "the embedding"
                            : w.stage->role == CompiledStage::Role::Head ? "the head"
                                                                         : fmt::format("layer {}", w.stage->layer);
  if (w.op < 0) return fmt::format("{} after the backward of {}", w.pass, stage);
  return fmt::format("{} of {}, op '{}'", w.pass, stage, w.stage->spec->ops[w.op].name);
}

// What eager PyTorch keeps beside each tensor of a stage (ModelConfig::eager_ops), by tensor id,
// as the blocks the caching allocator sees: an eager op's extras (OpDef::eager_tensors of them) live
// and die with its first output (or OpDef::eager_input). Empty when no op of the stage has any.
using EagerBlocks = std::vector<std::vector<int64_t>>;
EagerBlocks eager_blocks(const BlockSpec& b) {
  EagerBlocks out;
  for (size_t i = 0; i < b.ops.size(); ++i) {
    const int64_t n = b.eager_saved(static_cast<int>(i));
    if (n == 0) continue;
    if (out.empty()) out.resize(b.tensors.size());
    const OpDef& def = op_def(b.ops[i].kind);
    const int t = def.eager_input >= 0 ? b.ops[i].in[def.eager_input] : b.ops[i].out[0];
    if (n % def.eager_tensors != 0)
      REMAT_INTERNAL("op {}'s eager bytes {} are not {} equal tensors", b.ops[i].name, n, def.eager_tensors);
    for (int k = 0; k < def.eager_tensors; ++k) out[t].push_back(n / def.eager_tensors);
  }
  return out;
}

// What eager PyTorch keeps beside tensor t (eager_blocks), in bytes.
int64_t eager_bytes(const EagerBlocks& eager, int t) {
  int64_t n = 0;
  if (!eager.empty())
    for (int64_t e : eager[t]) n += e;
  return n;
}

// A tensor made (or let go of), and its eager extras beside it, each a block of its own.
void alloc_live(Sim& sim, const BlockSpec& b, const EagerBlocks& eager, int t) {
  sim.alloc(b.tensors[t].bytes());
  if (!eager.empty())
    for (int64_t e : eager[t]) sim.alloc(e);
}
void free_live(Sim& sim, const BlockSpec& b, const EagerBlocks& eager, int t) {
  if (!eager.empty())
    for (int64_t e : eager[t]) sim.free(e);
  sim.free(b.tensors[t].bytes());
}

// An op's forward (backward) scratch as the allocator sees it: the tensors it is
// (OpDef::scratch_tensors), or one block of its bytes. Returns those still alive (scratch_done
// frees them).
std::vector<int64_t> scratch(Sim& sim, const BlockSpec& b, int op, const ThreadConfig& ctx, bool backward) {
  const OpDef& def = op_def(b.ops[op].kind);
  const std::vector<int64_t> tensors =
      def.scratch_tensors ? def.scratch_tensors(b, b.ops[op], backward)
                          : std::vector<int64_t>{backward ? b.backward_scratch(op, ctx) : b.forward_scratch(op, ctx)};
  std::vector<int64_t> alive;
  for (int64_t n : tensors) {
    if (n >= 0) {
      sim.alloc(n);
      alive.push_back(n);
      continue;
    }
    const auto it = std::find(alive.begin(), alive.end(), -n);
    if (it == alive.end()) REMAT_INTERNAL("op {}'s scratch frees {} bytes it did not make", b.ops[op].name, -n);
    alive.erase(it);
    sim.free(-n);
  }
  return alive;
}
void scratch_done(Sim& sim, const std::vector<int64_t>& alive) {
  for (int64_t n : alive) sim.free(n);
}

// A stage's forward: its own schedule's, or another (a uniform:N segment's first forward); `pass`
// names it where it peaks.
// `before_loss`, if given, runs once before a cross-entropy op: the model's forward has returned
// (a framework computes the loss outside the model, after FSDP2's root post-forward).
void forward_stage(Sim& sim, const CompiledStage& st, const ThreadConfig& ctx, const Schedule* schedule = nullptr,
                   const char* pass = "forward", const std::function<void()>& before_loss = {}) {
  const BlockSpec& b = *st.spec;
  const EagerBlocks eager = eager_blocks(b);
  for (const Step& step : (schedule ? *schedule : *st.schedule).forward) {
    if (step.kind == Step::Kind::Free) {
      free_live(sim, b, eager, step.index);
      continue;
    }
    if (before_loss && b.ops[step.index].kind == OpKind::CrossEntropy) before_loss();
    sim.at(pass, &st, step.index);
    for (int t : b.ops[step.index].out) alloc_live(sim, b, eager, t);
    scratch_done(sim, scratch(sim, b, step.index, ctx, false));
  }
}

// What becomes of the parameter gradients a stage makes, when it returns (rules 3 and 4).
enum class Grads : uint8_t {
  First,   // the step's first micro-batch: they become .grad
  Later,   // a later micro-batch: added into .grad, then freed
  Handed,  // data parallelism: copied into the buckets, then freed
};

// The parameter gradients of the running stage and micro-batch (rules 3 and 4).
struct ParamGrads {
  std::vector<bool> has;        // by model parameter: already has one gradient in this micro-batch
  std::vector<int> uses;        // by model parameter: stages that read it
  std::vector<int64_t> single;  // gradients of parameters one stage reads
  std::vector<int64_t> held;    // first gradients of a tied parameter: autograd holds them for the second
  std::vector<int64_t> second;  // second gradients of a tied parameter
};

// One stage's backward, with its incoming gradient owned by the caller. input_kept: something else
// holds its first input until later (a uniform:N segment's input, which autograd keeps), so its
// Free leaves the bytes.
class StageBackward {
 public:
  // `before_weights`, if given, runs once before the first op with parameters (FSDP2's pre-backward
  // hook on the head, which fires when the gradient reaches the logits: after the loss's backward).
  StageBackward(Sim& sim, const CompiledStage& st, ParamGrads& pg, const ThreadConfig& ctx, bool fused_wgrad,
                bool input_kept = false, std::function<void()> before_weights = {})
      : sim_(sim),
        st_(st),
        b_(*st.spec),
        pg_(pg),
        ctx_(ctx),
        fused_wgrad_(fused_wgrad),
        input_kept_(input_kept),
        before_weights_(std::move(before_weights)),
        eager_(eager_blocks(b_)),
        held_(st.schedule->saved) {}

  void run() {
    for (const Step& step : st_.schedule->backward) {
      switch (step.kind) {
        case Step::Kind::Free: {
          const int k = b_.input_index(step.index);
          if (held_[step.index] && !(k >= 0 && (st_.external[k] || (k == 0 && input_kept_))))
            free_live(sim_, b_, eager_, step.index);
          held_[step.index] = false;
          break;
        }
        case Step::Kind::FreeGrad:
          move(step.joined);
          break;
        case Step::Kind::Recompute:
          recompute(step);
          break;
        case Step::Kind::Backward:
          backward(step);
          break;
        case Step::Kind::Forward:
          break;
      }
    }
  }

 private:
  void recompute(const Step& step) {
    const OpNode& op = b_.ops[step.index];
    sim_.at("recompute", &st_, step.index);
    for (int t : op.out) alloc_live(sim_, b_, eager_, t);
    scratch_done(sim_, scratch(sim_, b_, step.index, ctx_, false));
    for (size_t i = 0; i < op.out.size(); ++i) {
      if (step.discard & (1u << i)) free_live(sim_, b_, eager_, op.out[i]);  // the forward's value is kept
      held_[op.out[i]] = true;
    }
  }

  // The op makes its gradients, then each joins its input's slot: the bytes the plan moves.
  void backward(const Step& step) {
    const OpNode& op = b_.ops[step.index];
    if (before_weights_ && !op.params.empty()) {
      before_weights_();
      before_weights_ = {};
    }
    sim_.at("backward", &st_, step.index);
    // An op that names its scratch's tensors makes them before its gradients (OpDef::scratch_tensors);
    // another's scratch comes after them.
    const bool tensors_first = op_def(op.kind).scratch_tensors != nullptr;
    std::vector<int64_t> alive;
    if (tensors_first) alive = scratch(sim_, b_, step.index, ctx_, true);
    move(step.made);
    for (size_t p = 0; p < op.params.size(); ++p) {
      if (fused_wgrad_ && op.kind == OpKind::Linear && p == 0) continue;  // into the buffer by its GEMM
      const int64_t n = b_.param_bytes(op.params[p]);
      sim_.alloc(n);
      const int id = st_.params[op.params[p]];
      (pg_.uses[id] == 1 ? pg_.single : pg_.has[id] ? pg_.second : pg_.held).push_back(n);
      pg_.has[id] = true;
    }
    if (!tensors_first) alive = scratch(sim_, b_, step.index, ctx_, true);
    scratch_done(sim_, alive);
    move(step.joined);
  }

  void move(const std::vector<int64_t>& bytes) {
    for (int64_t n : bytes) n > 0 ? sim_.alloc(n) : sim_.free(-n);
  }

  Sim& sim_;
  const CompiledStage& st_;
  const BlockSpec& b_;
  ParamGrads& pg_;
  const ThreadConfig& ctx_;
  const bool fused_wgrad_;
  const bool input_kept_;
  std::function<void()> before_weights_;
  const EagerBlocks eager_;
  std::vector<bool> held_;  // each tensor's value is alive
};

void backward_stage(Sim& sim, const CompiledStage& st, ParamGrads& pg, const ThreadConfig& ctx,
                    bool fused_wgrad = false, std::function<void()> before_weights = {}) {
  StageBackward(sim, st, pg, ctx, fused_wgrad, false, std::move(before_weights)).run();
}

// After a stage has returned (and its dy is gone): its parameter gradients, by rules 3 and 4.
void settle(Sim& sim, ParamGrads& pg, Grads mode) {
  if (mode == Grads::Handed) {
    for (auto* v : {&pg.single, &pg.held, &pg.second})  // each copied into its bucket as it arrives
      for (int64_t n : *v) sim.free(n);
  } else {
    // The tied sums, out of place: each pair of a held first gradient and its second.
    const size_t pairs = pg.second.size();
    for (size_t i = 0; i < pairs; ++i) {
      sim.alloc(pg.second[i]);
      sim.free(pg.held[i]);
      sim.free(pg.second[i]);
    }
    pg.held.erase(pg.held.begin(), pg.held.begin() + static_cast<std::ptrdiff_t>(pairs));
    if (mode == Grads::Later)  // added into .grad
      for (auto* v : {&pg.single, &pg.second})
        for (int64_t n : *v) sim.free(n);
  }
  pg.single.clear();
  pg.second.clear();
  if (mode == Grads::Handed) pg.held.clear();
}

}  // namespace

StepShape trainer_step_shape(int accum, int world, int rank, int zero) {
  StepShape s;
  s.micro = accum;
  s.scaled_loss = accum * world > 1;
  s.world = world;
  s.rank = rank;
  s.zero = zero;
  if (world > 1) s.extra_buffers = sizeof(double);
  return s;
}

std::vector<PipelineStep> pipeline_order(int stages, int stage, int chunks, int micro) {
  if (stages < 1 || chunks < 1 || micro < 1 || stage < 0 || stage >= stages)
    fail("pipeline_order: stage {} of {} stages, {} chunks, {} micro-batches; each count >= 1, stage in 0..stages-1",
         stage, stages, chunks, micro);
  if (chunks > 1 && micro % stages != 0)
    fail("pipeline_order: interleaving {} chunks needs micro-batches ({}) a multiple of the stages ({})", chunks, micro,
         stages);
  std::vector<PipelineStep> order;
  const int p = stages, v = chunks, total = micro * chunks;
  // Megatron's warm-up: forwards until the first backward can come back from the last stage.
  const int warmup = std::min(total, v == 1 ? p - stage - 1 : (p - stage - 1) * 2 + (v - 1) * p);
  auto step = [&](bool forward, int k) {
    if (v == 1) return PipelineStep{forward, k, 0};
    const int group = k / p;  // virtual micro-batches run in groups of p per chunk
    const int chunk = forward ? group % v : v - 1 - group % v;
    return PipelineStep{forward, group / v * p + k % p, chunk};
  };
  for (int k = 0; k < warmup; ++k) order.push_back(step(true, k));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(step(true, warmup + k));
    order.push_back(step(false, k));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(step(false, k));
  return order;
}

namespace {

// The micro-batch count whose pipeline order reaches the same levels as `micro`'s: in the steady
// state of 1F1B each forward of one chunk is paired with a backward, and the chunks cycle with a
// period of stages x chunks virtual micro-batches, every period returning to the level it began
// at. Whole periods past the first `kept` are left out (keeping the count modulo the period, so
// the cool-down runs the same chunks): a step of a million micro-batches folds in a few hundred.
// `kept` is 2 where the first period leaves memory behind that the later ones keep (FSDP2's
// sharded gradients, made by the first backward): the levels repeat from the second period on.
int periodic_micro(int stages, int stage, int chunks, int micro, int kept) {
  const int64_t total = int64_t{micro} * chunks;
  const int64_t warmup =
      std::min<int64_t>(total, chunks == 1 ? stages - stage - 1 : (stages - stage - 1) * 2 + (chunks - 1) * stages);
  const int64_t period = int64_t{stages} * chunks, steady = total - warmup;
  if (steady / period <= kept) return micro;
  return micro - static_cast<int>((steady / period - kept) * stages);
}

}  // namespace

namespace {

// The stages of one pipeline chunk, and whether it begins or ends the model.
struct Chunk {
  size_t first = 0, last = 0;  // stage indices, inclusive
  bool begins = false, ends = false;
};

std::vector<Chunk> chunks_of(const CompiledStep& plan) {
  std::vector<Chunk> chunks(plan.chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    bool any = false;
    for (size_t i = 0; i < plan.stages.size(); ++i) {
      if (plan.stages[i].chunk != static_cast<int>(c)) continue;
      if (!any) chunks[c].first = i;
      chunks[c].last = i;
      any = true;
    }
    const CompiledStage& f = plan.stages[chunks[c].first];
    chunks[c].begins = !f.external.empty() && f.external[0];
    chunks[c].ends = plan.stages[chunks[c].last].role == CompiledStage::Role::Head;
  }
  return chunks;
}

// Bytes per element of what a rank keeps between steps.
struct ElementBytes {
  int64_t weight = 0;  // the model's dtype
  int64_t grad = 0;    // a bucket's gradient (StepShape::grad_bytes, else the model's dtype)
  int64_t reduce = 0;  // FSDP's reduce-scatter input: gradients in its reduce dtype (fp32, up-cast,
                       // unless nothing is kept in fp32)
  int64_t master = 0;  // the fp32 master copy of mixed precision; 0 without one
  int64_t state = 0;   // Adam's m and v: fp32, or the model's dtype when nothing is kept in fp32
  int64_t sharded_weight() const { return master > 0 ? master : weight; }  // FSDP2's shard: the master copy
};

}  // namespace

int64_t fsdp_reduce_bytes(DType dtype, bool pure_dtype) {
  return pure_dtype ? dtype_size(dtype) : dtype_size(DType::F32);
}

namespace {

ElementBytes element_bytes(DType dtype, const StepShape& shape) {
  ElementBytes e;
  e.weight = dtype_size(dtype);
  e.grad = shape.grad_bytes > 0 ? shape.grad_bytes : e.weight;
  e.reduce = fsdp_reduce_bytes(dtype, shape.pure_dtype);
  e.master = dtype != DType::F32 && !shape.pure_dtype ? dtype_size(DType::F32) : 0;
  e.state = shape.pure_dtype ? 2 * e.weight : 2 * dtype_size(DType::F32);
  return e;
}

// What a rank keeps between steps: weights, gradients, optimizer state, buckets and the batch.
StepMemory persistent_memory(const CompiledStep& plan, const StepShape& shape, const ElementBytes& e) {
  StepMemory m;
  int64_t numel = 0, expert_numel = 0;
  for (const ModelParam& p : plan.params) (p.spec->expert ? expert_numel : numel) += p.spec->numel();
  // ZeRO: this rank's share of the parameters, laid end to end. The routed experts' parameters are
  // shared by fewer ranks (StepShape::expert_world).
  auto share = [](int64_t n, int rank, int world) {
    return shard_first(n, rank + 1, world) - shard_first(n, rank, world);
  };
  const int expert_world = shape.world_of(/*expert=*/true);
  const int64_t owned_experts = share(expert_numel, shape.rank % expert_world, expert_world);
  const int64_t owned = share(numel, shape.rank, shape.world) + owned_experts;
  numel += expert_numel;
  if (shape.fsdp) {  // the sharded weights are the master copy; gradients are made in the backward
    m.params = owned * e.sharded_weight();
    m.expert_params = owned_experts * e.sharded_weight();
    m.grads = owned * e.sharded_weight();
    m.optimizer = owned * e.state;
    m.optimizer_traffic = owned * adam_bytes_per_param(e.sharded_weight(), e.sharded_weight(), e.state, 0);
    m.buffers = shape.extra_buffers;
  } else {
    m.params = (shape.zero >= 3 ? owned : numel) * e.weight;
    m.expert_params = (shape.zero >= 3 ? owned_experts : expert_numel) * e.weight;
    m.grads = shape.bucketed() ? (shape.zero >= 2 ? owned : numel) * e.grad : numel * e.weight;
    const int64_t updated = shape.zero >= 1 ? owned : numel;  // what this rank's Adam step updates
    m.optimizer = updated * (e.master + e.state);
    // The gradient as it waits for the step: in its bucket's dtype under data parallelism.
    const int64_t grad = shape.bucketed() ? e.grad : e.weight;
    m.optimizer_traffic =
        updated * adam_bytes_per_param(grad, e.sharded_weight(), e.state, e.master > 0 ? e.weight : 0);
    if (shape.bucketed()) m.buffers = m.grads + shape.extra_buffers;
  }
  if (!shape.batch_in_fixed) {
    for (const CompiledStage& st : plan.stages) {
      if (st.role == CompiledStage::Role::Stem || (st.external.size() > 0 && st.external[0]))
        m.data += st.spec->tensors[st.spec->inputs[0]].bytes();
      if (st.role == CompiledStage::Role::Head) m.data += st.spec->tensors[st.spec->inputs[1]].bytes();
    }
  }
  return m;
}

// One rank's step replayed op by op on byte sizes: its chunks' forwards and backwards in pipeline
// order, with FSDP2's all-gathers and reduce-scatters (StepShape::fsdp) where its hooks run them.
class StepReplay {
 public:
  StepReplay(const CompiledStep& plan, const ThreadConfig& ctx, const StepShape& shape, const ElementBytes& e)
      : plan_(plan), ctx_(ctx), shape_(shape), e_(e), chunks_(chunks_of(plan)) {
    const size_t layers = static_cast<size_t>(plan.model->layers);
    t_ = {std::vector<int64_t>(layers),
          std::vector<int64_t>(layers),
          std::vector<int64_t>(layers),
          std::vector<int64_t>(layers),
          0,
          0};
    scratch_ = t_;
    for (const ModelParam& p : plan.params) pg_.uses.push_back(p.uses);
    pg_.has.assign(plan.params.size(), false);
    unsharded_.assign(plan.stages.size(), {});
    reduced_.assign(plan.stages.size(), 0);
    if (shape.fsdp) fsdp_units();
  }

  // Op by op, in pipeline order. One process without buffers replays two micro-batches: the first
  // (its gradients become .grad) and one later one (added into them); the others repeat it.
  void replay(int micro, StepMemory& m) {
    int backwards = 0;
    for (const PipelineStep& p : pipeline_order(shape_.stages, shape_.stage, shape_.chunks, micro)) {
      MemoryTrace& tr = p.micro == 0 ? t_ : scratch_;
      if (p.forward) {
        forward(chunks_[p.chunk], tr);
        continue;
      }
      const Grads mode = shape_.bucketed() ? Grads::Handed : backwards == 0 ? Grads::First : Grads::Later;
      pg_.has.assign(plan_.params.size(), false);  // (a rank holds both users of a tied parameter in one chunk)
      backward(chunks_[p.chunk], mode, tr);
      ++backwards;
    }
    m.peak = top_;
    m.peak_at = describe(sim_.peak_at());
  }

  // The optimizer step, at the end of a replayed step (the gradients alive): foreach Adam's
  // temporaries (StepShape::foreach_adam), one per parameter of this rank's share.
  void optimizer_step(StepMemory& m) {
    if (!shape_.foreach_adam) return;
    sim_.at(kOptimizerStep, nullptr, -1);
    sim_.restart_peak();
    std::vector<int64_t> temps;
    for (const ModelParam& p : plan_.params) temps.push_back(owned(p, shape_.fsdp || shape_.zero >= 1) * e_.state / 2);
    for (int64_t t : temps) sim_.alloc(t);
    for (int64_t t : temps) sim_.free(t);
    sim_.at("", nullptr, -1);  // (what comes next is the next step's)
    top_ = std::max(top_, sim_.peak());
    if (sim_.peak() >= m.peak) {
      m.peak = sim_.peak();
      m.peak_at = kOptimizerStep;
    }
  }

  // StepShape::cuda: the caching allocator sees every block: the persistent tensors, then two steps
  // op by op with the optimizer's state made at the first optimizer step (what the first step's
  // activations freed may hold it).
  void replay_on_cuda(StepMemory& m) {
    detail::CachingAllocatorModel cuda(shape_.expandable_segments);
    Sim persistent(&cuda);
    sim_ = Sim(&cuda);
    for (int64_t b : shape_.fixed_blocks) persistent.alloc(b);
    if (shape_.fsdp)  // each parameter's shard (fp32: the master copy)
      for (const ModelParam& p : plan_.params) persistent.alloc(owned(p, true) * e_.sharded_weight());
    else if (shape_.zero >= 3)
      persistent.alloc(m.params);  // this rank's shard, one flat tensor
    else
      for (const ModelParam& p : plan_.params) persistent.alloc(p.spec->numel() * e_.weight);
    if (shape_.bucketed() && !shape_.fsdp) persistent.alloc(m.grads);
    persistent.alloc(m.data);
    const int micro = periodic_micro(shape_.stages, shape_.stage, shape_.chunks, shape_.micro, shape_.fsdp ? 2 : 1);
    replay(micro, m);
    // The optimizer's state, per parameter's share: (an fp32 master copy,) m and v.
    for (const ModelParam& p : plan_.params) {
      const int64_t n = owned(p, shape_.fsdp || shape_.zero >= 1);
      if (e_.master > 0 && !shape_.fsdp) persistent.alloc(n * e_.master);
      for (int k = 0; k < 2; ++k) persistent.alloc(n * e_.state / 2);
    }
    optimizer_step(m);
    for (int64_t g : sharded_grads_) sim_.free(g, kReduceScatter);  // zero_grad before the next step
    sharded_grads_.clear();
    std::fill(reduced_.begin(), reduced_.end(), 0);
    replay(micro, m);
    optimizer_step(m);
    m.allocated_peak = cuda.peak_allocated();
    m.reserved_peak = cuda.peak_reserved();
    sim_ = Sim();  // (it pointed at `cuda`)
  }

  // With buffers every micro-batch is alike: a chunk's forward (or backward) changes the level by
  // the same amount and rises the same height above where it starts, whatever else is alive (the
  // fold only adds and subtracts). Replay each pass once, then fold the pipeline order over them.
  void fold(StepMemory& m) {
    struct Pass {
      int64_t delta = 0, height = 0;
      Where at;
    };
    std::vector<Pass> fwd(chunks_.size()), bwd(chunks_.size());
    for (size_t c = 0; c < chunks_.size(); ++c) {
      sim_ = Sim();
      forward(chunks_[c], t_);
      fwd[c] = {sim_.live(), sim_.top(), sim_.peak_at()};
      sim_ = Sim();
      pg_.has.assign(plan_.params.size(), false);
      backward(chunks_[c], Grads::Handed, t_);
      bwd[c] = {sim_.live(), sim_.top(), sim_.peak_at()};
    }
    int64_t level = 0, highest = 0;
    Where at;
    const int micro = periodic_micro(shape_.stages, shape_.stage, shape_.chunks, shape_.micro, shape_.fsdp ? 2 : 1);
    for (const PipelineStep& p : pipeline_order(shape_.stages, shape_.stage, shape_.chunks, micro)) {
      const Pass& pass = p.forward ? fwd[p.chunk] : bwd[p.chunk];
      if (level + pass.height > highest) highest = level + pass.height, at = pass.at;
      level += pass.delta;
    }
    m.peak = highest;
    m.peak_at = describe(at);
    sim_ = Sim();  // the step's end: every gradient in its buffer
  }

  // What one micro-batch's forward leaves (replayed alone, after whatever ran before).
  int64_t saved() {
    sim_ = Sim();
    for (const Chunk& c : chunks_) forward(c, scratch_);
    return sim_.live();
  }

  // Each layer's levels in the first micro-batch.
  MemoryTrace& trace() { return t_; }

 private:
  enum Stream { kCompute = 0, kAllGather = 1, kReduceScatter = 2 };  // FSDP2's streams

  // A stage's pass, its start and peak recorded in `tr`; under ZeRO-3 the stage's whole weights
  // are gathered for it.
  template <typename Body>
  void phase(const CompiledStage& st, bool backward, MemoryTrace& tr, Body body) {
    int64_t* peak = nullptr;
    if (st.role == CompiledStage::Role::Block) {
      (backward ? tr.bwd_start : tr.fwd_start)[st.layer] = sim_.live();
      peak = &(backward ? tr.bwd_peak : tr.fwd_peak)[st.layer];
    } else {
      peak = st.role == CompiledStage::Role::Head ? &tr.head_peak : &tr.stem_peak;
    }
    sim_.restart_peak();
    int64_t gathered = 0;
    if (shape_.zero >= 3)
      for (size_t k = 0; k < st.params.size(); ++k) gathered += st.spec->param_bytes(static_cast<int>(k));
    sim_.alloc(gathered);
    body();
    sim_.free(gathered);
    *peak = std::max(*peak, sim_.peak());
    top_ = std::max(top_, sim_.peak());
  }

  // A parameter's elements on this rank: when sharded (FSDP2, ZeRO), 1 / world of it, or of a routed
  // expert's 1 / expert_world (the ranks that hold that expert, as persistent_memory shards them);
  // else all.
  int64_t owned(const ModelParam& p, bool sharded) const {
    const int world = shape_.world_of(p.spec->expert);
    return sharded ? std::max<int64_t>(1, p.spec->numel() / world) : p.spec->numel();
  }

  // FSDP2, in the order its hooks run; NOTE [FSDP2]. Its units: each block, and the root (the
  // model's own fully_shard: every stage of the chunk that is not a block), named by its first
  // stage; fsdp_units() finds them and their half-precision weights once.
  bool in_root(size_t i) const { return plan_.stages[i].role != CompiledStage::Role::Block; }
  size_t unit(size_t i) const { return unit_[i]; }
  int64_t stage_weights(size_t i) const { return stage_weights_[i]; }
  int64_t weights(size_t u) const { return unit_weights_[u]; }
  void fsdp_units() {
    const size_t n = plan_.stages.size();
    unit_.resize(n);
    stage_weights_.assign(n, 0);
    unit_weights_.assign(n, 0);
    unit_params_.assign(n, {});
    std::vector<std::set<int>> seen(n);  // a parameter tied across a unit's stages counts once
    for (size_t i = 0; i < n; ++i) {
      const CompiledStage& st = plan_.stages[i];
      unit_[i] = i;
      for (size_t j = 0; j < i && in_root(i); ++j)
        if (in_root(j) && plan_.stages[j].chunk == st.chunk) {
          unit_[i] = j;
          break;
        }
      for (size_t k = 0; k < st.params.size(); ++k) {
        const int64_t b = st.spec->param_bytes(static_cast<int>(k));
        stage_weights_[i] += b;
        if (!seen[unit_[i]].insert(st.params[k]).second) continue;
        unit_weights_[unit_[i]] += b;
        unit_params_[unit_[i]].push_back(b);
      }
    }
  }
  // The root's last stage in backward order: its post-backward, where its gradients are reduced.
  bool root_ends_backward(size_t i) const { return in_root(i) && unit(i) == i; }
  // A unit's unshard (unshard_requests): each parameter's unsharded tensor a block of its own. The
  // flat all-gather buffer, across ranks, is kept in the forward until the next copy-out (to
  // overlap it with the next all-gather) or the root's post-forward, and freed at once in the
  // backward.
  void gather(size_t u, bool keep_flat) {
    if (weights(u) == 0 || !unsharded_[u].empty()) return;
    const bool casts = e_.sharded_weight() != e_.weight;
    const std::vector<detail::UnshardRequest> requests =
        detail::unshard_requests(unit_params_[u], shape_.world, casts, kAllGather);
    std::vector<Block> made(requests.size());
    for (size_t k = 0; k < requests.size(); ++k) {
      const detail::UnshardRequest& r = requests[k];
      if (r.frees >= 0) {
        sim_.give(made[r.frees].bytes, made[r.frees].id);
        made[r.frees] = {};
      } else {
        made[k] = {r.bytes, sim_.take(r.bytes, r.stream)};
      }
    }
    const Block flat = shape_.world > 1 ? made[0] : Block{};
    for (size_t k = shape_.world > 1 ? 1 : 0; k < made.size(); ++k)
      if (made[k].bytes > 0) unsharded_[u].push_back(made[k]);
    drop_flat();  // the last gather's buffer, its copy-out done
    if (keep_flat)
      flat_ = flat;
    else
      sim_.give(flat.bytes, flat.id);
  }
  void drop_flat() {
    sim_.give(flat_.bytes, flat_.id);
    flat_ = {};
  }
  void reshard(size_t u) {
    for (const Block& b : unsharded_[u]) sim_.give(b.bytes, b.id);
    unsharded_[u].clear();
  }
  void fsdp_after_forward(size_t i) {
    if (!shape_.fsdp || in_root(i) || !shape_.fsdp_reshard) return;
    if (shape_.fsdp_keep_last && plan_.stages[i].layer == plan_.model->layers - 1) return;
    reshard(i);
  }
  // The root's post-forward, as the model's forward returns (before the loss, which frameworks
  // compute outside the model): the kept all-gather buffer goes, and the root's weights with it
  // when they are resharded. Once per chunk's forward.
  void fsdp_end_forward(const Chunk& c) {
    if (!shape_.fsdp || ended_) return;
    ended_ = true;
    drop_flat();
    if (shape_.fsdp_reshard && shape_.fsdp_root_reshard)
      for (size_t i = c.first; i <= c.last; ++i)
        if (root_ends_backward(i)) reshard(i);
  }
  void fsdp_backward(const Chunk& c, size_t i) {
    if (!shape_.fsdp) return;
    gather(unit(i), false);
    for (size_t j = i; j-- > c.first;)  // the next unit the backward reaches with weights: gathered ahead
      if (unit(j) != unit(i) && weights(unit(j)) > 0) {
        gather(unit(j), false);
        break;
      }
  }
  // A unit's post-backward: resharded first, then its gradients copied (up-cast) into the
  // reduce-scatter input and freed; the root's wait, unsharded, until its last stage's backward.
  void fsdp_reduce(size_t i) {
    if (!shape_.fsdp || stage_weights(i) == 0 || (in_root(i) && !root_ends_backward(i))) return;
    reshard(unit(i));
    sim_.alloc(weights(unit(i)) / e_.weight * e_.reduce);
  }
  void fsdp_after_backward(size_t i) {
    if (!shape_.fsdp || stage_weights(i) == 0) return;
    if (in_root(i) && !root_ends_backward(i)) {
      // Autograd's gradients, held for the post-backward, one per parameter; a parameter tied to
      // the root's last stage (GPT-2's head) gets its gradient summed into that stage's, counted there.
      const std::vector<int>& last = plan_.stages[unit(i)].params;
      const CompiledStage& st = plan_.stages[i];
      for (size_t k = 0; k < st.params.size(); ++k) {
        if (std::find(last.begin(), last.end(), st.params[k]) != last.end()) continue;
        held_.push_back(st.spec->param_bytes(static_cast<int>(k)));
        sim_.alloc(held_.back());
      }
      return;
    }
    const size_t u = unit(i);
    for (int64_t g : held_) sim_.free(g);
    held_.clear();
    if (!reduced_[u]) {  // the sharded gradient, accumulated into by later micro-batches
      const int64_t g = std::max<int64_t>(1, weights(u) / e_.weight / shape_.world) * e_.sharded_weight();
      sim_.alloc(g, kReduceScatter);
      sharded_grads_.push_back(g);
      reduced_[u] = 1;
    }
    sim_.free(rs_input_);  // the previous unit's input, its reduce-scatter done
    rs_input_ = weights(u) / e_.weight * e_.reduce;
  }

  // One chunk's forward of one micro-batch. Its input comes from the data or the previous pipeline
  // stage (received: counted here, freed by the first block's backward); its output goes to the
  // next stage (sent, then freed) or is the loss.
  void forward(const Chunk& c, MemoryTrace& tr) {
    const CompiledStage& first = plan_.stages[c.first];
    if (!c.begins) sim_.alloc(first.spec->tensors[first.spec->inputs[0]].bytes());
    ended_ = false;
    for (size_t i = c.first; i <= c.last; ++i) {
      if (shape_.fsdp) gather(unit(i), /*keep_flat=*/true);
      if (plan_.stages[i].segment >= 0)
        phase(plan_.stages[i], false, tr, [&] { first_forward(c, i); });
      else
        phase(plan_.stages[i], false, tr,
              [&] { forward_stage(sim_, plan_.stages[i], ctx_, nullptr, "forward", [&] { fsdp_end_forward(c); }); });
      fsdp_after_forward(i);
    }
    fsdp_end_forward(c);
    const CompiledStage& last = plan_.stages[c.last];
    if (!c.ends) sim_.free(last.spec->tensors[last.spec->output].bytes());
  }

  // Its backward: the root gradient first (rule 1), or the gradient received for its output; each
  // stage's dy is the gradient the stage after it returned (rule 2); the last one is sent.
  void backward(const Chunk& c, Grads mode, MemoryTrace& tr) {
    const CompiledStage& last = plan_.stages[c.last];
    const int64_t root = last.spec->tensors[last.spec->output].bytes();
    int64_t dy = c.ends ? (shape_.scaled_loss ? root : 0) : root;  // rule 5: the gradient through the division
    if (!c.ends) sim_.alloc(dy);
    for (size_t i = c.last + 1; i-- > c.first;) {
      const CompiledStage& st = plan_.stages[i];
      if (st.segment >= 0) {
        i = segment_backward(c, i, dy, mode, tr);
        dy = plan_.stages[i].spec->tensors[plan_.stages[i].spec->inputs[0]].bytes();
        continue;
      }
      // A unit's pre-backward hook fires when the gradient reaches its output: for the head, after
      // the loss's backward (the loss is computed outside the model), before its first weights.
      const bool head = st.role == CompiledStage::Role::Head;
      if (!head) fsdp_backward(c, i);
      phase(st, true, tr, [&] {
        if (head) {
          sim_.alloc(root);
          sim_.alloc(dy);
          bool gathered = false;
          backward_stage(sim_, st, pg_, ctx_, shape_.fused_wgrad, [&] {
            fsdp_backward(c, i);
            gathered = true;
          });
          if (!gathered) fsdp_backward(c, i);  // (a head without weights)
        } else {
          backward_stage(sim_, st, pg_, ctx_, shape_.fused_wgrad);
        }
        const bool keeps_dy =
            !st.schedule->input_grad_is_dy.empty() && st.schedule->input_grad_is_dy[0] && !st.external[0];
        if (!keeps_dy) sim_.free(dy);
        sim_.at("summing a tied parameter's gradients", &st, -1);
        fsdp_reduce(i);
        settle(sim_, pg_, mode);
        fsdp_after_backward(i);
      });
      dy = st.spec->tensors[st.spec->inputs[0]].bytes();
    }
    sim_.free(rs_input_);
    rs_input_ = 0;
    drop_flat();                   // (a forward's last all-gather, when no copy-out came after it)
    if (!c.begins) sim_.free(dy);  // the input's gradient, sent back
    if (c.ends) {
      sim_.free(root);
      sim_.free(root);  // the caller lets go of the loss
    }
  }

  // NOTE [Segments]. The first stage of stage i's uniform:N segment (within chunk c).
  size_t segment_first(const Chunk& c, size_t i) const {
    while (i > c.first && plan_.stages[i - 1].segment == plan_.stages[i].segment) --i;
    return i;
  }

  // A segment's first forward of stage i: the schedule that keeps nothing; what it kept goes as it
  // returns, and so does its input, unless it is the segment's (autograd keeps that one).
  void first_forward(const Chunk& c, size_t i) {
    const CompiledStage& st = plan_.stages[i];
    const BlockSpec& b = *st.spec;
    forward_stage(sim_, st, ctx_, st.first_pass.get());
    const EagerBlocks eager = eager_blocks(b);
    for (size_t t = 0; t < b.tensors.size(); ++t)
      if (st.first_pass->saved[t] && !b.is_input(static_cast<int>(t)) && static_cast<int>(t) != b.output)
        free_live(sim_, b, eager, static_cast<int>(t));
    if (segment_first(c, i) != i) sim_.free(b.tensors[b.inputs[0]].bytes());
  }

  // The segment that ends at stage `last`, its output's gradient (dy bytes) held by the caller: the
  // rerun of its stages' forwards, then their backwards from the last. The node holds its incoming
  // gradient, its input and (autograd's) parameter gradients until it returns. Returns its first stage.
  size_t segment_backward(const Chunk& c, size_t last, int64_t dy, Grads mode, MemoryTrace& tr) {
    const size_t first = segment_first(c, last);
    for (size_t j = first; j <= last; ++j)
      phase(plan_.stages[j], true, tr, [&] { forward_stage(sim_, plan_.stages[j], ctx_, nullptr, "rerun"); });
    const BlockSpec& out = *plan_.stages[last].spec;
    if (!plan_.stages[last].schedule->saved[out.output]) sim_.free(out.tensors[out.output].bytes());
    const int64_t incoming = dy;
    bool chained = true;  // dy is still the incoming gradient's buffer
    for (size_t j = last + 1; j-- > first;) {
      const CompiledStage& st = plan_.stages[j];
      phase(st, true, tr, [&] {
        StageBackward(sim_, st, pg_, ctx_, shape_.fused_wgrad, /*input_kept=*/j == first).run();
        const bool keeps_dy =
            !st.schedule->input_grad_is_dy.empty() && st.schedule->input_grad_is_dy[0] && !st.external[0];
        if (!keeps_dy) {
          if (!chained) sim_.free(dy);
          chained = false;
        }
        sim_.at("the segment's gradients", &st, -1);
        if (mode == Grads::Handed) settle(sim_, pg_, mode);  // into their buckets as they come
      });
      dy = st.spec->tensors[st.spec->inputs[0]].bytes();
    }
    if (!chained) sim_.free(incoming);
    const CompiledStage& in = plan_.stages[first];
    if (!in.external[0]) sim_.free(in.spec->tensors[in.spec->inputs[0]].bytes());
    if (mode != Grads::Handed) settle(sim_, pg_, mode);
    return first;
  }

  const CompiledStep& plan_;
  const ThreadConfig& ctx_;
  const StepShape& shape_;
  const ElementBytes e_;
  const std::vector<Chunk> chunks_;
  MemoryTrace t_, scratch_;  // the first micro-batch's levels; the others'
  Sim sim_;
  int64_t top_ = 0;
  ParamGrads pg_;
  struct Block {
    int64_t bytes = 0;
    int id = -1;  // Sim::take's
  };
  std::vector<std::vector<Block>> unsharded_;          // FSDP2: by unit, its parameters' unsharded blocks
  std::vector<char> reduced_;                          // FSDP2: by stage
  Block flat_;                                         // FSDP2: the kept all-gather buffer
  int64_t rs_input_ = 0;                               // FSDP2: the reduce-scatter input
  std::vector<int64_t> held_;                          // FSDP2: the root's unsharded gradients, until its post-backward
  std::vector<size_t> unit_;                           // FSDP2: by stage, its unit (fsdp_units)
  std::vector<int64_t> stage_weights_, unit_weights_;  // FSDP2: by stage, and by unit
  std::vector<std::vector<int64_t>> unit_params_;      // FSDP2: by unit, its parameters' bytes in the compute dtype
  bool ended_ = false;                                 // FSDP2: the root's post-forward ran in this chunk's forward
  std::vector<int64_t> sharded_grads_;  // FSDP2: this step's reduce-scatter outputs, the stages' gradients
};

void check_step_shape(const CompiledStep& plan, const StepShape& shape) {
  if (plan.segment > 0 && (shape.fsdp || shape.zero >= 3 || shape.stages > 1))
    fail(
        "uniform:{} segments are replayed for one process and data parallelism without sharded weights; "
        "give another policy with FSDP, ZeRO-3 or pipeline stages",
        plan.segment);
  if (shape.micro < 1 || shape.world < 1 || shape.rank < 0 || shape.rank >= shape.world || shape.stages < 1 ||
      shape.stage < 0 || shape.stage >= shape.stages || shape.chunks < 1 ||
      static_cast<int>(plan.chunks.size()) != shape.chunks || shape.zero < 0 || shape.zero > 3 ||
      (shape.chunks > 1 && shape.micro % shape.stages != 0))
    REMAT_INTERNAL("step shape micro {} world {} rank {} stage {}/{} chunks {} (plan {}) zero {}", shape.micro,
                   shape.world, shape.rank, shape.stage, shape.stages, shape.chunks, plan.chunks.size(), shape.zero);
}

}  // namespace

StepMemory simulate_memory(const CompiledStep& plan, const ThreadConfig& ctx, MemoryTrace* out,
                           const StepShape& shape) {
  check_step_shape(plan, shape);
  const ElementBytes e = element_bytes(plan.model->block.dtype, shape);
  StepMemory m = persistent_memory(plan, shape, e);
  StepReplay step(plan, ctx, shape, e);
  if (shape.cuda)
    step.replay_on_cuda(m);  // (its two optimizer steps included)
  else if (!shape.bucketed())
    step.replay(std::min(shape.micro, 2), m);
  else if (shape.op_by_op)
    step.replay(shape.micro, m);
  else if (shape.fsdp)  // FSDP2's gradients appear in the first backward only: no fold
    step.replay(periodic_micro(shape.stages, shape.stage, shape.chunks, shape.micro, 2), m);
  else
    step.fold(m);  // (the gradients in their buffers, part of base(): the optimizer step starts from 0)
  if (!shape.cuda) step.optimizer_step(m);
  m.saved = step.saved();
  if (out) *out = std::move(step.trace());
  return m;
}

StepMemory simulate_memory(const ModelConfig& cfg, const ResolvedPolicy& policy, const ThreadConfig& ctx) {
  auto spec = std::make_shared<const ModelSpec>(make_model(cfg));
  return simulate_memory(compile_step(spec, policy), ctx);
}

BlockMemory simulate_block(const BlockSpec& spec, const Schedule& schedule, const ThreadConfig& ctx) {
  CompiledStage st;
  st.spec = &spec;
  st.schedule = std::shared_ptr<const Schedule>(&schedule, [](const Schedule*) {});
  st.params.resize(spec.params.size());
  for (size_t i = 0; i < st.params.size(); ++i) st.params[i] = static_cast<int>(i);
  st.external.assign(spec.inputs.size(), false);
  BlockMemory o;
  o.saved = schedule.saved_bytes(spec);
  const EagerBlocks eager = eager_blocks(spec);
  for (size_t t = 0; t < eager.size(); ++t)
    if (schedule.saved[t]) o.saved += eager_bytes(eager, static_cast<int>(t));
  Sim sim;
  forward_stage(sim, st, ctx);
  o.forward_extra = sim.peak();
  sim.restart_peak();
  const int64_t start = sim.live();
  ParamGrads pg;
  pg.has.assign(spec.params.size(), false);
  pg.uses.assign(spec.params.size(), 1);
  backward_stage(sim, st, pg, ctx);
  settle(sim, pg, Grads::First);
  o.backward_extra = sim.peak() - start;
  return o;
}

}  // namespace remat
