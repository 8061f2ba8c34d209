// The memory model: a fold over a StepPlan's schedules on byte sizes (NOTE [One plan]).
//
// Every decision (what is saved, what is recomputed, how each gradient buffer is made and merged)
// is read from the schedule. What is written here is what memory does as a consequence: an
// allocation counts its bytes, a buffer shared by several gradient slots is released with its last
// reference, and three rules of LibTorch's autograd that no schedule can say:
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
#include <map>

#include <fmt/format.h>

#include "plan/caching_allocator.h"
#include "remat/error.h"

namespace remat {

namespace {

struct Where {
  const char* pass = "";  // "forward", "backward", "recompute"
  const StagePlan* stage = nullptr;
  int op = -1;
};

class Sim {
 public:
  // With `cuda`, every allocation and free also goes to the caching allocator's model; a free of n
  // bytes releases the latest live block of n bytes on that stream (tensors of one size are alike
  // to it).
  explicit Sim(detail::CachingAllocatorModel* cuda = nullptr) : cuda_(cuda) {}
  // `stream`: the CUDA stream that allocates it (FSDP2's all-gather and reduce-scatter have their own).
  void alloc(int64_t n, int stream = 0) {
    live_ += n;
    peak_ = std::max(peak_, live_);
    if (live_ > top_) {
      top_ = live_;
      peak_at_ = where_;
    }
    if (cuda_ && n > 0) by_size_[{n, stream}].push_back(cuda_->alloc(n, stream));
  }
  void free(int64_t n, int stream = 0) {
    live_ -= n;
    if (cuda_ && n > 0) {
      std::vector<int>& live = by_size_[{n, stream}];
      if (live.empty()) REMAT_INTERNAL("the memory model frees {} bytes it never allocated", n);
      cuda_->free(live.back());
      live.pop_back();
    }
  }
  void at(const char* pass, const StagePlan* stage, int op) { where_ = {pass, stage, op}; }
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

std::string describe(const Where& w) {
  if (w.stage == nullptr) return "start of the step";
  const std::string stage = w.stage->role == StagePlan::Role::Stem   ? "the embedding"
                            : w.stage->role == StagePlan::Role::Head ? "the head"
                                                                     : fmt::format("layer {}", w.stage->layer);
  if (w.op < 0) return fmt::format("{} after the backward of {}", w.pass, stage);
  return fmt::format("{} of {}, op '{}'", w.pass, stage, w.stage->spec->ops[w.op].name);
}

void forward_stage(Sim& sim, const StagePlan& st, const ThreadConfig& ctx) {
  const BlockSpec& b = *st.spec;
  for (const Step& step : st.schedule->forward) {
    if (step.kind == Step::Kind::Free) {
      sim.free(b.tensors[step.index].bytes());
      continue;
    }
    sim.at("forward", &st, step.index);
    for (int t : b.ops[step.index].out) sim.alloc(b.tensors[t].bytes());
    const int64_t scratch = b.forward_scratch(step.index, ctx);
    sim.alloc(scratch);
    sim.free(scratch);
  }
}

// Gradient memory: buffers that several slots may share, released with their last reference.
class Buffers {
 public:
  static constexpr int kNone = -1;
  explicit Buffers(Sim& sim) : sim_(sim) {}
  int external() { return add(0, false); }  // a tensor someone else owns (autograd's dy)
  int fresh(int64_t bytes) {
    sim_.alloc(bytes);
    return add(bytes, true);
  }
  int adopt(int64_t bytes) { return add(bytes, true); }  // memory already counted, owned from now on
  int share(int buf) {
    ++refs_[buf];
    return buf;
  }
  void drop(int buf) {
    if (buf != kNone && --refs_[buf] == 0 && counted_[buf]) sim_.free(bytes_[buf]);
  }

 private:
  int add(int64_t bytes, bool counted) {
    bytes_.push_back(bytes);
    refs_.push_back(1);
    counted_.push_back(counted);
    return static_cast<int>(bytes_.size()) - 1;
  }
  Sim& sim_;
  std::vector<int64_t> bytes_;
  std::vector<int> refs_;
  std::vector<bool> counted_;
};

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

// One stage's backward, with its incoming gradient owned by the caller.
void backward_stage(Sim& sim, const StagePlan& st, ParamGrads& pg, const ThreadConfig& ctx, bool fused_wgrad = false) {
  const BlockSpec& b = *st.spec;
  const Schedule& s = *st.schedule;
  Buffers bufs(sim);
  std::vector<int> slot(b.tensors.size(), Buffers::kNone);
  slot[b.output] = bufs.external();
  std::vector<bool> held = s.saved;
  auto bytes = [&](int t) { return b.tensors[t].bytes(); };
  for (const Step& step : s.backward) {
    switch (step.kind) {
      case Step::Kind::Free: {
        const int k = b.input_index(step.index);
        if (held[step.index] && !(k >= 0 && st.external[k])) sim.free(bytes(step.index));
        held[step.index] = false;
        break;
      }
      case Step::Kind::FreeGrad:
        bufs.drop(slot[step.index]);
        slot[step.index] = Buffers::kNone;
        break;
      case Step::Kind::Recompute: {
        const OpNode& op = b.ops[step.index];
        sim.at("recompute", &st, step.index);
        for (int t : op.out) sim.alloc(bytes(t));
        const int64_t scratch = b.forward_scratch(step.index, ctx);
        sim.alloc(scratch);
        sim.free(scratch);
        for (size_t i = 0; i < op.out.size(); ++i) {
          if (step.discard & (1u << i)) sim.free(bytes(op.out[i]));  // the forward's value is kept
          held[op.out[i]] = true;
        }
        break;
      }
      case Step::Kind::Backward: {
        const OpNode& op = b.ops[step.index];
        sim.at("backward", &st, step.index);
        // The op makes its gradients...
        std::vector<int> incoming(op.in.size(), Buffers::kNone);
        for (size_t i = 0; i < op.in.size(); ++i) {
          const int t = op.in[i];
          const GradStep& g = step.grads[i];
          switch (g.source) {
            case GradSource::None:
              break;
            case GradSource::Fresh:
              incoming[i] = bufs.fresh(bytes(t));
              break;
            case GradSource::OverDy:
              incoming[i] = slot[op.out[0]];
              slot[op.out[0]] = Buffers::kNone;
              break;
            case GradSource::OverInput:
              incoming[i] = bufs.adopt(bytes(t));
              held[t] = false;
              break;
            case GradSource::Alias:
              incoming[i] = bufs.share(slot[op.out[0]]);
              break;
            case GradSource::Slot:
              if (g.prep == SlotPrep::Zeros) {
                slot[t] = bufs.fresh(bytes(t));
              } else if (g.prep == SlotPrep::Copy) {
                const int mine = bufs.fresh(bytes(t));
                bufs.drop(slot[t]);
                slot[t] = mine;
              }
              break;
          }
        }
        for (size_t p = 0; p < op.params.size(); ++p) {
          if (fused_wgrad && op.kind == OpKind::Linear && p == 0) continue;  // into the buffer by its GEMM
          const int64_t n = b.param_bytes(op.params[p]);
          sim.alloc(n);
          const int id = st.params[op.params[p]];
          (pg.uses[id] == 1 ? pg.single : pg.has[id] ? pg.second : pg.held).push_back(n);
          pg.has[id] = true;
        }
        const int64_t scratch = b.backward_scratch(step.index, ctx);
        sim.alloc(scratch);
        sim.free(scratch);
        // ...then each joins its input's slot.
        for (size_t i = 0; i < op.in.size(); ++i) {
          const GradStep& g = step.grads[i];
          if (g.source == GradSource::None || g.source == GradSource::Slot) continue;
          int& dst = slot[op.in[i]];
          switch (g.merge) {
            case GradMerge::Set:
              dst = incoming[i];
              break;
            case GradMerge::AddIntoSlot:
              bufs.drop(incoming[i]);
              break;
            case GradMerge::AddSlotIntoIt:
              bufs.drop(dst);
              dst = incoming[i];
              break;
            case GradMerge::Sum: {
              const int sum = bufs.fresh(bytes(op.in[i]));
              bufs.drop(dst);
              bufs.drop(incoming[i]);
              dst = sum;
              break;
            }
          }
        }
        break;
      }
      case Step::Kind::Forward:
        break;
    }
  }
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

int64_t shard_first(int64_t total, int rank, int world) { return total * rank / world; }

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
// at. Whole periods past the second are left out (keeping the count modulo the period, so the
// cool-down runs the same chunks): a step of a million micro-batches folds in a few hundred.
int periodic_micro(int stages, int stage, int chunks, int micro) {
  const int64_t total = int64_t{micro} * chunks;
  const int64_t warmup =
      std::min<int64_t>(total, chunks == 1 ? stages - stage - 1 : (stages - stage - 1) * 2 + (chunks - 1) * stages);
  const int64_t period = int64_t{stages} * chunks, steady = total - warmup;
  if (steady < 2 * period) return micro;
  return micro - static_cast<int>((steady / period - 1) * stages);
}

}  // namespace

StepMemory simulate_memory(const StepPlan& plan, const ThreadConfig& ctx, MemoryTrace* out, const StepShape& shape) {
  if (plan.chunk > 0)
    fail("the memory model does not cover uniform:{} chunks yet (they run under remat::checkpoint)", plan.chunk);
  if (shape.micro < 1 || shape.world < 1 || shape.rank < 0 || shape.rank >= shape.world || shape.stages < 1 ||
      shape.stage < 0 || shape.stage >= shape.stages || shape.chunks < 1 ||
      static_cast<int>(plan.chunks.size()) != shape.chunks || shape.zero < 0 || shape.zero > 3 ||
      (shape.chunks > 1 && shape.micro % shape.stages != 0))
    REMAT_INTERNAL("step shape micro {} world {} rank {} stage {}/{} chunks {} (plan {}) zero {}", shape.micro,
                   shape.world, shape.rank, shape.stage, shape.stages, shape.chunks, plan.chunks.size(), shape.zero);
  const ModelSpec& spec = *plan.model;
  const bool bucketed = shape.bucketed();
  StepMemory m;
  int64_t numel = 0, expert_numel = 0;
  for (const ModelParam& p : plan.params) (p.spec->expert ? expert_numel : numel) += p.spec->numel();
  const DType dtype = spec.block.dtype;
  const int64_t wbytes = dtype_size(dtype), gbytes = shape.grad_bytes > 0 ? shape.grad_bytes : wbytes;
  const bool mixed = dtype != DType::F32;
  // ZeRO: this rank's share of the parameters, laid end to end.
  // The routed experts' parameters are shared by fewer ranks (StepShape::expert_world).
  auto share = [](int64_t n, int rank, int world) {
    return shard_first(n, rank + 1, world) - shard_first(n, rank, world);
  };
  const int expert_world = shape.expert_world > 0 ? shape.expert_world : shape.world;
  const int64_t owned =
      share(numel, shape.rank, shape.world) + share(expert_numel, shape.rank % expert_world, expert_world);
  numel += expert_numel;
  // Bytes per element of the master weights and the Adam state (m and v): fp32, or the model's
  // dtype when nothing is kept in fp32.
  const int64_t master = mixed && !shape.pure_dtype ? 4 : 0, state = shape.pure_dtype ? 2 * wbytes : 8;
  if (shape.fsdp) {  // the sharded weights are the master copy; gradients are made in the backward
    m.params = owned * (master > 0 ? master : wbytes);
    m.grads = owned * (master > 0 ? master : wbytes);
    m.optimizer = owned * state;
    m.buffers = shape.extra_buffers;
  } else {
    m.params = (shape.zero >= 3 ? owned : numel) * wbytes;
    m.grads = (bucketed ? (shape.zero >= 2 ? owned : numel) * gbytes : numel * wbytes);
    m.optimizer = (shape.zero >= 1 ? owned : numel) * (master + state);
    if (bucketed) m.buffers = m.grads + shape.extra_buffers;
  }
  for (const StagePlan& st : plan.stages) {
    if (st.role == StagePlan::Role::Stem || (st.external.size() > 0 && st.external[0]))
      m.data += st.spec->tensors[st.spec->inputs[0]].bytes();
    if (st.role == StagePlan::Role::Head) m.data += st.spec->tensors[st.spec->inputs[1]].bytes();
  }

  // The stages of each chunk, and whether it begins or ends the model.
  struct Chunk {
    size_t first = 0, last = 0;  // stage indices, inclusive
    bool begins = false, ends = false;
  };
  std::vector<Chunk> chunks(plan.chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    bool any = false;
    for (size_t i = 0; i < plan.stages.size(); ++i) {
      if (plan.stages[i].chunk != static_cast<int>(c)) continue;
      if (!any) chunks[c].first = i;
      chunks[c].last = i;
      any = true;
    }
    const StagePlan& f = plan.stages[chunks[c].first];
    chunks[c].begins = !f.external.empty() && f.external[0];
    chunks[c].ends = plan.stages[chunks[c].last].role == StagePlan::Role::Head;
  }

  const int64_t L = spec.layers;
  MemoryTrace t{
      std::vector<int64_t>(L), std::vector<int64_t>(L), std::vector<int64_t>(L), std::vector<int64_t>(L), 0, 0};
  MemoryTrace scratch = t;
  Sim sim;
  int64_t top = 0;
  ParamGrads pg;
  for (const ModelParam& p : plan.params) pg.uses.push_back(p.uses);
  pg.has.assign(plan.params.size(), false);
  auto phase = [&](const StagePlan& st, bool backward, MemoryTrace& tr, auto body) {
    int64_t* peak = nullptr;
    if (st.role == StagePlan::Role::Block) {
      (backward ? tr.bwd_start : tr.fwd_start)[st.layer] = sim.live();
      peak = &(backward ? tr.bwd_peak : tr.fwd_peak)[st.layer];
    } else {
      peak = st.role == StagePlan::Role::Head ? &tr.head_peak : &tr.stem_peak;
    }
    sim.restart_peak();
    // ZeRO-3: the stage's whole weights, gathered for the pass.
    int64_t gathered = 0;
    if (shape.zero >= 3)
      for (size_t k = 0; k < st.params.size(); ++k) gathered += st.spec->param_bytes(static_cast<int>(k));
    sim.alloc(gathered);
    body();
    sim.free(gathered);
    *peak = std::max(*peak, sim.peak());
    top = std::max(top, sim.peak());
  };
  // FSDP2 (StepShape::fsdp), in the order its hooks run; NOTE [FSDP2].
  enum Stream { kCompute = 0, kAllGather = 1, kReduceScatter = 2 };
  std::vector<char> unsharded(plan.stages.size(), 0), reduced(plan.stages.size(), 0);
  int64_t flat = 0, rs_input = 0;
  std::vector<int64_t> sharded_grads;  // the reduce-scatter outputs of this step: the stages' gradients
  auto weights = [&](size_t i) {       // a stage's bf16 weights
    int64_t b = 0;
    for (size_t k = 0; k < plan.stages[i].params.size(); ++k)
      b += plan.stages[i].spec->param_bytes(static_cast<int>(k));
    return b;
  };
  // All-gather into a flat buffer, copy out into the parameters. In the forward the flat buffer is
  // kept until the next copy-out (to overlap it with the next all-gather), which may come in the
  // backward; in the backward it goes at once.
  auto gather = [&](size_t i, bool keep_flat) {
    const int64_t w = weights(i);
    if (w == 0 || unsharded[i]) return;
    sim.alloc(w, kAllGather);
    sim.alloc(w, kCompute);
    unsharded[i] = 1;
    sim.free(flat, kAllGather);
    flat = 0;
    if (keep_flat)
      flat = w;
    else
      sim.free(w, kAllGather);
  };
  auto fsdp_forward = [&](size_t i) {
    if (shape.fsdp) gather(i, /*keep_flat=*/true);
  };
  auto fsdp_after_forward = [&](size_t i) {
    if (!shape.fsdp || !unsharded[i] || !shape.fsdp_reshard || plan.stages[i].role == StagePlan::Role::Head) return;
    sim.free(weights(i));
    unsharded[i] = 0;
  };
  auto fsdp_backward = [&](const Chunk& c, size_t i) {
    if (!shape.fsdp) return;
    gather(i, false);
    for (size_t j = i; j-- > c.first;)  // the next stage the backward reaches with weights: gathered ahead
      if (weights(j) > 0) {
        gather(j, false);
        break;
      }
  };
  auto fsdp_reduce = [&](size_t i) {  // the gradients copied (up-cast) into the reduce-scatter input
    if (shape.fsdp && weights(i) > 0) sim.alloc(weights(i) * 4 / wbytes);
  };
  auto fsdp_after_backward = [&](size_t i) {
    if (!shape.fsdp || weights(i) == 0) return;
    if (!reduced[i]) {  // the sharded gradient, accumulated into by later micro-batches
      const int64_t g = std::max<int64_t>(1, weights(i) / wbytes / shape.world) * (master > 0 ? master : wbytes);
      sim.alloc(g, kReduceScatter);
      sharded_grads.push_back(g);
      reduced[i] = 1;
    }
    sim.free(rs_input);  // the previous stage's input, its reduce-scatter done
    rs_input = weights(i) * 4 / wbytes;
    sim.free(weights(i));  // resharded after the backward
    unsharded[i] = 0;
  };
  // One chunk's forward of one micro-batch. Its input comes from the data or the previous pipeline
  // stage (received: counted here, freed by the first block's backward); its output goes to the
  // next stage (sent, then freed) or is the loss.
  auto forward = [&](const Chunk& c, MemoryTrace& tr) {
    if (!c.begins) sim.alloc(plan.stages[c.first].spec->tensors[plan.stages[c.first].spec->inputs[0]].bytes());
    for (size_t i = c.first; i <= c.last; ++i) {
      fsdp_forward(i);
      phase(plan.stages[i], false, tr, [&] { forward_stage(sim, plan.stages[i], ctx); });
      fsdp_after_forward(i);
    }
    if (!c.ends) sim.free(plan.stages[c.last].spec->tensors[plan.stages[c.last].spec->output].bytes());
  };
  // Its backward: the root gradient first (rule 1), or the gradient received for its output; each
  // stage's dy is the gradient the stage after it returned (rule 2); the last one is sent.
  auto backward = [&](const Chunk& c, Grads mode, MemoryTrace& tr) {
    const StagePlan& last = plan.stages[c.last];
    const int64_t root = last.spec->tensors[last.spec->output].bytes();
    int64_t dy = c.ends ? (shape.scaled_loss ? root : 0) : root;  // rule 5: the gradient through the division
    if (!c.ends) sim.alloc(dy);
    for (size_t i = c.last + 1; i-- > c.first;) {
      const StagePlan& st = plan.stages[i];
      // A unit's pre-backward hook fires when the gradient reaches its output: for the head, after
      // the loss's backward (the loss is computed outside the model).
      const bool head = st.role == StagePlan::Role::Head;
      if (!head) fsdp_backward(c, i);
      phase(st, true, tr, [&] {
        if (head) {
          sim.alloc(root);
          sim.alloc(dy);
        }
        backward_stage(sim, st, pg, ctx, shape.fused_wgrad);
        if (head) fsdp_backward(c, i);
        const bool keeps_dy =
            !st.schedule->input_grad_is_dy.empty() && st.schedule->input_grad_is_dy[0] && !st.external[0];
        if (!keeps_dy) sim.free(dy);
        sim.at("summing a tied parameter's gradients", &st, -1);
        fsdp_reduce(i);
        settle(sim, pg, mode);
        fsdp_after_backward(i);
      });
      dy = st.spec->tensors[st.spec->inputs[0]].bytes();
    }
    sim.free(rs_input);
    rs_input = 0;
    sim.free(flat, kAllGather);  // (a forward's last all-gather, when no copy-out came after it)
    flat = 0;
    if (!c.begins) sim.free(dy);  // the input's gradient, sent back
    if (c.ends) {
      sim.free(root);
      sim.free(root);  // the caller lets go of the loss
    }
  };

  // Op by op, in pipeline order. One process without buffers replays two micro-batches: the first
  // (its gradients become .grad) and one later one (added into them); the others repeat it.
  auto replay = [&](int micro) {
    int backwards = 0;
    for (const PipelineStep& e : pipeline_order(shape.stages, shape.stage, shape.chunks, micro)) {
      MemoryTrace& tr = e.micro == 0 ? t : scratch;
      if (e.forward) {
        forward(chunks[e.chunk], tr);
        continue;
      }
      const Grads mode = bucketed ? Grads::Handed : backwards == 0 ? Grads::First : Grads::Later;
      pg.has.assign(plan.params.size(), false);  // (a rank holds both users of a tied parameter in one chunk)
      backward(chunks[e.chunk], mode, tr);
      ++backwards;
    }
    m.peak = top;
    m.peak_at = describe(sim.peak_at());
  };
  if (shape.cuda) {
    // The caching allocator sees every block: the persistent tensors, then two steps op by op with
    // the optimizer's state made at the first optimizer step (what the first step's activations
    // freed may hold it).
    detail::CachingAllocatorModel cuda(shape.expandable_segments);
    Sim persistent(&cuda);
    sim = Sim(&cuda);
    auto share = [&](const ModelParam& p, bool sharded) {
      return sharded ? std::max<int64_t>(1, p.spec->numel() / shape.world) : p.spec->numel();
    };
    for (int64_t b : shape.fixed_blocks) persistent.alloc(b);
    if (shape.fsdp)  // each parameter's shard (fp32: the master copy)
      for (const ModelParam& p : plan.params) persistent.alloc(share(p, true) * (master > 0 ? master : wbytes));
    else if (shape.zero >= 3)
      persistent.alloc(m.params);  // this rank's shard, one flat tensor
    else
      for (const ModelParam& p : plan.params) persistent.alloc(p.spec->numel() * wbytes);
    if (bucketed && !shape.fsdp) persistent.alloc(m.grads);
    persistent.alloc(m.data);
    const int micro = periodic_micro(shape.stages, shape.stage, shape.chunks, shape.micro);
    replay(micro);
    // The optimizer's state, per parameter's share: (an fp32 master copy,) m and v.
    for (const ModelParam& p : plan.params) {
      const int64_t n = share(p, shape.fsdp || shape.zero >= 1);
      if (master > 0 && !shape.fsdp) persistent.alloc(n * master);
      for (int k = 0; k < 2; ++k) persistent.alloc(n * state / 2);
    }
    for (int64_t g : sharded_grads) sim.free(g, kReduceScatter);  // zero_grad before the next step
    sharded_grads.clear();
    std::fill(reduced.begin(), reduced.end(), 0);
    replay(micro);
    m.allocated_peak = cuda.peak_allocated();
    m.reserved_peak = cuda.peak_reserved();
  } else if (!bucketed) {
    replay(std::min(shape.micro, 2));
  } else if (shape.op_by_op) {
    replay(shape.micro);
  } else if (shape.fsdp) {  // FSDP2's gradients appear in the first backward only: no fold
    replay(periodic_micro(shape.stages, shape.stage, shape.chunks, shape.micro));
  } else {
    // With buffers every micro-batch is alike: a chunk's forward (or backward) changes the level by
    // the same amount and rises the same height above where it starts, whatever else is alive (the
    // fold only adds and subtracts). Replay each pass once, then fold the pipeline order over them.
    struct Pass {
      int64_t delta = 0, height = 0;
      Where at;
    };
    std::vector<Pass> fwd(chunks.size()), bwd(chunks.size());
    for (size_t c = 0; c < chunks.size(); ++c) {
      sim = Sim();
      forward(chunks[c], t);
      fwd[c] = {sim.live(), sim.top(), sim.peak_at()};
      sim = Sim();
      pg.has.assign(plan.params.size(), false);
      backward(chunks[c], Grads::Handed, t);
      bwd[c] = {sim.live(), sim.top(), sim.peak_at()};
    }
    int64_t level = 0, highest = 0;
    Where at;
    for (const PipelineStep& e : pipeline_order(shape.stages, shape.stage, shape.chunks,
                                                periodic_micro(shape.stages, shape.stage, shape.chunks, shape.micro))) {
      const Pass& p = e.forward ? fwd[e.chunk] : bwd[e.chunk];
      if (level + p.height > highest) highest = level + p.height, at = p.at;
      level += p.delta;
    }
    m.peak = highest;
    m.peak_at = describe(at);
  }
  // What one micro-batch's forward leaves (replayed alone: the fold above has gone on since).
  {
    Sim f;
    sim = f;
    for (const Chunk& c : chunks) forward(c, scratch);
    m.saved = sim.live();
  }
  if (out) *out = std::move(t);
  return m;
}

StepMemory simulate_memory(const ModelConfig& cfg, const ResolvedPolicy& policy, const ThreadConfig& ctx) {
  auto spec = std::make_shared<const ModelSpec>(make_model(cfg));
  return simulate_memory(compile_step(spec, policy), ctx);
}

BlockMemory simulate_block(const BlockSpec& spec, const Schedule& schedule, const ThreadConfig& ctx) {
  StagePlan st;
  st.spec = &spec;
  st.schedule = std::shared_ptr<const Schedule>(&schedule, [](const Schedule*) {});
  st.params.resize(spec.params.size());
  for (size_t i = 0; i < st.params.size(); ++i) st.params[i] = static_cast<int>(i);
  st.external.assign(spec.inputs.size(), false);
  BlockMemory o;
  o.saved = schedule.saved_bytes(spec);
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
