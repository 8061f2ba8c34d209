#include "remat/planner.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>
#include <unordered_set>

#include <fmt/format.h>

#include "remat/error.h"

namespace remat {

namespace {

// ---------------------------------------------------------------------------------------------
// Byte replay of the executor (NOTE [The planner], rule 1). Every rule here mirrors a line of
// executor.cpp or an op's backward; the memory-model tests hold the result equal to the tracker.

struct Where {
  const char* pass = "";  // "forward", "backward", "recompute"
  const BlockSpec* stage = nullptr;
  int64_t layer = -1;
  int op = -1;
};

class Sim {
 public:
  void alloc(int64_t n) {
    live_ += n;
    peak_ = std::max(peak_, live_);
    if (live_ > top_) {
      top_ = live_;
      peak_at_ = where_;
    }
  }
  void free(int64_t n) { live_ -= n; }
  void at(const char* pass, const BlockSpec* stage, int64_t layer, int op) { where_ = {pass, stage, layer, op}; }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  // Where the highest level of the whole run was reached.
  const Where& peak_at() const { return peak_at_; }
  // Starts a new peak measurement at the current level (peak_at keeps the run's highest).
  void restart_peak() { peak_ = live_; }

 private:
  int64_t live_ = 0, peak_ = 0, top_ = 0;
  Where where_, peak_at_;
};

std::string describe_where(const Where& w) {
  if (w.stage == nullptr) return "start of the step";
  std::string stage = w.stage->kind.find(".stem") != std::string::npos   ? "the embedding"
                      : w.stage->kind.find(".head") != std::string::npos ? "the head"
                                                                         : fmt::format("layer {}", w.layer);
  return fmt::format("{} of {}, op '{}'", w.pass, stage, w.stage->ops[w.op].name);
}

// Which parameters already hold a gradient: a tied parameter's second gradient is added into the
// first by autograd and freed when its stage returns.
struct ParamGrads {
  std::unordered_set<std::string> has;
  int64_t pending_free = 0;
};

void forward_stage(Sim& sim, const BlockSpec& b, const Schedule& s, int64_t layer) {
  for (const Step& st : s.forward) {
    if (st.kind == Step::Kind::Free) {
      sim.free(b.tensors[st.index].bytes());
      continue;
    }
    sim.at("forward", &b, layer, st.index);
    for (int t : b.ops[st.index].out) sim.alloc(b.tensors[t].bytes());
    const int64_t scratch = b.forward_scratch(st.index);
    sim.alloc(scratch);
    sim.free(scratch);
  }
}

// Gradient memory: tensors that several gradient slots may share (a residual add passes its
// output gradient to both inputs), freed when the last slot lets go.
class GradBuffers {
 public:
  static constexpr int kNone = -1;
  explicit GradBuffers(Sim& sim) : sim_(sim) {}

  // A tensor owned by someone else (autograd's dy): never freed here.
  int external() { return add(0, false); }
  int fresh(int64_t bytes) {
    sim_.alloc(bytes);
    return add(bytes, true);
  }
  // Memory already counted (a tensor handed over to become a gradient): owned from now on.
  int adopt(int64_t bytes) { return add(bytes, true); }
  int share(int buf) {
    ++refs_[buf];
    return buf;
  }
  void drop(int buf) {
    if (buf == kNone) return;
    if (--refs_[buf] == 0 && counted_[buf]) sim_.free(bytes_[buf]);
  }
  bool is_external(int buf) const { return buf != kNone && !counted_[buf]; }

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

struct GradSlot {
  int buf = GradBuffers::kNone;
  bool owned = false;  // OpEnv's grad_owned: created for this slot, safe to add into in place
};

// Mirrors OpEnv::add_grad: `incoming` is a buffer reference this slot now receives.
void accumulate(GradBuffers& bufs, GradSlot& slot, int incoming, bool owned, int64_t bytes) {
  if (slot.buf == GradBuffers::kNone) {
    slot = {incoming, owned};
  } else if (slot.owned) {
    bufs.drop(incoming);  // slot.add_(g)
  } else if (owned) {
    bufs.drop(slot.buf);  // g.add_(slot); slot = g
    slot = {incoming, true};
  } else {
    const int sum = bufs.fresh(bytes);  // slot + g
    bufs.drop(slot.buf);
    bufs.drop(incoming);
    slot = {sum, true};
  }
}

// One stage's backward. `external`: inputs owned by the caller (data), never freed here. Returns
// whether the gradient returned for input 0 is dy itself (then dy outlives the stage).
bool backward_stage(Sim& sim, const BlockSpec& b, const Schedule& s, const std::vector<bool>& need_input_grad,
                    const std::vector<bool>& external, ParamGrads& pg, const std::string& param_prefix,
                    int64_t layer, int threads) {
  const size_t n = b.tensors.size();
  GradBuffers bufs(sim);
  std::vector<GradSlot> g(n);
  g[b.output] = {bufs.external(), false};  // dy belongs to autograd
  std::vector<bool> held = s.saved;
  auto input_index = [&](int t) {
    for (size_t k = 0; k < b.inputs.size(); ++k)
      if (b.inputs[k] == t) return static_cast<int>(k);
    return -1;
  };
  auto needs_grad = [&](int t) {
    const DType d = b.tensors[t].dtype;
    if (d == DType::Bool || d == DType::I64) return false;
    const int k = input_index(t);
    return k < 0 || need_input_grad[k];
  };
  for (const Step& st : s.backward) {
    switch (st.kind) {
      case Step::Kind::Free: {
        const int k = input_index(st.index);
        if (held[st.index] && !(k >= 0 && external[k])) sim.free(b.tensors[st.index].bytes());
        held[st.index] = false;
        break;
      }
      case Step::Kind::FreeGrad:
        if (!b.is_input(st.index)) {
          bufs.drop(g[st.index].buf);
          g[st.index] = {};
        }
        break;
      case Step::Kind::Recompute: {
        const OpNode& op = b.ops[st.index];
        sim.at("recompute", &b, layer, st.index);
        for (int t : op.out) sim.alloc(b.tensors[t].bytes());
        const int64_t scratch = b.forward_scratch(st.index);
        sim.alloc(scratch);
        sim.free(scratch);
        for (int t : op.out) {
          if (held[t]) sim.free(b.tensors[t].bytes());  // the forward's value is kept
          held[t] = true;
        }
        break;
      }
      case Step::Kind::Backward: {
        const OpNode& op = b.ops[st.index];
        bool any = false;
        for (int t : op.out) any = any || g[t].buf != GradBuffers::kNone;
        if (!any) break;
        sim.at("backward", &b, layer, st.index);
        const OpInfo& info = op_info(op.kind);
        const int dy = g[op.out[0]].buf;
        // The op's ATen pair returns all its gradients at once...
        std::vector<int> incoming(op.in.size(), GradBuffers::kNone);
        for (size_t i = 0; i < op.in.size(); ++i) {
          const int t = op.in[i];
          if (!needs_grad(t)) continue;
          const int64_t bytes = b.tensors[t].bytes();
          const GradKind kind = info.grad_in[i];
          const int out = op.out[0];
          if (kind == GradKind::OverDy && g[out].owned) {  // OpEnv::take_grad_out
            incoming[i] = g[out].buf;
            g[out] = {};
          } else if (kind == GradKind::OverInput && (st.last_read & (1u << i))) {  // OpEnv::take_in
            incoming[i] = bufs.adopt(bytes);
            held[t] = false;  // its Free step releases nothing
          } else if (kind == GradKind::Fresh || kind == GradKind::OverDy || kind == GradKind::OverInput) {
            incoming[i] = bufs.fresh(bytes);  // the kind itself, or the fallback of the two above
          } else if (kind == GradKind::Alias) {
            incoming[i] = bufs.share(dy);
          } else if (kind == GradKind::Slot && !g[t].owned) {
            const int mine = bufs.fresh(bytes);  // zeros, or a private copy of a shared one
            bufs.drop(g[t].buf);
            g[t] = {mine, true};
          }
        }
        for (int p : op.params) {
          sim.alloc(b.param_bytes(p));
          const std::string name = param_prefix + b.params[p].name;
          if (!pg.has.insert(name).second) pg.pending_free += b.param_bytes(p);
        }
        const int64_t scratch = b.backward_scratch(st.index, threads);
        sim.alloc(scratch);
        sim.free(scratch);
        // ...then the executor adds them in.
        for (size_t i = 0; i < op.in.size(); ++i)
          if (incoming[i] != GradBuffers::kNone)
            accumulate(bufs, g[op.in[i]], incoming[i], info.grad_in[i] != GradKind::Alias, b.tensors[op.in[i]].bytes());
        break;
      }
      case Step::Kind::Forward:
        break;
    }
  }
  sim.free(pg.pending_free);  // autograd added the tied gradients in place
  pg.pending_free = 0;
  // Everything but the returned input gradients is released when the stage returns.
  const bool returns_dy = bufs.is_external(g[b.inputs[0]].buf);
  for (size_t t = 0; t < n; ++t)
    if (!b.is_input(static_cast<int>(t))) bufs.drop(g[t].buf);
  return returns_dy;
}

std::string prefix_of(const BlockSpec& b, int64_t layer) {
  return b.kind.find('.') == std::string::npos ? fmt::format("h{}.", layer) : std::string();
}

LayerPolicy keep_all(const BlockSpec& spec) { return Policy::parse("none").resolve(spec, 1).layers[0]; }

// Per-stage levels of one simulated step, above base, for the planner's constraints.
struct Trace {
  std::vector<int64_t> fwd_start, fwd_peak;  // per layer
  std::vector<int64_t> bwd_start, bwd_peak;
  int64_t head_peak = 0;   // forward and backward of the head: grows with every layer's saved bytes
  int64_t stem_peak = 0;   // forward and backward of the stem: no layer's saved bytes are alive
};

StepMemory simulate(const ModelConfig& cfg, const ModelSpec& spec, const ResolvedPolicy& policy, int threads,
                    Trace* out) {
  if (policy.chunk > 0)
    fail("the memory model does not cover uniform:{} chunks (they run under remat::checkpoint)", policy.chunk);
  StepMemory m;
  // Parameters: the tied LM head weight counts once.
  std::unordered_set<std::string> names;
  int64_t numel = 0;
  auto count = [&](const BlockSpec& b, const std::string& prefix) {
    for (const ParamSpec& p : b.params) {
      if (!names.insert(prefix + p.name).second) continue;
      int64_t k = 1;
      for (int64_t d : p.shape) k *= d;
      numel += k;
    }
  };
  if (spec.has_stem) count(spec.stem, "");
  for (int64_t l = 0; l < spec.layers; ++l) count(spec.block, prefix_of(spec.block, l));
  count(spec.head, "");
  const bool mixed = cfg.dtype != DType::F32;
  m.params = numel * dtype_size(cfg.dtype);
  m.grads = m.params;
  m.optimizer = numel * (mixed ? 12 : 8);
  const BlockSpec& first = spec.has_stem ? spec.stem : spec.block;
  m.data = first.tensors[first.inputs[0]].bytes() + spec.head.tensors[spec.head.inputs[1]].bytes();

  const Schedule stem = spec.has_stem ? compile_schedule(spec.stem, keep_all(spec.stem)) : Schedule();
  const Schedule head = compile_schedule(spec.head, keep_all(spec.head));
  std::vector<Schedule> blocks;
  for (int64_t l = 0; l < spec.layers; ++l) blocks.push_back(compile_schedule(spec.block, policy.layers[l]));

  const int64_t L = spec.layers;
  Trace t{std::vector<int64_t>(L), std::vector<int64_t>(L), std::vector<int64_t>(L), std::vector<int64_t>(L), 0, 0};
  Sim sim;
  int64_t top = 0;  // highest level of the phases measured so far
  // Runs one phase, recording where it started and its peak.
  auto phase = [&](int64_t* start, int64_t* peak, auto body) {
    if (start) *start = sim.live();
    sim.restart_peak();
    body();
    *peak = std::max(*peak, sim.peak());
    top = std::max(top, sim.peak());
  };

  if (spec.has_stem) phase(nullptr, &t.stem_peak, [&] { forward_stage(sim, spec.stem, stem, -1); });
  for (int64_t l = 0; l < L; ++l)
    phase(&t.fwd_start[l], &t.fwd_peak[l], [&] { forward_stage(sim, spec.block, blocks[l], l); });
  phase(nullptr, &t.head_peak, [&] { forward_stage(sim, spec.head, head, L); });
  m.saved = sim.live();

  // Backward: autograd seeds the loss gradient (its graph root holds that tensor until the whole
  // backward ends), then runs the stages in reverse. Each stage's incoming gradient (dy) lives
  // until the stage returns; the gradient it returns becomes the previous stage's dy.
  ParamGrads pg;
  const int64_t root = spec.head.tensors[spec.head.output].bytes();
  phase(nullptr, &t.head_peak, [&] {
    sim.alloc(root);
    backward_stage(sim, spec.head, head, {true, false}, {false, true}, pg, "", L, threads);
  });
  int64_t dy = 0;
  dy = spec.head.tensors[spec.head.inputs[0]].bytes();
  for (int64_t l = L - 1; l >= 0; --l) {
    const bool data_input = l == 0 && !spec.has_stem;
    phase(&t.bwd_start[l], &t.bwd_peak[l], [&] {
      const bool returns_dy =
          backward_stage(sim, spec.block, blocks[l], {!data_input}, {data_input}, pg, prefix_of(spec.block, l), l, threads);
      if (!returns_dy || data_input) sim.free(dy);  // else dy lives on as the returned gradient
    });
    dy = spec.block.tensors[spec.block.inputs[0]].bytes();
  }
  if (spec.has_stem) phase(nullptr, &t.stem_peak, [&] {
      backward_stage(sim, spec.stem, stem, {false}, {true}, pg, "", -1, threads);
      sim.free(dy);
    });
  sim.free(root);

  m.peak = top;
  m.peak_at = describe_where(sim.peak_at());

  if (out) *out = std::move(t);
  return m;
}

}  // namespace

StepMemory simulate_memory(const ModelConfig& cfg, const ModelSpec& spec, const ResolvedPolicy& policy,
                           int aten_threads) {
  return simulate(cfg, spec, policy, aten_threads, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Time

double CostModel::none_step_ms(int64_t layers) const {
  double block_ms = 0;
  for (const OpTime& t : block) block_ms += t.forward_ms + t.backward_ms;
  return static_cast<double>(layers) * block_ms + other_ms;
}

double CostModel::recompute_ms(const Schedule& schedule) const {
  double ms = 0;
  for (int op : schedule.recomputed) ms += block[op].forward_ms;
  return ms;
}

double CostModel::step_ms(const ModelSpec& spec, const ResolvedPolicy& policy) const {
  double ms = none_step_ms(spec.layers);
  for (const LayerPolicy& lp : policy.layers) ms += recompute_ms(compile_schedule(spec.block, lp));
  return ms;
}

namespace {

// Bytes an op reads and writes: inputs, outputs and parameters forward; the backward reads what
// it keeps and the output gradients, and writes the input and parameter gradients.
std::pair<int64_t, int64_t> bytes_moved(const BlockSpec& b, int op) {
  const OpNode& node = b.ops[op];
  int64_t params = 0;
  for (int p : node.params) params += b.param_bytes(p);
  int64_t in = 0, out = 0, reads = 0;
  for (int t : node.in) in += b.tensors[t].bytes();
  for (int t : node.out) out += b.tensors[t].bytes();
  for (int t : b.bwd_reads(op)) reads += b.tensors[t].bytes();
  return {in + out + params, reads + out + in + 2 * params};
}

double roofline_ms(int64_t flops, int64_t bytes, const MachineRates& r) {
  return std::max(static_cast<double>(flops) / (r.matmul_gflops * 1e6), static_cast<double>(bytes) / (r.memory_gbps * 1e6));
}

}  // namespace

CostModel estimate_costs(const ModelSpec& spec, const MachineRates& rates) {
  if (rates.matmul_gflops <= 0 || rates.memory_gbps <= 0) fail("estimate_costs: rates must be positive");
  CostModel c;
  for (size_t op = 0; op < spec.block.ops.size(); ++op) {
    const OpFlops f = spec.block.flops(static_cast<int>(op));
    const auto [fwd_bytes, bwd_bytes] = bytes_moved(spec.block, static_cast<int>(op));
    c.block.push_back({roofline_ms(f.forward, fwd_bytes, rates), roofline_ms(f.backward, bwd_bytes, rates)});
  }
  auto stage_ms = [&](const BlockSpec& b) {
    double ms = 0;
    for (size_t op = 0; op < b.ops.size(); ++op) {
      const OpFlops f = b.flops(static_cast<int>(op));
      const auto [fwd_bytes, bwd_bytes] = bytes_moved(b, static_cast<int>(op));
      ms += roofline_ms(f.forward, fwd_bytes, rates) + roofline_ms(f.backward, bwd_bytes, rates);
    }
    return ms;
  };
  // Adam reads and writes weights, gradients and two moments: about 7 float passes per parameter.
  int64_t params = spec.block.param_numel() * spec.layers + spec.head.param_numel() +
                   (spec.has_stem ? spec.stem.param_numel() : 0);
  c.other_ms = stage_ms(spec.head) + (spec.has_stem ? stage_ms(spec.stem) : 0.0) +
               static_cast<double>(params) * 28.0 / (rates.memory_gbps * 1e6);
  c.source = fmt::format("estimated: matmul FLOPs at {:.0f} GFLOP/s, bytes at {:.0f} GB/s", rates.matmul_gflops,
                         rates.memory_gbps);
  return c;
}

// ---------------------------------------------------------------------------------------------
// Budgets

Budget parse_budget(std::string_view text) {
  Budget b;
  if (text.empty()) fail("empty budget; write e.g. 300MiB, 2GB, 1.5GiB or 60%");
  size_t i = 0;
  while (i < text.size() && ((text[i] >= '0' && text[i] <= '9') || text[i] == '.')) ++i;
  const std::string number(text.substr(0, i));
  const std::string_view unit = text.substr(i);
  char* end = nullptr;
  const double v = number.empty() ? -1 : std::strtod(number.c_str(), &end);
  if (number.empty() || end != number.c_str() + number.size() || !(v > 0))
    fail("bad budget '{}'; write a positive size such as 300MiB, 2GB, 1.5GiB or 60%", text);
  if (unit == "%") {
    b.percent = v;
    return b;
  }
  static const std::pair<const char*, double> units[] = {
      {"", 1},           {"B", 1},          {"KB", 1e3},          {"MB", 1e6},          {"GB", 1e9},
      {"TB", 1e12},      {"KiB", 1024.0},   {"MiB", 1048576.0},   {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      b.bytes = static_cast<int64_t>(std::llround(v * scale));
      return b;
    }
  fail("bad budget unit '{}' in '{}'; allowed: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, %", unit, text);
}

std::string to_string(const Budget& b) {
  if (b.bytes > 0) return bytes_str(b.bytes);
  return fmt::format("{:g}% of none's activation memory", b.percent);
}

// ---------------------------------------------------------------------------------------------
// The per-block frontier

namespace {

// Tensors the search decides: choosable, not pinned, and not tiny.
std::vector<int> searched_tensors(const BlockSpec& block, const LayerPolicy& pins) {
  int64_t largest = 0;
  for (int t : block.choosable()) largest = std::max(largest, block.tensors[t].bytes());
  std::vector<int> ids;
  for (int t : block.choosable()) {
    if (pins.tensors[t].strength == Strength::Must) continue;
    if (block.tensors[t].bytes() * 64 <= largest) continue;
    ids.push_back(t);
  }
  return ids;
}

std::string option_text(const BlockSpec& block, const std::vector<int>& dropped) {
  if (dropped.empty()) return "none";
  if (dropped.size() == block.choosable().size()) return "full";
  std::string s = "drop:";
  for (size_t i = 0; i < dropped.size(); ++i) s += (i ? "," : "") + block.tensors[dropped[i]].name;
  return s;
}

// The working sets of one block, measured on a lone layer with a stand-in dy.
BlockOption evaluate(const BlockSpec& block, const CostModel& costs, const LayerPolicy& lp) {
  BlockOption o;
  for (int t : block.choosable())
    if (!lp.saves(t)) o.dropped.push_back(t);
  const Schedule s = compile_schedule(block, lp);
  o.saved = s.saved_bytes(block);
  o.recompute_ms = costs.block.empty() ? 0.0 : costs.recompute_ms(s);
  Sim sim;
  forward_stage(sim, block, s, 0);
  o.forward_extra = sim.peak();
  sim.restart_peak();
  const int64_t start = sim.live();
  ParamGrads pg;
  backward_stage(sim, block, s, std::vector<bool>(block.inputs.size(), true),
                 std::vector<bool>(block.inputs.size(), false), pg, "", 0, costs.aten_threads);
  o.backward_extra = sim.peak() - start;
  o.text = option_text(block, o.dropped);
  return o;
}

bool dominates(const BlockOption& a, const BlockOption& b) {
  const bool no_worse = a.saved <= b.saved && a.recompute_ms <= b.recompute_ms &&
                        a.forward_extra <= b.forward_extra && a.backward_extra <= b.backward_extra;
  const bool better = a.saved < b.saved || a.recompute_ms < b.recompute_ms || a.forward_extra < b.forward_extra ||
                      a.backward_extra < b.backward_extra;
  return no_worse && better;
}

LayerPolicy with_drops(const BlockSpec& block, const LayerPolicy& pins, const std::vector<int>& searched,
                       uint32_t mask) {
  LayerPolicy lp = pins;
  for (int t : block.choosable())
    if (pins.tensors[t].strength != Strength::Must) lp.tensors[t] = {Choice::Save, Strength::Prefer};
  for (size_t i = 0; i < searched.size(); ++i)
    if (mask & (1u << i)) lp.tensors[searched[i]] = {Choice::Recompute, Strength::Prefer};
  return lp;
}

void sort_options(std::vector<BlockOption>& v) {
  std::sort(v.begin(), v.end(), [](const BlockOption& a, const BlockOption& b) {
    if (a.saved != b.saved) return a.saved > b.saved;
    if (a.recompute_ms != b.recompute_ms) return a.recompute_ms < b.recompute_ms;
    return a.dropped < b.dropped;
  });
}

}  // namespace

std::vector<BlockOption> block_frontier(const BlockSpec& block, const CostModel& costs, const LayerPolicy& pins) {
  const std::vector<int> searched = searched_tensors(block, pins);
  if (searched.size() > 20) fail("block_frontier: {} tensors to search is too many (at most 20)", searched.size());
  // Many subsets compile to the same schedule (dropping a tensor nobody else needs once its
  // consumer is recomputed anyway): evaluate each distinct (saved set, recompute set) once.
  std::map<std::pair<std::vector<bool>, std::vector<int>>, BlockOption> distinct;
  for (uint32_t mask = 0; mask < (1u << searched.size()); ++mask) {
    const LayerPolicy lp = with_drops(block, pins, searched, mask);
    const Schedule s = compile_schedule(block, lp);
    auto key = std::make_pair(s.saved, s.recomputed);
    if (distinct.count(key)) continue;
    distinct.emplace(std::move(key), evaluate(block, costs, lp));
  }
  std::vector<BlockOption> all;
  for (auto& [key, o] : distinct) all.push_back(std::move(o));
  // Sweep by saved bytes: an option can only be beaten by one that saves no more.
  sort_options(all);
  std::vector<BlockOption> front;
  for (size_t i = all.size(); i-- > 0;) {
    bool beaten = false;
    for (const BlockOption& f : front)
      if (dominates(f, all[i]) || (f.saved == all[i].saved && f.recompute_ms == all[i].recompute_ms &&
                                   f.forward_extra == all[i].forward_extra && f.backward_extra == all[i].backward_extra)) {
        beaten = true;
        break;
      }
    if (beaten) continue;
    // Later (larger-saved) options cannot beat it on saved bytes, but equal-saved ones can: drop
    // those already kept that it beats.
    front.erase(std::remove_if(front.begin(), front.end(), [&](const BlockOption& f) { return dominates(all[i], f); }),
                front.end());
    front.push_back(all[i]);
  }
  sort_options(front);
  return front;
}

std::vector<BlockOption> block_frontier_brute_force(const BlockSpec& block, const CostModel& costs,
                                                    const LayerPolicy& pins) {
  const std::vector<int> searched = searched_tensors(block, pins);
  std::vector<BlockOption> all;
  for (uint32_t mask = 0; mask < (1u << searched.size()); ++mask)
    all.push_back(evaluate(block, costs, with_drops(block, pins, searched, mask)));
  std::vector<BlockOption> front;
  for (size_t i = 0; i < all.size(); ++i) {
    bool beaten = false;
    for (size_t j = 0; j < all.size() && !beaten; ++j) beaten = dominates(all[j], all[i]);
    // Keep one of each set of equal points: the first in sorted order.
    bool duplicate = false;
    for (const BlockOption& f : front)
      duplicate = duplicate || (f.saved == all[i].saved && f.recompute_ms == all[i].recompute_ms &&
                                f.forward_extra == all[i].forward_extra && f.backward_extra == all[i].backward_extra);
    if (!beaten && !duplicate) front.push_back(all[i]);
  }
  sort_options(front);
  return front;
}

// ---------------------------------------------------------------------------------------------
// The search

namespace {

std::string plan_text(const BlockSpec& block, const std::vector<const BlockOption*>& choice) {
  const int64_t n = static_cast<int64_t>(choice.size());
  bool uniform = true;
  for (int64_t l = 1; l < n; ++l) uniform = uniform && choice[l]->text == choice[0]->text;
  if (uniform) return choice[0]->text;
  std::string s = "layers:";
  for (int64_t first = 0; first < n;) {
    int64_t last = first;
    while (last + 1 < n && choice[last + 1]->text == choice[first]->text) ++last;
    s += fmt::format("{}{}={}", first ? "," : "", first == last ? std::to_string(first) : fmt::format("{}-{}", first, last),
                     choice[first]->text);
    first = last + 1;
  }
  return s;
}

ResolvedPolicy policy_of(const BlockSpec& block, const LayerPolicy& pins, const std::vector<const BlockOption*>& choice) {
  ResolvedPolicy r;
  for (const BlockOption* o : choice) {
    LayerPolicy lp = pins;
    for (int t : block.choosable())
      if (pins.tensors[t].strength != Strength::Must) lp.tensors[t] = {Choice::Save, Strength::Prefer};
    for (int t : o->dropped)
      if (pins.tensors[t].strength != Strength::Must) lp.tensors[t] = {Choice::Recompute, Strength::Prefer};
    r.layers.push_back(lp);
  }
  return r;
}

// Multiple-choice knapsack over layers (NOTE [The planner], rule 3). State: bytes saved by the
// layers so far, in buckets of `q` rounded up. Returns the per-layer choice, or empty if none fits.
std::vector<const BlockOption*> knapsack(const std::vector<BlockOption>& options, int64_t layers,
                                         const std::vector<int64_t>& fwd_const, const std::vector<int64_t>& bwd_const,
                                         int64_t rest_const, int64_t limit, int64_t buckets) {
  if (limit <= 0) return {};
  const int64_t q = std::max<int64_t>(1, (limit + buckets - 1) / buckets);
  const int64_t states = limit / q + 1;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> cost(states, inf), next(states);
  std::vector<std::vector<int16_t>> pick(layers, std::vector<int16_t>(states, -1));
  std::vector<std::vector<int32_t>> from(layers, std::vector<int32_t>(states, -1));
  cost[0] = 0;
  for (int64_t l = 0; l < layers; ++l) {
    std::fill(next.begin(), next.end(), inf);
    for (int64_t k = 0; k < states; ++k) {
      if (cost[k] == inf) continue;
      const int64_t before = k * q;
      for (size_t c = 0; c < options.size(); ++c) {
        const BlockOption& o = options[c];
        const int64_t after = before + (o.saved + q - 1) / q * q;
        if (after > limit) continue;
        if (before + fwd_const[l] + o.forward_extra > limit) continue;
        if (after + bwd_const[l] + o.backward_extra > limit) continue;
        const int64_t k2 = after / q;
        const double t = cost[k] + o.recompute_ms;
        if (t < next[k2]) {
          next[k2] = t;
          pick[l][k2] = static_cast<int16_t>(c);
          from[l][k2] = static_cast<int32_t>(k);
        }
      }
    }
    cost.swap(next);
  }
  int64_t best = -1;
  for (int64_t k = 0; k < states; ++k)
    if (cost[k] < inf && k * q + rest_const <= limit && (best < 0 || cost[k] < cost[best])) best = k;
  if (best < 0) return {};
  std::vector<const BlockOption*> choice(layers);
  for (int64_t l = layers - 1, k = best; l >= 0; --l) {
    choice[l] = &options[pick[l][k]];
    k = from[l][k];
  }
  return choice;
}

}  // namespace

Planner::Planner(const ModelConfig& cfg, const CostModel& costs, const LayerPolicy& pins)
    : cfg_(cfg), spec_(make_model(cfg)), costs_(costs), pins_(pins) {
  if (costs_.block.size() != spec_.block.ops.size())
    fail("the cost model has {} block ops; the {} block has {}", costs_.block.size(), spec_.block.kind,
         spec_.block.ops.size());
  frontier_ = block_frontier(spec_.block, costs_, pins_);
  // The reference for percentages and for the "none" column: nothing dropped, pins or not.
  LayerPolicy none_lp = pins_;
  for (int t : spec_.block.choosable()) none_lp.tensors[t] = {Choice::Save, Strength::Prefer};
  none_memory_ = simulate(cfg_, spec_, ResolvedPolicy{std::vector<LayerPolicy>(spec_.layers, none_lp), 0},
                          costs_.aten_threads, nullptr);
  // Constants of the constraints: the level at each block's start minus what the blocks' choices
  // put there, read from a reference run (the frontier's first option everywhere). They do not
  // depend on the choices: other stages, gradients of later layers, block inputs, dy.
  const BlockOption& ref = frontier_.front();
  Trace t;
  simulate(cfg_, spec_, policy_of(spec_.block, pins_, std::vector<const BlockOption*>(spec_.layers, &ref)),
           costs_.aten_threads, &t);
  for (int64_t l = 0; l < spec_.layers; ++l) {
    fwd_const_.push_back(t.fwd_start[l] - l * ref.saved);
    bwd_const_.push_back(t.bwd_start[l] - (l + 1) * ref.saved);
  }
  head_const_ = t.head_peak - spec_.layers * ref.saved;
  stem_peak_ = t.stem_peak;
}

int64_t Planner::bytes_of(const Budget& budget) const {
  if (budget.bytes > 0) return budget.bytes;
  return none_memory_.base() +
         static_cast<int64_t>(static_cast<double>(none_memory_.peak) * budget.percent / 100.0);
}

std::vector<const BlockOption*> Planner::solve(int64_t total, int64_t buckets) const {
  const int64_t limit = total - none_memory_.base();
  if (stem_peak_ > limit) return {};  // the embedding alone does not fit
  return knapsack(frontier_, spec_.layers, fwd_const_, bwd_const_, head_const_, limit, buckets);
}

StepMemory Planner::memory_of(const std::vector<const BlockOption*>& choice) const {
  return simulate(cfg_, spec_, policy_of(spec_.block, pins_, choice), costs_.aten_threads, nullptr);
}

// The knapsack rounds bytes up, so its answer can leave a little of the budget unused. Move layers
// to faster options while the exact simulation still fits, largest saving first.
std::vector<const BlockOption*> Planner::improve(std::vector<const BlockOption*> choice, int64_t total) const {
  int evaluations = 0;
  for (bool moved = true; moved && evaluations < 400;) {
    moved = false;
    std::vector<std::pair<double, std::pair<int64_t, const BlockOption*>>> moves;
    for (int64_t l = 0; l < spec_.layers; ++l)
      for (const BlockOption& o : frontier_)
        if (o.recompute_ms < choice[l]->recompute_ms) moves.push_back({choice[l]->recompute_ms - o.recompute_ms, {l, &o}});
    std::sort(moves.begin(), moves.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [gain, move] : moves) {
      if (++evaluations > 400) break;
      std::vector<const BlockOption*> next = choice;
      next[move.first] = move.second;
      if (memory_of(next).total_peak() <= total) {
        choice = std::move(next);
        moved = true;
        break;
      }
    }
  }
  return choice;
}

Plan Planner::plan(const Budget& budget) const {
  Plan p;
  p.frontier = frontier_;
  p.none_memory = none_memory_;
  p.none_step_ms = costs_.none_step_ms(spec_.layers);
  p.budget = bytes_of(budget);
  std::vector<const BlockOption*> choice = solve(p.budget, 4096);
  if (choice.empty()) {
    // Rounding can miss a budget right at the minimum: try the least-memory plan exactly.
    std::vector<const BlockOption*> least = least_memory();
    if (!least.empty() && memory_of(least).total_peak() <= p.budget) choice = std::move(least);
  }
  if (!choice.empty()) {
    choice = improve(std::move(choice), p.budget);
    p.fits = true;
    p.policy = policy_of(spec_.block, pins_, choice);
    p.policy_text = plan_text(spec_.block, choice);
    p.memory = memory_of(choice);
    p.step_ms = costs_.step_ms(spec_, p.policy);
    if (p.memory.total_peak() > p.budget)  // the knapsack rounds up and improve() checks exactly
      fail_runtime("internal: plan peaks at {} over the budget {}", p.memory.total_peak(), p.budget);
    return p;
  }
  // Refused: name the smallest budget any plan meets.
  p.memory = memory_of(least_memory());
  p.min_budget = p.memory.total_peak();
  return p;
}

// The plan with the smallest total peak the knapsack finds: bisection on the budget.
std::vector<const BlockOption*> Planner::least_memory() const {
  int64_t lo = none_memory_.base(), hi = none_memory_.total_peak();
  while (solve(hi, 1024).empty()) hi *= 2;
  for (int it = 0; it < 40 && hi - lo > std::max<int64_t>(1, hi / 2000); ++it) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (solve(mid, 1024).empty()) lo = mid;
    else hi = mid;
  }
  return solve(hi, 1024);
}

Plan make_plan(const ModelConfig& cfg, const Budget& budget, const CostModel& costs, const LayerPolicy& pins) {
  return Planner(cfg, costs, pins).plan(budget);
}

ResolvedPolicy resolve_policy(const ModelConfig& cfg, const Policy& policy, const CostModel& costs, Plan* out) {
  const ModelSpec spec = make_model(cfg);
  if (policy.budget().empty()) return policy.resolve(spec.block, cfg.layers);
  const Budget budget = parse_budget(policy.budget());
  Plan plan = make_plan(cfg, budget, costs, policy.pins(spec.block));
  if (!plan.fits)
    fail("budget {} ({}) cannot be met: the smallest peak any policy reaches is {} (weights {}, optimizer {}, "
         "data {}, activations and gradients {})",
         policy.budget(), bytes_str(plan.budget), bytes_str(plan.min_budget), bytes_str(plan.memory.params),
         bytes_str(plan.memory.optimizer), bytes_str(plan.memory.data), bytes_str(plan.memory.peak));
  if (out) *out = plan;
  return plan.policy;
}

}  // namespace remat
