// compile_schedule: the one place where a stage's recompute order, tensor lifetimes and gradient
// buffers are decided (docs/design.md, NOTE [Recompute order], NOTE [One plan]).
#include "remat/schedule.h"

#include <algorithm>
#include <functional>

#include "remat/error.h"

namespace remat {

int64_t Schedule::saved_bytes(const BlockSpec& spec) const {
  int64_t bytes = 0;
  for (size_t t = 0; t < saved.size(); ++t)
    if (saved[t] && !spec.is_input(static_cast<int>(t))) bytes += spec.tensors[t].bytes();
  return bytes;
}

namespace {

// Gradient buffers as the compiler tracks them: who shares which memory, and the bytes each
// allocation and each last reference's release moves (written to `events`). Buffer 0 is the stage's
// incoming dy, which belongs to autograd: its bytes are never the stage's.
class GradState {
 public:
  struct Slot {
    int buf = -1;
    bool owned = false;  // made for this slot (not an alias): the slot may add into it in place
  };

  GradState(size_t tensors, int output) : slots_(tensors) {
    add(0, false);
    slots_[output] = {0, false};
  }

  Slot& slot(int t) { return slots_[t]; }
  // A new buffer of `bytes`, allocated now; or (allocate false) memory already counted that the
  // buffer takes over (an input written over).
  int fresh(int64_t bytes, bool allocate = true) {
    if (allocate) emit(bytes);
    return add(bytes, true);
  }
  void share(int buf) { ++refs_[buf]; }
  void drop(int buf) {
    if (buf >= 0 && --refs_[buf] == 0 && counted_[buf]) emit(-bytes_[buf]);
  }
  // The slot's memory is its own and nothing else refers to it: it may be written over.
  bool sole(const Slot& s) const { return s.buf > 0 && s.owned && refs_[s.buf] == 1; }

  std::vector<int64_t>* events = nullptr;  // where the bytes go: the step being planned

 private:
  int add(int64_t bytes, bool counted) {
    refs_.push_back(1);
    bytes_.push_back(bytes);
    counted_.push_back(counted);
    return static_cast<int>(refs_.size()) - 1;
  }
  void emit(int64_t bytes) {
    if (events == nullptr) REMAT_INTERNAL("gradient bytes moved outside a step");
    events->push_back(bytes);
  }

  std::vector<Slot> slots_;
  std::vector<int> refs_;
  std::vector<int64_t> bytes_;
  std::vector<bool> counted_;
};

// Forward: run each op; drop what neither a later op nor the backward needs.
std::vector<Step> forward_steps(const BlockSpec& spec, const std::vector<bool>& saved) {
  const int n_tensors = static_cast<int>(spec.tensors.size()), n_ops = static_cast<int>(spec.ops.size());
  std::vector<int> last_forward_use(n_tensors, -1);
  for (int t = 0; t < n_tensors; ++t) last_forward_use[t] = spec.tensors[t].producer;
  for (int o = 0; o < n_ops; ++o)
    for (int t : spec.ops[o].in) last_forward_use[t] = std::max(last_forward_use[t], o);
  std::vector<Step> steps;
  for (int o = 0; o < n_ops; ++o) {
    steps.push_back({Step::Kind::Forward, o});
    for (int t = 0; t < n_tensors; ++t)
      if (last_forward_use[t] == o && !saved[t] && t != spec.output && !spec.is_input(t))
        steps.push_back({Step::Kind::Free, t});
  }
  return steps;
}

// Backward, pass 1: before each op's backward, recompute what it reads and is missing
// (recursively, each op once). A recompute's outputs that are still held keep their forward value.
// Appends the recomputed ops to `recomputed`.
std::vector<Step> backward_order(const BlockSpec& spec, const LayerPolicy& policy, const std::vector<bool>& saved,
                                 std::vector<int>& recomputed) {
  const int n_ops = static_cast<int>(spec.ops.size());
  std::vector<bool> held = saved;
  std::vector<Step> steps;
  std::function<void(int)> ensure = [&](int t) {
    if (held[t]) return;
    const int p = spec.tensors[t].producer;
    for (int u : spec.ops[p].in) ensure(u);
    Step st{Step::Kind::Recompute, p};
    const std::vector<int>& outs = spec.ops[p].out;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (held[outs[i]]) st.discard |= 1u << i;
      held[outs[i]] = true;
    }
    steps.push_back(st);
    recomputed.push_back(p);
  };
  if (policy.eager) {
    // Everything the backward needs, recomputed at its start in forward order (a producer's op id
    // is below its consumers'), then the backward.
    for (int o = n_ops - 1; o >= 0; --o)
      for (int t : spec.bwd_reads(o)) ensure(t);
    std::stable_sort(steps.begin(), steps.end(), [](const Step& a, const Step& b) { return a.index < b.index; });
    for (int o = n_ops - 1; o >= 0; --o) steps.push_back({Step::Kind::Backward, o});
  } else {
    for (int o = n_ops - 1; o >= 0; --o) {
      for (int t : spec.bwd_reads(o)) ensure(t);
      steps.push_back({Step::Kind::Backward, o});
    }
  }
  return steps;
}

// Pass 2: each tensor's last use, and where each gradient dies (after its producer's backward), as
// indices into the backward's steps. A held tensor nothing reads in the backward goes at its first
// step (a checkpoint's recompute takes it from storage and lets it go).
struct Lifetimes {
  std::vector<int> last_use, grad_last_use;  // by tensor; -1: never
};

Lifetimes lifetimes(const BlockSpec& spec, const LayerPolicy& policy, const std::vector<bool>& saved,
                    const std::vector<Step>& steps) {
  const int n_tensors = static_cast<int>(spec.tensors.size());
  Lifetimes l{std::vector<int>(n_tensors, -1), std::vector<int>(n_tensors, -1)};
  for (int t = 0; t < n_tensors; ++t)
    if (saved[t] && !spec.is_input(t) && policy.holds(t)) l.last_use[t] = 0;
  for (int i = 0; i < static_cast<int>(steps.size()); ++i) {
    const Step& step = steps[i];
    const OpNode& op = spec.ops[step.index];
    if (step.kind == Step::Kind::Recompute) {
      for (int t : op.in) l.last_use[t] = i;
      for (int t : op.out) l.last_use[t] = std::max(l.last_use[t], i);  // unused outputs die at once
    } else {
      for (int t : spec.bwd_reads(step.index)) l.last_use[t] = i;
      for (int t : op.out) l.grad_last_use[t] = i;
    }
  }
  return l;
}

// Pass 3, in step order: each backward's gradient plan, decided on the buffers as they stand at
// that step; then the frees. A backward with no output gradient is left out.
class GradPlanner {
 public:
  GradPlanner(const BlockSpec& spec, const std::vector<bool>& need, const Lifetimes& life)
      : spec_(spec), need_(need), life_(life), g_(spec.tensors.size(), spec.output), adopted_(spec.tensors.size()) {}

  void run(const std::vector<Step>& steps, Schedule& s) {
    for (int i = 0; i < static_cast<int>(steps.size()); ++i) {
      Step step = steps[i];
      if (step.kind != Step::Kind::Backward || plan_backward(step, i)) s.backward.push_back(step);
      for (int t = 0; t < static_cast<int>(spec_.tensors.size()); ++t) {
        if (life_.last_use[t] == i && !adopted_[t]) s.backward.push_back({Step::Kind::Free, t});
        if (life_.grad_last_use[t] == i && !spec_.is_input(t)) {
          GradState::Slot& slot = g_.slot(t);
          if (slot.buf >= 0) {
            Step free{Step::Kind::FreeGrad, t};
            g_.events = &free.joined;
            g_.drop(slot.buf);
            g_.events = nullptr;
            s.backward.push_back(std::move(free));
          }
          slot = {};
        }
      }
    }
    for (int in : spec_.inputs) s.input_grad_is_dy.push_back(g_.slot(in).buf == 0);
  }

 private:
  int64_t bytes(int t) const { return spec_.tensors[t].bytes(); }

  bool needs_grad(int t) const {
    if (!is_float(spec_.tensors[t].dtype)) return false;
    const int k = spec_.input_index(t);
    return k < 0 || need_[k];
  }

  // The op produces every gradient first, then each joins its input's slot; false when no
  // gradient reaches the op's outputs.
  bool plan_backward(Step& step, int i) {
    const OpNode& op = spec_.ops[step.index];
    bool any = false;
    for (int t : op.out) any = any || g_.slot(t).buf >= 0;
    if (!any) return false;
    std::vector<GradState::Slot> incoming(op.in.size());
    g_.events = &step.made;
    for (size_t k = 0; k < op.in.size(); ++k) incoming[k] = source(op, static_cast<int>(k), i, step.grads[k]);
    g_.events = &step.joined;
    for (size_t k = 0; k < op.in.size(); ++k) merge(op.in[k], incoming[k], step.grads[k]);
    g_.events = nullptr;
    return true;
  }

  // Where the gradient of input k comes from (gs.source, gs.prep); the buffer it is made in.
  GradState::Slot source(const OpNode& op, int k, int i, GradStep& gs) {
    const int t = op.in[k];
    const GradKind kind = grad_kind(op_def(op.kind), op, k);
    if (kind == GradKind::None || !needs_grad(t)) return {};
    GradState::Slot& out0 = g_.slot(op.out[0]);
    if (kind == GradKind::OverDy && g_.sole(out0)) {
      gs.source = GradSource::OverDy;
      const GradState::Slot dy = out0;
      out0 = {};
      return dy;
    }
    if (kind == GradKind::OverInput && life_.last_use[t] == i && !spec_.is_input(t)) {
      gs.source = GradSource::OverInput;
      adopted_[t] = true;
      return {g_.fresh(bytes(t), /*allocate=*/false), true};
    }
    if (kind == GradKind::Alias) {
      gs.source = GradSource::Alias;
      g_.share(out0.buf);
      return {out0.buf, false};
    }
    if (kind == GradKind::Slot) {
      gs.source = GradSource::Slot;
      GradState::Slot& mine = g_.slot(t);
      if (mine.buf < 0) {
        gs.prep = SlotPrep::Zeros;
        mine = {g_.fresh(bytes(t)), true};
      } else if (!g_.sole(mine)) {
        gs.prep = SlotPrep::Copy;  // the copy is made while the shared one is still held
        const int copy = g_.fresh(bytes(t));
        g_.drop(mine.buf);
        mine = {copy, true};
      } else {
        gs.prep = SlotPrep::Existing;
      }
      return {};
    }
    gs.source = GradSource::Fresh;  // also the fallback of OverDy and OverInput
    return {g_.fresh(bytes(t)), true};
  }

  // How the gradient made for tensor t joins t's slot (gs.merge).
  void merge(int t, const GradState::Slot& in, GradStep& gs) {
    if (gs.source == GradSource::None || gs.source == GradSource::Slot) return;
    GradState::Slot& slot = g_.slot(t);
    if (slot.buf < 0) {
      gs.merge = GradMerge::Set;
      slot = in;
    } else if (g_.sole(slot)) {
      gs.merge = GradMerge::AddIntoSlot;
      g_.drop(in.buf);
    } else if (in.owned) {
      gs.merge = GradMerge::AddSlotIntoIt;
      g_.drop(slot.buf);
      slot = in;
    } else {
      gs.merge = GradMerge::Sum;  // the sum is made while both are still held
      const int sum = g_.fresh(bytes(t));
      g_.drop(slot.buf);
      g_.drop(in.buf);
      slot = {sum, true};
    }
  }

  const BlockSpec& spec_;
  const std::vector<bool>& need_;
  const Lifetimes& life_;
  GradState g_;
  std::vector<bool> adopted_;  // memory taken over by an OverInput gradient
};

}  // namespace

Schedule compile_schedule(const BlockSpec& spec, const LayerPolicy& policy, std::vector<bool> need) {
  const int n_tensors = static_cast<int>(spec.tensors.size());
  if (static_cast<int>(policy.tensors.size()) != n_tensors)
    fail(
        "a layer policy of {} tensor choices for the '{}' block's {}; resolve the policy for this block "
        "(Policy::resolve)",
        policy.tensors.size(), spec.kind, n_tensors);
  if (need.empty())
    for (int in : spec.inputs) need.push_back(is_float(spec.tensors[in].dtype));
  if (need.size() != spec.inputs.size())
    REMAT_INTERNAL("need_input_grad has {} entries for {} inputs", need.size(), spec.inputs.size());
  Schedule s;
  s.need_input_grad = need;
  s.saved.assign(n_tensors, false);
  for (int t = 0; t < n_tensors; ++t)
    s.saved[t] = spec.is_input(t) || ((spec.tensors[t].read_by_backward || policy.holds(t)) && policy.saves(t));
  s.forward = forward_steps(spec, s.saved);
  const std::vector<Step> steps = backward_order(spec, policy, s.saved, s.recomputed);
  const Lifetimes life = lifetimes(spec, policy, s.saved, steps);
  GradPlanner(spec, need, life).run(steps, s);
  return s;
}

std::shared_ptr<const Schedule> ScheduleCache::get(const BlockSpec& spec, const LayerPolicy& policy,
                                                   const std::vector<bool>& need) {
  const BlockSpec* address = &spec;  // the block's identity
  key_.assign(reinterpret_cast<const char*>(&address), sizeof(address));
  policy.append_key(key_);
  key_ += '|';
  for (bool b : need) key_ += b ? '1' : '0';
  auto it = entries_.find(key_);
  if (it != entries_.end()) return it->second;
  auto s = std::make_shared<const Schedule>(compile_schedule(spec, policy, need));
  entries_.emplace(key_, s);
  return s;
}

CompiledStep compile_step(std::shared_ptr<const ModelSpec> model, const ResolvedPolicy& policy, ScheduleCache* cache) {
  const int64_t layers = model->layers;
  return compile_step(std::move(model), policy, {{0, layers}}, cache);
}

namespace {

// Builds a CompiledStep stage by stage: each stage's schedule from the cache (consecutive layers
// with equal choices share the last one's), its parameters named and tied across the stages.
class StepCompiler {
 public:
  StepCompiler(const ModelSpec& m, const ResolvedPolicy& policy, ScheduleCache& cache, CompiledStep& plan)
      : m_(m), policy_(policy), cache_(cache), plan_(plan) {}

  void add(CompiledStage::Role role, const BlockSpec& spec, int64_t layer, const LayerPolicy& lp, int chunk) {
    CompiledStage st;
    st.role = role;
    st.layer = layer;
    st.spec = &spec;
    st.chunk = chunk;
    const std::vector<bool> need = mark_external(st);
    schedule(st, lp, need);
    bind_params(st);
    plan_.stages.push_back(std::move(st));
  }

 private:
  // Data the caller owns: the model's first input (tokens, or the seed block's x), and the head's
  // targets. A pipeline rank's received activations are its own, and need their gradient. Returns
  // which inputs need one.
  std::vector<bool> mark_external(CompiledStage& st) const {
    const BlockSpec& spec = *st.spec;
    const bool model_first = st.role == CompiledStage::Role::Stem ||
                             (!m_.has_stem && st.role == CompiledStage::Role::Block && st.layer == 0);
    for (size_t k = 0; k < spec.inputs.size(); ++k)
      st.external.push_back((model_first && k == 0) || (st.role == CompiledStage::Role::Head && k > 0));
    std::vector<bool> need;
    for (size_t k = 0; k < spec.inputs.size(); ++k)
      need.push_back(!st.external[k] && is_float(spec.tensors[spec.inputs[k]].dtype));
    return need;
  }

  // Consecutive layers mostly choose alike: the last block's schedule is reused without a lookup.
  void schedule(CompiledStage& st, const LayerPolicy& lp, const std::vector<bool>& need) {
    const bool block = st.role == CompiledStage::Role::Block;
    const bool same = block && last_block_ && need == last_need_ && last_policy_->same_choices(lp);
    st.schedule = same ? last_block_ : cache_.get(*st.spec, lp, need);
    if (!block) return;
    last_block_ = st.schedule, last_policy_ = &lp, last_need_ = need;
    if (policy_.segment > 0) {
      st.segment = st.layer / policy_.segment;
      st.first_pass = cache_.get(*st.spec, keep_nothing(*st.spec), need);
    }
  }

  // Parameters by model name: the stem's and the head's as they are, block l's as "h<l>.<name>".
  void bind_params(CompiledStage& st) {
    const bool block = st.role == CompiledStage::Role::Block;
    const bool stem = m_.has_stem && !plan_.chunks.empty() && plan_.chunks.front().first == 0;
    const std::string prefix = block ? "h" + std::to_string(st.layer) + "." : std::string();
    for (const ParamSpec& p : st.spec->params) {
      std::string name = p.tied_to.empty() ? prefix + p.name : p.tied_to;
      // Only the stem's and the head's names can meet again (ties, duplicates); a block's are
      // unique by their layer prefix and skip the index.
      const auto found = block && p.tied_to.empty() ? ids_.end() : ids_.find(name);
      int id = found == ids_.end() ? -1 : found->second;
      if (!p.tied_to.empty() && id < 0 && stem)
        REMAT_INTERNAL("'{}' in '{}' is tied to '{}', which no earlier stage has", p.name, st.spec->kind, p.tied_to);
      if (p.tied_to.empty() && id >= 0) REMAT_INTERNAL("two parameters of the model are named '{}'", name);
      if (id < 0) {  // (a tied parameter without the stem: this rank's copy)
        id = static_cast<int>(plan_.params.size());
        if (!block) ids_.emplace(name, id);
        plan_.params.push_back({std::move(name), &p, 0});
      }
      ++plan_.params[id].uses;
      st.params.push_back(id);
    }
  }

  const ModelSpec& m_;
  const ResolvedPolicy& policy_;
  ScheduleCache& cache_;
  CompiledStep& plan_;
  std::unordered_map<std::string, int> ids_;  // model parameter id by name (stem and head only)
  std::shared_ptr<const Schedule> last_block_;
  const LayerPolicy* last_policy_ = nullptr;
  std::vector<bool> last_need_;
};

}  // namespace

CompiledStep compile_step(std::shared_ptr<const ModelSpec> model, const ResolvedPolicy& policy,
                          const std::vector<LayerRange>& chunks, ScheduleCache* cache) {
  const ModelSpec& m = *model;
  if (static_cast<int64_t>(policy.layers.size()) != m.layers)
    fail("the policy has {} layers; the model has {}", policy.layers.size(), m.layers);
  for (size_t c = 0; c < chunks.size(); ++c)
    if (chunks[c].first < (c ? chunks[c - 1].end : 0) || chunks[c].end <= chunks[c].first || chunks[c].end > m.layers)
      REMAT_INTERNAL("chunk {} holds layers [{}, {}) of {}", c, chunks[c].first, chunks[c].end, m.layers);
  ScheduleCache local;
  CompiledStep plan;
  plan.segment = policy.segment;
  plan.chunks = chunks;
  StepCompiler compiler(m, policy, cache ? *cache : local, plan);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int chunk = static_cast<int>(c);
    if (chunks[c].first == 0 && m.has_stem)
      compiler.add(CompiledStage::Role::Stem, m.stem, -1, keep_everything(m.stem), chunk);
    for (int64_t l = chunks[c].first; l < chunks[c].end; ++l)
      compiler.add(CompiledStage::Role::Block, m.block, l, policy.layers[l], chunk);
    if (chunks[c].end == m.layers)
      compiler.add(CompiledStage::Role::Head, m.head, m.layers, keep_everything(m.head), chunk);
  }
  plan.model = std::move(model);
  return plan;
}

}  // namespace remat
