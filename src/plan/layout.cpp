// Parallel layouts (NOTE [Parallel layouts]): one rank's model from the tensor table at its shapes,
// its pipeline stage's step replayed by the memory model, and the step time from the device's rates.
#include "remat/layout.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>

#include "core/shard.h"
#include "remat/error.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/runtime.h"
#include "remat/schedule.h"

namespace remat {

std::vector<LayerRange> stage_layers(int64_t layers, const Layout& l, int64_t stage) {
  if (l.pp < 1 || l.vpp < 1 || stage < 0 || stage >= l.pp)
    fail("stage_layers: stage {} of a layout with pp {} and vpp {}; pp and vpp must be >= 1, stage in 0..pp-1", stage,
         l.pp, l.vpp);
  std::vector<LayerRange> c;
  if (l.uneven()) {  // vpp 1: the first and last stages as given, the middle ones even
    const int64_t middle = l.pp > 2 ? (layers - l.first_layers - l.last_layers) / (l.pp - 2) : 0;
    const int64_t first = stage == 0 ? 0 : l.first_layers + (stage - 1) * middle;
    const int64_t n = stage == 0 ? l.first_layers : stage == l.pp - 1 ? l.last_layers : middle;
    c.push_back({first, first + n});
    return c;
  }
  const int64_t per = layers / (l.pp * l.vpp);
  for (int64_t k = 0; k < l.vpp; ++k) c.push_back({(k * l.pp + stage) * per, (k * l.pp + stage + 1) * per});
  return c;
}

ModelConfig rank_config(const ModelConfig& cfg, const Layout& l) {
  ModelConfig c = cfg;
  c.tp = l.tp, c.sp = l.sp, c.cp = l.cp, c.ep = l.ep, c.etp = l.etp, c.batch = l.micro_batch;
  return c;
}

std::string to_string(const Layout& l, bool experts) {
  std::string s = fmt::format("tp {}{}", l.tp, l.sp ? " + sp" : "");
  if (l.cp > 1) s += fmt::format(", cp {}", l.cp);
  s += fmt::format(", pp {}", l.pp);
  if (l.vpp > 1) s += fmt::format(" x {} chunks", l.vpp);
  if (l.uneven()) s += fmt::format(" ({} | ... | {} layers)", l.first_layers, l.last_layers);
  s += fmt::format(", dp {}", l.dp);
  if (experts && l.ep > 1) s += fmt::format(", ep {}", l.ep);
  if (experts && l.etp != l.tp) s += fmt::format(", etp {}", l.etp);
  if (l.zero > 0) s += fmt::format(", zero {}", l.zero);
  if (l.optimizer_instances > 1) s += fmt::format(" in {} instances", l.optimizer_instances);
  if (l.fsdp) s += ", fsdp";
  s += fmt::format(", micro-batch {} x {}", l.micro_batch, l.micro_batches());
  return s;
}

namespace {

// How the pipeline splits the layers: evenly into pp x vpp chunks, or with the first and last
// stages' layers given (an uneven pipeline, without interleaving).
void validate_stages(const Layout& l, const ModelConfig& cfg) {
  if (l.uneven()) {
    if (l.first_layers < 1 || l.last_layers < 1 || l.pp < 2)
      fail(
          "Layout.first_layers {} and Layout.last_layers {} split a pipeline (Layout.pp {} >= 2): give both, each at "
          "least 1",
          l.first_layers, l.last_layers, l.pp);
    if (l.vpp > 1)
      fail("Layout.first_layers and Layout.last_layers split a pipeline without interleaving; Layout.vpp is {}", l.vpp);
    const int64_t rest = cfg.layers - l.first_layers - l.last_layers;
    if (rest < (l.pp - 2) || (l.pp == 2 ? rest != 0 : rest % (l.pp - 2) != 0))
      fail(
          "Layout.first_layers {} + Layout.last_layers {} leave {} of the {} layers for the {} middle stages, which "
          "must share them evenly",
          l.first_layers, l.last_layers, rest, cfg.layers, l.pp - 2);
  } else if (cfg.layers % (l.pp * l.vpp) != 0) {
    fail(
        "Layout.pp {} x vpp {} must divide the layers ({}): every chunk holds as many, or give the first and last "
        "stages' layers (an uneven pipeline)",
        l.pp, l.vpp, cfg.layers);
  }
  if (l.vpp > 1 && l.pp == 1) fail("Layout.vpp {} interleaves pipeline stages; it needs pp > 1", l.vpp);
}

// What remat's own engine and trainer run (device cpu).
void validate_on_engine(const Layout& l, const ModelConfig& cfg) {
  if (l.tp > 1 || l.pp > 1 || l.cp > 1 || l.ep > 1 || l.etp > 1)
    fail(
        "device cpu is remat's own engine, which trains tp 1, cp 1, pp 1, ep 1, etp 1 (data parallel on c10d); plan "
        "tp {} cp {} pp {} ep {} etp {} for a GPU --device",
        l.tp, l.cp, l.pp, l.ep, l.etp);
  if (l.zero > 1) fail("device cpu: remat train shards optimizer state (zero 1); zero {} is planned for GPUs", l.zero);
  if (l.optimizer_instances > 1)
    fail(
        "device cpu: remat train shards optimizer state over all its ranks; optimizer instances {} are planned for "
        "GPUs (Megatron-LM)",
        l.optimizer_instances);
  if (cfg.dtype != DType::F32) fail("device cpu: the engine trains fp32, got {}", to_string(cfg.dtype));
}

}  // namespace

void validate(const Layout& l, const ModelConfig& cfg, const Device& device) {
  auto positive = [](const char* name, int64_t v) {
    if (v < 1) fail("Layout.{} must be a positive integer, got {}", name, v);
  };
  positive("tp", l.tp);
  positive("cp", l.cp);
  positive("pp", l.pp);
  positive("vpp", l.vpp);
  positive("dp", l.dp);
  positive("ep", l.ep);
  positive("etp", l.etp);
  positive("micro_batch", l.micro_batch);
  if (l.global_batch < 0 || l.global_batch > kMaxGlobalBatch)
    fail("Layout.global_batch must be in 0..{} (0 = micro_batch * dp), got {}", kMaxGlobalBatch, l.global_batch);
  if (l.zero < 0 || l.zero > 3) fail("Layout.zero must be 0, 1, 2 or 3, got {}", l.zero);
  positive("optimizer_instances", l.optimizer_instances);
  if (l.optimizer_instances > 1 && l.zero != 1)
    fail(
        "Layout.optimizer_instances {} are instances of the distributed optimizer (ZeRO-1); Layout.zero must be 1, "
        "got {}",
        l.optimizer_instances, l.zero);
  if (l.shards() % l.optimizer_instances != 0)
    fail("Layout.optimizer_instances {} must divide the data- x context-parallel ranks (dp {} x cp {})",
         l.optimizer_instances, l.dp, l.cp);
  if (l.grad_bytes != 2 && l.grad_bytes != 4)
    fail("Layout.grad_bytes must be 4 (fp32 gradient buffers) or 2 (fp16/bf16), got {}", l.grad_bytes);
  if (cfg.dtype == DType::F32 && l.grad_bytes != 4)
    fail("Layout.grad_bytes {} is for mixed precision; fp32 training keeps fp32 gradients (4)", l.grad_bytes);
  if (l.tp > device.gpus_per_node)
    fail("Layout.tp {} spans nodes: device '{}' has {} per node, and tensor parallelism stays inside one", l.tp,
         device.name, device.gpus_per_node);
  if (cfg.heads % l.tp != 0 || cfg.kv() % l.tp != 0)
    fail("Layout.tp {} must divide the attention heads ({}) and key/value heads ({})", l.tp, cfg.heads, cfg.kv());
  if (cfg.hidden() % l.tp != 0) fail("Layout.tp {} must divide the MLP width ({})", l.tp, cfg.hidden());
  if (l.sp && l.tp == 1) fail("Layout.sp (sequence parallelism) needs tp > 1");
  if (l.sp && cfg.seq % (l.tp * l.cp) != 0)
    fail("Layout.sp: the sequence ({}) must divide by tp {} x cp {}", cfg.seq, l.tp, l.cp);
  if (l.cp > 1 && cfg.seq % l.cp != 0) fail("Layout.cp {} must divide the sequence ({})", l.cp, cfg.seq);
  if (l.cp > 1 && cfg.attention != AttentionImpl::Flash)
    fail("Layout.cp {} runs attention in a ring, which needs flash attention (--attention flash)", l.cp);
  validate_stages(l, cfg);
  if (l.batch() % (l.micro_batch * l.dp) != 0)
    fail("Layout.global_batch {} does not split into micro-batches of {} over dp {}: make it a multiple of {}",
         l.batch(), l.micro_batch, l.dp, l.micro_batch * l.dp);
  if (l.vpp > 1 && l.micro_batches() % l.pp != 0)
    fail("Layout.vpp {}: interleaved 1F1B needs the micro-batches per step ({}) to be a multiple of pp {}", l.vpp,
         l.micro_batches(), l.pp);
  if (l.fsdp && l.zero != 0)
    fail("Layout.fsdp shards the weights, gradients and optimizer state itself; Layout.zero must be 0, got {}", l.zero);
  // torchtitan's pipeline stages keep weights and gradients unsharded until the last micro-batch's
  // backward (set_reshard_after_backward, set_requires_gradient_sync); Megatron-LM's FSDP2 does not
  // run with pipelines. Neither is replayed.
  if (l.fsdp && l.pp > 1)
    fail("Layout.fsdp with pp {}: FSDP2 under pipeline stages is not modelled; give pp 1, or plan without FSDP", l.pp);
  if (l.zero >= 2 && l.pp > 1)
    fail(
        "Layout.zero {} with pp {}: ZeRO-2 and -3 shard gradients that pipeline micro-batches still accumulate; use "
        "zero 0 or 1 with pipelines",
        l.zero, l.pp);
  // (An etp that does not divide tp is the block kind's refusal, below.)
  if (l.tp % l.etp == 0 && !l.expert_grid_divides())
    fail(
        "Layout.ep {} must divide the data- x context- x tensor-parallel ranks over etp ({} x {} x {} / {}): experts "
        "are split over them",
        l.ep, l.dp, l.cp, l.tp, l.etp);
  if (routes_experts(cfg.arch) && l.expert_grid_divides() && l.expert_shards() % l.optimizer_instances != 0)
    fail(
        "Layout.optimizer_instances {} must divide the expert-data-parallel ranks ({}), which shard the experts' "
        "optimizer state",
        l.optimizer_instances, l.expert_shards());
  if (routes_experts(cfg.arch) && l.fsdp && l.etp != l.tp)
    fail("Layout.etp {} with FSDP is not modelled: FSDP shards over the data-parallel ranks; give etp = tp ({})", l.etp,
         l.tp);
  if (l.ep > 1 && l.fsdp)
    fail("Layout.ep {} with FSDP is not modelled; plan experts with zero 0-1 (Megatron-LM)", l.ep);
  remat::validate(rank_config(cfg, l));  // what the block kind supports at this split
  if (device.engine) validate_on_engine(l, cfg);
}

namespace {

// One rank's model at a layout's tensor-parallel split and micro-batch, with its op times.
struct Shapes {
  ModelConfig cfg;
  std::shared_ptr<const ModelSpec> spec;
  MachineRates rates;
  CostModel costs;  // the block's ops (estimate_op)
  double stem_fwd = 0, stem_bwd = 0, head_fwd = 0, head_bwd = 0;
  double block_comm = 0;              // communication of one block, forward + backward (op_comm_ms)
  std::vector<double> comm_fwd;       // per block op: its forward's collectives (a recompute repeats them)
  std::vector<BlockOption> frontier;  // for "auto", computed on first use
  ScheduleCache cache;
  std::map<std::string, ResolvedPolicy> resolved;  // by policy string
};

MachineRates rates_of(const Device& d, DType dtype) {
  MachineRates r;
  r.matmul_gflops = d.matmul_gflops(dtype);
  r.memory_gbps = d.hbm_gbps * d.memory_efficiency;
  r.link_gbps = d.intra_gbps * d.link_efficiency;
  return r;
}

std::unique_ptr<Shapes> make_shapes(const ModelConfig& cfg, const Layout& l, const Device& device) {
  auto s = std::make_unique<Shapes>();
  s->cfg = rank_config(cfg, l);
  s->spec = std::make_shared<const ModelSpec>(make_model(s->cfg));
  s->rates = rates_of(device, cfg.dtype);
  if (!(s->rates.link_gbps > 0)) s->rates.link_gbps = s->rates.memory_gbps;  // tp 1: no collectives to time
  const BlockSpec& b = s->spec->block;
  // An expert-parallel group's ranks are etp apart (Megatron-LM's expert grid, in the order etp,
  // ep, edp, pp): its all-to-alls cross nodes once etp x ep passes a node.
  const double ep_gbps =
      (l.etp * l.ep > device.gpus_per_node ? device.inter_gbps : device.intra_gbps) * device.link_efficiency;
  s->rates.expert_gbps = ep_gbps;
  // A context-parallel ring's ranks are tp apart (the grid's order tp, cp, dp, pp): it crosses
  // nodes once tp x cp passes a node.
  s->rates.ring_gbps =
      (l.tp * l.cp > device.gpus_per_node ? device.inter_gbps : device.intra_gbps) * device.link_efficiency;
  for (size_t op = 0; op < b.ops.size(); ++op) {
    s->costs.block.push_back(estimate_op(b, static_cast<int>(op), s->rates));
    const OpTime c = op_comm_ms(b, static_cast<int>(op), s->rates);
    s->comm_fwd.push_back(c.forward_ms);
    s->block_comm += c.forward_ms + c.backward_ms;
  }
  auto stage = [&](const BlockSpec& st, double& fwd, double& bwd) {
    for (size_t op = 0; op < st.ops.size(); ++op) {
      const OpTime t = estimate_op(st, static_cast<int>(op), s->rates);
      fwd += t.forward_ms;
      bwd += t.backward_ms;
    }
  };
  if (s->spec->has_stem) stage(s->spec->stem, s->stem_fwd, s->stem_bwd);
  stage(s->spec->head, s->head_fwd, s->head_bwd);
  s->costs.source = "estimated from the device's rates";
  return s;
}

// The data-parallel rank whose ZeRO share of `numel` elements is the largest.
int largest_shard(int64_t numel, int64_t world) {
  int best = 0;
  int64_t size = -1;
  for (int64_t r = 0; r < world; ++r) {
    const int64_t n = shard_first(numel, static_cast<int>(r + 1), static_cast<int>(world)) -
                      shard_first(numel, static_cast<int>(r), static_cast<int>(world));
    if (n > size) size = n, best = static_cast<int>(r);
  }
  return best;
}

// A policy over the layers of `chunks`, as a policy string: "attn", or "layers:0-5=attn,6-11=none".
std::string rank_policy_text(const std::vector<LayerRange>& chunks, const std::vector<std::string>& text) {
  std::vector<std::pair<int64_t, std::string>> layers;
  for (const LayerRange& c : chunks)
    for (int64_t l = c.first; l < c.end; ++l) layers.push_back({l, text[l]});
  return layers_policy_text(layers);
}

// The model as the framework runs it: torchtitan's ops are eager PyTorch's, unfused.
ModelConfig framework_config(ModelConfig cfg, const Device& device, const PlanOptions& options) {
  if (options.framework == Framework::Torchtitan && !device.engine && routes_experts(cfg.arch))
    fail(
        "PlanOptions.framework torchtitan is torchtitan at 9dec370 (December 2024), which has no mixture of "
        "experts; plan ModelConfig.arch {} with PlanOptions.framework megatron",
        cfg.arch);
  cfg.eager_ops = options.framework == Framework::Torchtitan && !device.engine;
  cfg.deterministic = options.framework == Framework::Megatron && options.deterministic && !device.engine;
  cfg.allgather_dispatch = allgather_dispatch(options, device);
  return cfg;
}

class Evaluator {
 public:
  Evaluator(const ModelConfig& cfg, const Device& device, const PlanOptions& options)
      : cfg_(framework_config(cfg, device, options)),
        device_(device),
        options_(options),
        params_(make_model(cfg).param_numel()) {}

  Shapes& shapes(const Layout& l) {
    const auto key = std::make_tuple(l.tp, l.cp, l.ep, l.etp, l.sp, l.micro_batch);
    auto it = shapes_.find(key);
    if (it == shapes_.end()) it = shapes_.emplace(key, make_shapes(cfg_, l, device_)).first;
    return *it->second;
  }

  // `policy` resolved for the shapes' block, once per (shapes, policy).
  const ResolvedPolicy& resolve(Shapes& sh, const std::string& policy) {
    auto it = sh.resolved.find(policy);
    if (it != sh.resolved.end()) return it->second;
    return sh.resolved.emplace(policy, resolve_layout_policy(policy, sh.spec->block, cfg_.layers)).first->second;
  }

  // Bytes a stage of `l` may peak at, and the share of its peak kept free.
  int64_t budget(const Layout& l) const {
    if (options_.budget > 0) return options_.budget;
    int64_t reserve = options_.reserve;
    if (reserve < 0) {
      reserve = device_.engine ? kCpuReserve : 0;
      for (const Allocation& a : outside_allocator(options_, device_, cfg_, l)) reserve += a.bytes;
    }
    return std::max<int64_t>(0, device_.memory - reserve);
  }
  double margin() const {
    if (options_.margin >= 0) return options_.margin;
    if (device_.engine) return 0.0;
    return kAllocatedUncertainty;
  }
  bool within(int64_t peak, int64_t budget) const {
    return static_cast<double>(peak) * (1 + margin()) <= static_cast<double>(budget);
  }

  // Stage `stage`'s part of the step under per-layer policies `layers` (all of the model's layers).
  // On a GPU a checkpointed layer reruns its forward when its backward starts (torch.utils.checkpoint,
  // Megatron-LM): the eager order (LayerPolicy::eager).
  CompiledStep compile(Shapes& sh, const Layout& l, int stage, const ResolvedPolicy& layers) {
    if (device_.engine) return compile_step(sh.spec, layers, stage_layers(cfg_.layers, l, stage), &sh.cache);
    ResolvedPolicy eager = layers;
    for (LayerPolicy& lp : eager.layers) lp.eager = true;
    return compile_step(sh.spec, eager, stage_layers(cfg_.layers, l, stage), &sh.cache);
  }

  // Memoized by everything the replay reads: the layout, the stage, the segments and its layers'
  // choices, a held tensor apart from a kept one (the search and each stage's policy search ask for
  // the same replay many times).
  StepMemory memory(Shapes& sh, const Layout& l, int stage, const ResolvedPolicy& layers) {
    std::string key = fmt::format("{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{}|", l.tp, l.sp, l.cp, l.micro_batch,
                                  l.pp, l.vpp, l.dp, l.zero, l.optimizer_instances, l.fsdp, l.global_batch,
                                  l.grad_bytes, stage, l.ep, l.etp, layers.segment);
    for (const LayerRange& c : stage_layers(cfg_.layers, l, stage))
      for (int64_t x = c.first; x < c.end; ++x) layers.layers[x].append_key(key);
    auto it = memo_.find(key);
    if (it != memo_.end()) return it->second;
    StepMemory m = memory(l, stage, compile(sh, l, stage, layers));
    memo_.emplace(std::move(key), m);
    return m;
  }

  StepMemory memory(const Layout& l, int stage, const CompiledStep& plan, bool cuda = false) {
    int64_t numel = 0;
    for (const ModelParam& p : plan.params) numel += p.spec->numel();
    const int m = static_cast<int>(l.micro_batches());
    StepShape shape;
    if (device_.engine) {
      shape = trainer_step_shape(m, static_cast<int>(l.dp), largest_shard(numel, l.dp), l.zero);
    } else {
      shape.micro = m;
      shape.scaled_loss = m * l.shards() > 1;
      // The ranks the weights, gradients or optimizer state are sharded over: FSDP's and ZeRO's
      // (an instance of Megatron-LM's distributed optimizer), and the experts' within them.
      shape.world = static_cast<int>(l.optimizer_shards());
      shape.rank = largest_shard(numel, l.optimizer_shards());
      shape.expert_world = static_cast<int>(l.expert_optimizer_shards());
      // Under FSDP2 each weight gradient is a tensor autograd makes and FSDP reduce-scatters: no
      // GEMM fills a main-gradient buffer.
      shape.fused_wgrad = options_.framework == Framework::Megatron && options_.fused_wgrad && !l.fsdp;
      shape.fsdp = l.fsdp;
      shape.fsdp_root_reshard = options_.fsdp_root_reshard;
      shape.fsdp_keep_last = options_.framework == Framework::Torchtitan;  // its apply_fsdp
      shape.foreach_adam = options_.framework == Framework::Torchtitan;    // torch.optim.AdamW, foreach
      shape.pure_dtype = options_.pure_dtype;
      shape.zero = l.zero;
      shape.grad_buffers = true;
      shape.grad_bytes = l.grad_bytes;
      shape.stages = static_cast<int>(l.pp);
      shape.stage = stage;
      shape.chunks = static_cast<int>(l.vpp);
    }
    const std::vector<Allocation> fixed = fixed_allocations(options_, device_, cfg_, l, stage);
    shape.batch_in_fixed = !device_.engine;  // fixed_allocations' "micro-batch"
    if (cuda && !device_.engine) {
      shape.cuda = true;
      shape.expandable_segments = options_.expandable_segments;
      for (const Allocation& a : fixed) shape.fixed_blocks.push_back(a.bytes);
    }
    ++evaluated_;
    StepMemory mem = simulate_memory(plan, threads(l), nullptr, shape);
    for (const Allocation& a : fixed) mem.fixed += a.bytes;
    return mem;
  }

  // Threads whose scratch the memory model counts: the trainer's split of this machine's cores
  // for the engine; one per device otherwise.
  ThreadConfig threads(const Layout& l) const {
    if (!device_.engine) return {1, 1};
    return l.dp > 1 ? data_parallel_threads(static_cast<int>(l.dp)) : default_threads();
  }

  // Time of one micro-batch of a stage's layers under `layers` (all chunks), its backward share
  // and its collectives. Reads the compiled schedules' recomputed ops; builds no step.
  void time(Shapes& sh, const Layout& l, const ResolvedPolicy& layers, RankPlan& r, double& recompute_ms,
            double& comm_ms) {
    const ModelSpec& m = *sh.spec;
    recompute_ms = comm_ms = 0;
    r.micro_ms = r.backward_ms = r.p2p_ms = 0;
    double block_fwd = 0, block_bwd = 0;
    for (const OpTime& t : sh.costs.block) block_fwd += t.forward_ms, block_bwd += t.backward_ms;
    const int64_t act = m.block.tensors[m.block.inputs[0]].bytes();
    const double p2p_rate = p2p_gbps(l) * 1e6;
    std::vector<bool> need;  // a block's inputs all need their gradient (the stem is before it)
    for (int in : m.block.inputs) need.push_back(is_float(m.block.tensors[in].dtype));
    const LayerPolicy* last = nullptr;  // the previous layer's choices, and their times below
    double rec = 0, rec_comm = 0;
    for (const LayerRange& c : r.chunks) {
      if (c.first == 0 && m.has_stem) r.micro_ms += sh.stem_fwd + sh.stem_bwd, r.backward_ms += sh.stem_bwd;
      if (c.end == m.layers) r.micro_ms += sh.head_fwd + sh.head_bwd, r.backward_ms += sh.head_bwd;
      for (int64_t x = c.first; x < c.end; ++x) {
        const LayerPolicy& lp = layers.layers[x];
        if (last == nullptr || !last->same_choices(lp)) {
          rec = rec_comm = 0;
          for (int op : sh.cache.get(m.block, lp, need)->recomputed)
            rec += sh.costs.block[op].forward_ms, rec_comm += sh.comm_fwd[op];
          if (layers.segment > 0)  // uniform:N reruns the whole forward of every layer (NOTE [Segments])
            for (size_t op = 0; op < sh.costs.block.size(); ++op)
              rec += sh.costs.block[op].forward_ms, rec_comm += sh.comm_fwd[op];
        }
        last = &lp;
        recompute_ms += rec;
        comm_ms += rec_comm + sh.block_comm;
        r.micro_ms += block_fwd + block_bwd + rec;
        r.backward_ms += block_bwd + rec;
      }
    }
    for (const LayerRange& c : r.chunks) {
      // Pipeline sends: the activation forward, its gradient back, at each end that is not the model's.
      const int transfers = (c.first > 0 ? 1 : 0) + (c.end < m.layers ? 1 : 0);
      if (l.pp > 1) r.p2p_ms += transfers * static_cast<double>(act) / p2p_rate;
    }
  }

  double p2p_gbps(const Layout& l) const {
    // Pipeline neighbours are tp * dp ranks apart: in another node once that fills one.
    return (l.tp * l.cp * l.dp >= device_.gpus_per_node ? device_.inter_gbps : device_.intra_gbps) *
           device_.link_efficiency;
  }
  double dp_gbps(const Layout& l) const {
    return (l.tp * l.cp * l.dp > device_.gpus_per_node ? device_.inter_gbps : device_.intra_gbps) *
           device_.link_efficiency;
  }
  // An optimizer instance's ranks are a consecutive tp cp dp / N of them (Megatron-LM's rank order,
  // parallel_state.py): its ring runs within a node while they fit in one (dp_gbps with N = 1).
  double instance_gbps(const Layout& l) const {
    return (l.tp * l.cp * l.dp / l.optimizer_instances > device_.gpus_per_node ? device_.inter_gbps
                                                                               : device_.intra_gbps) *
           device_.link_efficiency;
  }

  // The block's frontier for `sh`, cheapest recompute first. Its choice sets are those of the first
  // micro-batch size planned at this split (sizes scale with the micro-batch; computing it is the
  // search's dearest step), priced and ordered on this one's ops.
  std::vector<const BlockOption*> priced_frontier(Shapes& sh, const Layout& l) {
    auto& frontier = frontiers_[{l.tp, l.ep, l.etp, l.sp}];
    if (frontier.empty()) frontier = block_frontier(sh.spec->block, sh.costs, keep_everything(sh.spec->block));
    if (sh.frontier.empty()) {
      sh.frontier = frontier;
      std::vector<bool> need;
      for (int in : sh.spec->block.inputs) need.push_back(is_float(sh.spec->block.tensors[in].dtype));
      for (BlockOption& o : sh.frontier)
        o.recompute_ms = sh.costs.recompute_ms(*sh.cache.get(sh.spec->block, o.policy, need));
    }
    std::vector<const BlockOption*> options;
    for (const BlockOption& o : sh.frontier) options.push_back(&o);
    std::stable_sort(options.begin(), options.end(),
                     [](const BlockOption* a, const BlockOption* b) { return a->recompute_ms < b->recompute_ms; });
    return options;
  }

  // The fastest per-layer choice of the block's frontier that fits the budget on stage `stage`:
  // every layer of the stage one option, or the cheapest mix of two neighbouring options.
  void auto_policy(Shapes& sh, const Layout& l, int stage, ResolvedPolicy& layers, std::vector<std::string>& text) {
    const std::vector<const BlockOption*> options = priced_frontier(sh, l);
    std::vector<int64_t> mine;
    for (const LayerRange& c : stage_layers(cfg_.layers, l, stage))
      for (int64_t x = c.first; x < c.end; ++x) mine.push_back(x);
    auto assign = [&](const BlockOption* cheap, const BlockOption* dear, size_t n_cheap) {
      for (size_t i = 0; i < mine.size(); ++i) {
        const BlockOption* o = i < n_cheap ? cheap : dear;
        layers.layers[mine[i]] = o->policy;
        text[mine[i]] = o->text;
      }
    };
    const int64_t budget = this->budget(l);
    auto fits = [&](size_t k) {
      assign(options[k], options[k], mine.size());
      return within(memory(sh, l, stage, layers).total_peak(), budget);
    };
    // The frontier saves fewer bytes the more it recomputes, so the stage's peak falls along it:
    // bisect for the cheapest option that fits (the planner's exact search is for one process;
    // a layout search replays thousands of stages).
    const size_t n = options.size();
    if (n == 0) REMAT_INTERNAL("the frontier of block {} has no option", sh.spec->block.kind);
    if (!fits(n - 1)) {  // nothing fits: recompute everything the frontier can
      assign(options[n - 1], options[n - 1], mine.size());
      return;
    }
    size_t lo = 0, hi = n - 1;  // options[hi] fits
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (fits(mid))
        hi = mid;
      else
        lo = mid + 1;
    }
    const size_t k = hi;
    if (k == 0) {
      assign(options[0], options[0], mine.size());
      return;
    }
    // As many layers as still fit on the cheaper option before it.
    size_t few = 0, many = mine.size();
    while (few < many) {
      const size_t mid = (few + many + 1) / 2;
      assign(options[k - 1], options[k], mid);
      if (within(memory(sh, l, stage, layers).total_peak(), budget))
        few = mid;
      else
        many = mid - 1;
    }
    assign(options[k - 1], options[k], few);
  }

  // The layout under `policy` on every stage (or, unless `all_stages`, the first two and the last:
  // the most loaded in 1F1B, and the head's). With `stop_over_budget`, the first stage over the
  // budget ends it: fits is false and the peak a lower bound.
  LayoutPlan plan(const Layout& l, const std::string& policy, bool all_stages, bool stop_over_budget = false) {
    validate(l, cfg_, device_);
    Shapes& sh = shapes(l);
    LayoutPlan p;
    p.layout = l;
    p.policy = policy;
    p.budget = budget(l);
    p.margin = margin();
    p.params = params_;
    const bool automatic = policy == "auto";
    ResolvedPolicy fixed;
    std::vector<std::string> text(cfg_.layers, policy);
    if (!automatic) fixed = resolve(sh, policy);
    std::vector<int> stages;
    for (int s = 0; s < static_cast<int>(l.pp); ++s)
      if (all_stages || s <= 1 || s == l.pp - 1) stages.push_back(s);
    double worst_time = -1;
    int slowest = 0;
    std::vector<ResolvedPolicy> choices;  // (all_stages) each stage's choices, for the allocator replay
    std::vector<double> recompute(stages.size()), comm(stages.size());
    for (size_t i = 0; i < stages.size(); ++i) {
      RankPlan r;
      r.stage = stages[i];
      r.chunks = stage_layers(cfg_.layers, l, r.stage);
      ResolvedPolicy layers = fixed;
      if (automatic) {
        layers.layers.assign(cfg_.layers, keep_everything(sh.spec->block));
        auto_policy(sh, l, r.stage, layers, text);
      }
      r.policy = automatic ? rank_policy_text(r.chunks, text) : policy;
      r.memory = memory(sh, l, r.stage, layers);
      r.fixed = fixed_allocations(options_, device_, cfg_, l, r.stage);
      for (const ModelParam& mp : compile(sh, l, r.stage, layers).params) r.params += mp.spec->numel();
      if (all_stages) choices.push_back(layers);
      time(sh, l, layers, r, recompute[i], comm[i]);
      if (r.micro_ms + r.p2p_ms > worst_time) worst_time = r.micro_ms + r.p2p_ms, slowest = static_cast<int>(i);
      if (p.ranks.empty() || r.memory.total_peak() > p.peak()) p.worst = static_cast<int>(p.ranks.size());
      p.ranks.push_back(std::move(r));
      if (stop_over_budget && !within(p.peak(), p.budget)) return p;
    }
    p.fits = within(p.peak(), p.budget);
    // A reported plan: the caching allocator's blocks and segments too, on the stages that can hold
    // the largest: the first (the most micro-batches in flight), the last (the loss) and the one
    // with the most bytes.
    if (all_stages && !device_.engine)
      for (size_t i = 0; i < p.ranks.size(); ++i) {
        if (i != 0 && i + 1 != p.ranks.size() && static_cast<int>(i) != p.worst) continue;
        RankPlan& r = p.ranks[i];
        const StepMemory cuda = memory(l, r.stage, compile(sh, l, r.stage, choices[i]), /*cuda=*/true);
        r.memory.allocated_peak = cuda.allocated_peak;
        r.memory.reserved_peak = cuda.reserved_peak;
        if (static_cast<double>(cuda.reserved_peak) * (1 + kReservedUncertainty) > static_cast<double>(p.budget))
          p.reserved_tight = true;
      }
    step_time(sh, l, p, p.ranks[slowest], recompute[slowest], comm[slowest]);
    return p;
  }

  void step_time(Shapes& sh, const Layout& l, LayoutPlan& p, const RankPlan& slow, double recompute_ms,
                 double comm_ms) {
    LayoutTime& t = p.time;
    const double m = static_cast<double>(l.micro_batches());
    t.compute_s = m * slow.micro_ms / 1e3;
    t.recompute_s = m * recompute_ms / 1e3;
    t.tp_comm_s = l.tp > 1 || l.ep > 1 || l.cp > 1 ? m * comm_ms / 1e3 : 0;
    t.bubble_s = static_cast<double>(l.pp - 1) / static_cast<double>(l.vpp) * (slow.micro_ms + slow.p2p_ms) / 1e3;
    t.p2p_s = m * slow.p2p_ms / 1e3;
    // Data parallelism, on the most-loaded rank's parameters: all-reduce the gradients, overlapped
    // with the last micro-batch's backward; ZeRO-1 reduce-scatters them once a step and all-gathers
    // the updated weights. ZeRO-2 keeps only its shard of the gradients: every micro-batch's are
    // reduce-scattered as they come; ZeRO-3 keeps only its shard of the weights as well: every
    // micro-batch gathers them for its forward and again for its backward (as the memory model
    // replays it). Those run beside every micro-batch's compute. The dense parameters' ring
    // spans the data- x context-parallel ranks, the routed experts' the expert-data-parallel ones;
    // with optimizer instances, the ranks of one instance, the shards then all-reduced across the
    // instances.
    const ModelSpec& spec = *sh.spec;
    const StepMemory& worst = p.rank().memory;
    const int64_t wbytes = dtype_size(spec.block.dtype);
    const double d = static_cast<double>(l.shards()), share = (d - 1) / d;
    const double de = std::max<double>(1, static_cast<double>(l.expert_shards()));               // (validate: >= 1)
    const double unsharded = l.zero >= 3 ? d : 1.0, unsharded_experts = l.zero >= 3 ? de : 1.0;  // ZeRO-3: a shard
    const double instances = static_cast<double>(l.optimizer_instances);
    const double ring = d / instances, expert_ring = std::max(1.0, de / instances);
    const double dense = static_cast<double>(worst.params - worst.expert_params) / wbytes,
                 experts = static_cast<double>(worst.expert_params) / wbytes;
    // Elements each rank's ring moves once: (n - 1) / n of the gradients it reduces.
    const double moved =
        (ring - 1) / ring * dense * unsharded + (expert_ring - 1) / expert_ring * experts * unsharded_experts;
    // And across the instances: an all-reduce of each rank's shard of the gradients.
    const double across = 2 * (instances - 1) / instances * (dense / ring + experts / expert_ring);
    double bytes = 0;
    if (l.fsdp) {
      // FSDP2: every micro-batch gathers each stage's weights (the model's dtype) for its forward
      // and again for its backward, and reduce-scatters its gradients (fp32, or the model's dtype
      // when nothing is kept in fp32); per stage, overlapped with the compute of the stages around
      // it: what shows is what the compute cannot cover, and the first gather, which nothing
      // precedes: the root unit's (every stage that is not a block: the embeddings, the final
      // norm, an untied head; NOTE [FSDP2]) before the first forward.
      const int64_t reduced = fsdp_reduce_bytes(spec.block.dtype, options_.pure_dtype);
      bytes = m * share * static_cast<double>(p.rank().params) * static_cast<double>(2 * wbytes + reduced);
      int64_t root = 0;
      for (const BlockSpec* part : {&spec.stem, &spec.head})
        for (const ParamSpec& ps : part->params)
          if (ps.tied_to.empty()) root += ps.numel();
      if (l.shards() > 1) t.dp_comm_s = bytes / (dp_gbps(l) * 1e9);
      const double first = l.shards() > 1 ? share * static_cast<double>(root * wbytes) / (dp_gbps(l) * 1e9) : 0.0;
      t.dp_exposed_s = std::max(0.0, t.dp_comm_s - t.compute_s) + first;
    } else {
      // The rings within an instance at its rate; the all-reduce across the instances spans the
      // whole data- x context-parallel group.
      double across_bytes = 0;
      if (l.zero == 0)
        bytes = 2 * moved * l.grad_bytes;
      else if (l.zero == 1)
        bytes = moved * (l.grad_bytes + wbytes), across_bytes = across * l.grad_bytes;
      else if (l.zero == 2)
        bytes = moved * (m * l.grad_bytes + wbytes), across_bytes = across * l.grad_bytes;
      else
        bytes = m * moved * (l.grad_bytes + 2 * wbytes), across_bytes = across * l.grad_bytes;
      if (!device_.engine) t.dp_comm_s = bytes / (instance_gbps(l) * 1e9) + across_bytes / (dp_gbps(l) * 1e9);
      // What it runs beside: ZeRO-3's gathers every micro-batch's forward and backward, ZeRO-2's
      // reduce-scatters every backward, the others the last backward.
      const double hiding = l.zero >= 3 ? t.compute_s : (l.zero == 2 ? m : 1.0) * slow.backward_ms / 1e3;
      t.dp_exposed_s = std::max(0.0, t.dp_comm_s - hiding);
    }
    // A word embedding tied across the first and last stage: its gradient all-reduced between them,
    // (pp - 1) tp cp dp ranks apart: in one node while the whole grid fits in one.
    const double tied_gbps =
        (l.tp * l.cp * l.dp * l.pp > device_.gpus_per_node ? device_.inter_gbps : device_.intra_gbps) *
        device_.link_efficiency;
    for (const ParamSpec& ps : spec.head.params)
      if (!ps.tied_to.empty() && l.pp > 1)
        t.p2p_s += static_cast<double>(ps.numel() * l.grad_bytes) / (tied_gbps * 1e9);
    // Adam over this rank's share, at the memory rate.
    t.optimizer_s = static_cast<double>(worst.optimizer_traffic) / (sh.rates.memory_gbps * 1e9);
    t.step_s = t.compute_s + t.bubble_s + t.p2p_s + t.dp_exposed_s + t.optimizer_s;
    // Model FLOPs (no recompute) over the devices' peak.
    ModelConfig whole = cfg_;
    whole.batch = l.micro_batch;
    const double flops = static_cast<double>(make_model(whole).step_flops()) * static_cast<double>(l.batch()) /
                         static_cast<double>(l.micro_batch);
    const double peak = (cfg_.dtype == DType::F32 ? device_.fp32_tflops : device_.bf16_tflops) * 1e12;
    t.mfu = t.step_s > 0 ? flops / t.step_s / (static_cast<double>(l.gpus()) * peak) : 0;
    t.tokens_per_s = t.step_s > 0 ? static_cast<double>(l.batch() * cfg_.seq) / t.step_s : 0;
  }

  int64_t evaluated() const { return evaluated_; }
  const Device& device() const { return device_; }
  const ModelConfig& cfg() const { return cfg_; }

 private:
  ModelConfig cfg_;
  Device device_;
  PlanOptions options_;
  int64_t params_ = 0;  // the whole model's
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int64_t>, std::unique_ptr<Shapes>> shapes_;
  std::unordered_map<std::string, StepMemory> memo_;
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::vector<BlockOption>> frontiers_;  // by tp, ep, etp, sp
  int64_t evaluated_ = 0;
};

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

void check_search_space(const SearchSpace& space, int top) {
  if (space.gpus < 1 || space.gpus > kMostGpus)
    fail("SearchSpace.gpus must be in 1..{}, got {}", kMostGpus, space.gpus);
  for (auto [name, v] : {std::pair<const char*, int64_t>{"tp", space.tp},
                         {"pp", space.pp},
                         {"dp", space.dp},
                         {"vpp", space.vpp},
                         {"ep", space.ep},
                         {"etp", space.etp},
                         {"micro_batch", space.micro_batch}})
    if (v < 0 || v > kMostGpus) fail("SearchSpace.{} must be in 0..{} (0: searched), got {}", name, kMostGpus, v);
  if (space.cp < 1 || space.cp > kMostGpus) fail("SearchSpace.cp must be in 1..{}, got {}", kMostGpus, space.cp);
  if (space.max_vpp < 1 || space.max_vpp > kMostGpus)
    fail("SearchSpace.max_vpp must be in 1..{}, got {}", kMostGpus, space.max_vpp);
  for (auto [name, v] :
       {std::pair<const char*, int64_t>{"first_layers", space.first_layers}, {"last_layers", space.last_layers}})
    if (v < 0 || v > kMostGpus) fail("SearchSpace.{} must be in 0..{} (0: even stages), got {}", name, kMostGpus, v);
  if (space.zero_fixed < -1 || space.zero_fixed > 3)
    fail("SearchSpace.zero_fixed must be a ZeRO stage 0..3 (or -1: searched), got {}", space.zero_fixed);
  if (space.sp_fixed < -1 || space.sp_fixed > 1)
    fail("SearchSpace.sp_fixed must be -1 (searched), 0 or 1, got {}", space.sp_fixed);
  if (space.zero.empty() || std::any_of(space.zero.begin(), space.zero.end(), [](int z) { return z < 0 || z > 3; }))
    fail("SearchSpace.zero lists the ZeRO stages to try: give some of 0..3, got [{}]", fmt::join(space.zero, ", "));
  if (space.optimizer_instances < 1 || space.optimizer_instances > kMostGpus)
    fail("SearchSpace.optimizer_instances must be in 1..{}, got {}", kMostGpus, space.optimizer_instances);
  const bool tries_zero1 =
      space.zero_fixed == 1 ||
      (space.zero_fixed < 0 && std::find(space.zero.begin(), space.zero.end(), 1) != space.zero.end());
  if (space.optimizer_instances > 1 && (space.fsdp || !tries_zero1))
    fail(
        "SearchSpace.optimizer_instances {} are instances of the distributed optimizer (ZeRO-1): the search must try "
        "zero 1 without FSDP",
        space.optimizer_instances);
  if (space.micro_batch == 0 && space.micro_batches.empty())
    fail("SearchSpace.micro_batches lists the micro-batch sizes to try: give some, or fix micro_batch");
  if (std::any_of(space.micro_batches.begin(), space.micro_batches.end(), [](int64_t m) { return m < 1; }))
    fail("SearchSpace.micro_batches must each be >= 1, got [{}]", fmt::join(space.micro_batches, ", "));
  if (space.global_batch < 1 || space.global_batch > kMaxGlobalBatch)
    fail("SearchSpace.global_batch must be in 1..{} sequences per step, got {}", kMaxGlobalBatch, space.global_batch);
  if (space.policies.empty() || space.policies.size() > kMaxPolicies)
    fail("SearchSpace.policies lists {} policies; give 1..{}", space.policies.size(), kMaxPolicies);
  for (size_t i = 0; i < space.policies.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (space.policies[i] == space.policies[j]) fail("SearchSpace.policies lists '{}' twice", space.policies[i]);
  if (top < 1) fail("search_layouts: top must be >= 1, got {}", top);
}

// Expert parallelism: the experts' divisors that divide the dp x cp x tp / etp ranks (an explicit
// one is evaluated whatever they are: validate() says why it does not fit).
std::vector<int64_t> expert_parallel_sizes(const ModelConfig& cfg, const SearchSpace& space, int64_t dp, int64_t tp,
                                           int64_t etp) {
  if (space.ep > 0) return {space.ep};
  if (tp % etp != 0) return {1};  // validate() names the etp
  std::vector<int64_t> eps;
  Layout grid;
  grid.dp = dp, grid.cp = space.cp, grid.tp = tp, grid.etp = etp;
  for (int64_t ep : routes_experts(cfg.arch) ? divisors(cfg.experts) : std::vector<int64_t>{1})
    if (grid.ep = ep; grid.expert_grid_divides()) eps.push_back(ep);
  return eps;
}

// The layouts of one (tp, sp, pp, dp, ep) that validate: each vpp, micro-batch and ZeRO stage.
// Stages that do not divide the layers: the middle ones at ceil(layers / pp), the first and last
// sharing the rest (torchtitan's split), without interleaving. An explicit vpp or micro-batch is
// evaluated whatever the searched grid holds. The first refusal goes to `refused`.
void add_layouts(const ModelConfig& cfg, const SearchSpace& space, const Device& device, Layout l,
                 std::vector<Layout>& out, std::string& refused) {
  std::vector<int64_t> vpps;
  if (space.vpp > 0)
    vpps = {space.vpp};
  else
    for (int64_t v = 1; v <= (l.pp > 1 ? space.max_vpp : 1); ++v) vpps.push_back(v);
  const std::vector<int64_t> micro_batches =
      space.micro_batch > 0 ? std::vector<int64_t>{space.micro_batch} : space.micro_batches;
  int64_t first = space.first_layers, last = space.last_layers;
  if (first == 0 && last == 0 && cfg.layers % l.pp != 0) {
    const int64_t middle = (cfg.layers + l.pp - 1) / l.pp, rest = cfg.layers - (l.pp - 2) * middle;
    first = rest / 2, last = rest - rest / 2;
    if (first < 1) return;
  }
  l.first_layers = first, l.last_layers = last;
  l.fsdp = space.fsdp;
  l.global_batch = space.global_batch, l.grad_bytes = space.grad_bytes;
  for (int64_t vpp : vpps) {
    if (first > 0 ? vpp > 1 : cfg.layers % (l.pp * vpp) != 0) continue;
    for (int64_t mb : micro_batches)
      for (int zero : space.zero_fixed >= 0 ? std::vector<int>{space.zero_fixed} : space.zero) {
        // Instances are ZeRO-1's, over the dp x cp ranks (validate names a count that does not divide them).
        if (space.optimizer_instances > 1 && zero != 1 && space.zero_fixed < 0) continue;
        // Nothing to shard over: ZeRO shards over the dp x cp ranks, the experts' state over theirs.
        if (zero > 0 && l.shards() == 1 && (!routes_experts(cfg.arch) || l.expert_shards() == 1) &&
            space.zero_fixed < 0 && space.optimizer_instances == 1)
          continue;
        if (space.fsdp && zero != 0) continue;
        l.vpp = vpp, l.micro_batch = mb, l.zero = zero, l.optimizer_instances = space.optimizer_instances;
        try {
          validate(l, cfg, device);
        } catch (const Error& e) {
          if (refused.empty()) refused = e.what();
          continue;
        }
        out.push_back(l);
      }
  }
}

// Why no layout can take a value the caller fixed in `space` (empty: none such found): what a
// search that finds no layout names, rather than a refusal of some searched value.
std::string fixed_value_refusal(const ModelConfig& cfg, const SearchSpace& space, const Device& device) {
  const int64_t tp = space.tp, pp = space.pp, cp = space.cp;
  if (tp > 0 && cfg.heads % tp != 0) return fmt::format("tp {} does not divide the {} heads", tp, cfg.heads);
  if (tp > device.gpus_per_node)
    return fmt::format("tp {} is more than a node's {} GPUs: tensor parallelism stays inside a node", tp,
                       device.gpus_per_node);
  if (tp > 0 && cfg.kv() % tp != 0) return fmt::format("tp {} does not divide the {} key/value heads", tp, cfg.kv());
  if (tp > 0 && cfg.hidden() % tp != 0)
    return fmt::format("tp {} does not divide the MLP's {} features", tp, cfg.hidden());
  if (space.sp_fixed == 1 && tp == 1)
    return "sp with tp 1: sequence parallelism splits the tensor-parallel ranks' tokens";
  if ((space.sp_fixed == 1 || space.sp_with_tp) && tp > 1 && cfg.seq % (tp * cp) != 0)
    return fmt::format("sp with tp {} x cp {}: the sequence of {} tokens does not split into {}", tp, cp, cfg.seq,
                       tp * cp);
  if (pp > cfg.layers) return fmt::format("pp {} is more than the {} layers", pp, cfg.layers);
  const int64_t fixed = (tp > 0 ? tp : 1) * cp * (pp > 0 ? pp : 1) * (space.dp > 0 ? space.dp : 1);
  if (space.gpus % fixed != 0)
    return fmt::format("{} GPUs do not split into the tp x cp x pp x dp given, {}", space.gpus, fixed);
  if (tp > 0 && pp > 0 && space.dp > 0 && fixed != space.gpus)
    return fmt::format("tp {} x cp {} x pp {} x dp {} is {} GPUs, not {}", tp, cp, pp, space.dp, fixed, space.gpus);
  if (space.vpp > 1 && (space.first_layers > 0 || space.last_layers > 0))
    return fmt::format(
        "vpp {} with first or last stage layers given: virtual stages split the layers evenly; give one or the "
        "other",
        space.vpp);
  return "";
}

// Every layout of the space that validates.
std::vector<Layout> candidate_layouts(const ModelConfig& cfg, const SearchSpace& space, const Device& device,
                                      std::string& refused) {
  std::vector<Layout> layouts;
  if (const std::string why = fixed_value_refusal(cfg, space, device); !why.empty()) {
    refused = why;
    return layouts;
  }
  for (int64_t tp : divisors(cfg.heads)) {
    if (space.tp > 0 && tp != space.tp) continue;
    if (tp > device.gpus_per_node || space.gpus % tp != 0 || cfg.kv() % tp != 0 || cfg.hidden() % tp != 0) continue;
    for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp) {
      if (space.sp_fixed >= 0 && sp != space.sp_fixed) continue;
      if (space.sp_with_tp && tp > 1 && !sp) continue;
      if (sp && cfg.seq % (tp * space.cp) != 0) continue;
      for (int64_t pp = 1; pp <= cfg.layers; ++pp) {
        if (space.pp > 0 && pp != space.pp) continue;
        if (space.pp == 0 && space.gpus % pp != 0) continue;
        if ((space.gpus / tp) % (pp * space.cp) != 0) continue;
        const int64_t dp = space.gpus / (tp * space.cp * pp);
        if (space.dp > 0 && dp != space.dp) continue;
        const int64_t etp = space.etp > 0 ? space.etp : routes_experts(cfg.arch) ? tp : 1;
        for (int64_t ep : expert_parallel_sizes(cfg, space, dp, tp, etp)) {
          Layout l;
          l.tp = tp, l.sp = sp != 0, l.cp = space.cp, l.pp = pp, l.dp = dp, l.ep = ep, l.etp = etp;
          add_layouts(cfg, space, device, l, layouts, refused);
        }
      }
    }
  }
  return layouts;
}

// A (layout, policy) pair with a lower bound on its step time that needs no memory replay: the
// first stage's compute, sends and bubble ("auto" is bounded by recomputing nothing).
struct BoundedPair {
  size_t layout;
  std::string policy;
  double bound;
};

// Whether the memory model replays uniform:N segments on `l`: one pipeline stage, whole weights
// (NOTE [Segments]). The search leaves the other layouts out for such a policy.
bool runs_segments(const Layout& l) { return l.pp == 1 && l.zero < 3 && !l.fsdp; }

std::vector<BoundedPair> bounded_pairs(Evaluator& e, const ModelConfig& cfg, const std::vector<Layout>& layouts,
                                       const std::vector<std::string>& fixed, bool automatic) {
  std::vector<BoundedPair> pairs;
  std::string segments_left_out;  // a uniform:N policy no layout could run
  for (size_t i = 0; i < layouts.size(); ++i) {
    const Layout& l = layouts[i];
    Shapes& sh = e.shapes(l);
    auto bound = [&](const ResolvedPolicy& policy) {
      RankPlan r;
      r.chunks = stage_layers(cfg.layers, l, 0);
      double rec = 0, comm = 0;
      e.time(sh, l, policy, r, rec, comm);
      return (static_cast<double>(l.micro_batches()) + static_cast<double>(l.pp - 1) / static_cast<double>(l.vpp)) *
             (r.micro_ms + r.p2p_ms);
    };
    for (const std::string& policy : fixed) {
      const ResolvedPolicy& r = e.resolve(sh, policy);
      if (r.segment > 0 && !runs_segments(l)) {
        segments_left_out = policy;
        continue;
      }
      pairs.push_back({i, policy, bound(r)});
    }
    if (automatic) {
      ResolvedPolicy none;
      none.layers.assign(cfg.layers, keep_everything(sh.spec->block));
      pairs.push_back({i, "auto", bound(none)});
    }
  }
  if (pairs.empty() && !segments_left_out.empty())
    fail(
        "policy '{}' runs uniform:N segments, which are planned on layouts of one pipeline stage with whole weights "
        "(pp 1, ZeRO 0-2, no FSDP); none of the {} layouts searched is one: give such a layout or another policy",
        segments_left_out, layouts.size());
  std::stable_sort(pairs.begin(), pairs.end(),
                   [](const BoundedPair& a, const BoundedPair& b) { return a.bound < b.bound; });
  return pairs;
}

// How many layouts "auto" plans (a knapsack on each stage, the search's costliest step) once that
// many have fit: the pairs come fastest bound first, so later ones rarely win, and the search
// stays within seconds on a grid of thousands of layouts.
constexpr int kAutoLayouts = 48;

// The fastest plan that fits of each layout (by index), from pairs replayed fastest bound first
// until no bound beats the top-th found: the list is then exactly the fastest that fit. "auto" (a
// search on each stage) stops after kAutoLayouts layouts fit. Tracks in res.least the smallest peak seen
// while nothing fits.
std::vector<std::optional<LayoutPlan>> replay_pairs(Evaluator& e, const std::vector<Layout>& layouts,
                                                    const std::vector<BoundedPair>& pairs, int top, SearchResult& res,
                                                    bool& have_least) {
  std::vector<std::optional<LayoutPlan>> found(layouts.size());
  auto kth = [&] {
    std::vector<double> t;
    for (const auto& f : found)
      if (f) t.push_back(f->time.step_s * 1e3);
    if (static_cast<int>(t.size()) < top) return 1e300;
    std::nth_element(t.begin(), t.begin() + (top - 1), t.end());
    return t[top - 1];
  };
  int automatic_fit = 0;
  bool any_fit = false;
  for (const BoundedPair& pair : pairs) {
    if (pair.bound >= kth()) break;  // sorted: no later pair is faster
    std::optional<LayoutPlan>& best = found[pair.layout];
    if (pair.policy == "auto") {
      if (automatic_fit >= kAutoLayouts) continue;
      if (best && best->policy == "none") continue;  // nothing recomputed: auto cannot beat it
    }
    // Once one layout fits no refusal is printed, so a stage over the budget may end a replay.
    LayoutPlan p = e.plan(layouts[pair.layout], pair.policy, false, any_fit);
    if (pair.policy == "auto" && p.fits) ++automatic_fit;
    if (!any_fit && (!have_least || p.peak() < res.least.peak())) res.least = p, have_least = true;
    if (p.fits && (!best || p.time.step_s < best->time.step_s)) best = std::move(p), any_fit = true;
  }
  return found;
}

}  // namespace

LayoutPlan plan_layout(const ModelConfig& cfg, const Layout& layout, const Device& device, const std::string& policy,
                       const PlanOptions& options) {
  validate(cfg);
  Evaluator e(cfg, device, options);
  return e.plan(layout, policy, options.all_stages);
}

ResolvedPolicy resolve_layout_policy(const std::string& policy, const BlockSpec& block, int64_t layers) {
  const Policy parsed = Policy::parse(policy);
  if (parsed.is_budget())
    fail("policy '{}' is a budget; a layout plans each stage against the device's memory: use --policy auto", policy);
  return parsed.resolve(block, layers);
}

SearchResult search_layouts(const ModelConfig& cfg, const SearchSpace& space, const Device& device, int top,
                            const PlanOptions& options) {
  validate(cfg);
  check_search_space(space, top);
  Evaluator e(cfg, device, options);
  SearchResult res;
  const std::vector<Layout> layouts = candidate_layouts(cfg, space, device, res.refused);
  res.candidates = static_cast<int64_t>(layouts.size());
  std::vector<std::string> fixed;
  bool automatic = false;
  for (const std::string& p : space.policies) {
    if (p == "auto")
      automatic = true;
    else
      fixed.push_back(p);
  }
  std::vector<BoundedPair> pairs = bounded_pairs(e, cfg, layouts, fixed, automatic);
  bool have_least = false;
  // Nothing fits unless full recompute (the least any policy but uniform:N keeps; "auto" recomputes
  // no more) fits somewhere: find that first, so a refusal costs one replay per layout, not one per
  // policy. A uniform:N segment may keep less (one layer's input per segment): no probe then.
  bool segmented = false;
  for (const std::string& p : fixed) segmented = segmented || Policy::parse(p).is_segmented();
  const bool probe = !segmented && (automatic || std::find(fixed.begin(), fixed.end(), "full") != fixed.end());
  bool hopeless = probe;
  for (size_t i = 0; probe && i < layouts.size() && hopeless; ++i) {
    LayoutPlan p = e.plan(layouts[i], "full", false);
    hopeless = !p.fits;
    if (!have_least || p.peak() < res.least.peak()) res.least = std::move(p), have_least = true;
  }
  if (hopeless) pairs.clear();
  std::vector<std::optional<LayoutPlan>> found = replay_pairs(e, layouts, pairs, top, res, have_least);
  res.evaluated = e.evaluated();
  // The fastest, replayed on every stage.
  std::vector<size_t> order;
  for (size_t i = 0; i < found.size(); ++i)
    if (found[i]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return found[a]->time.step_s < found[b]->time.step_s; });
  for (size_t i : order) {
    if (static_cast<int>(res.best.size()) >= top) break;
    LayoutPlan full = e.plan(found[i]->layout, found[i]->policy, true);
    if (full.fits) res.best.push_back(std::move(full));
  }
  std::stable_sort(res.best.begin(), res.best.end(),
                   [](const LayoutPlan& a, const LayoutPlan& b) { return a.time.step_s < b.time.step_s; });
  if (have_least && res.best.empty()) res.least = e.plan(res.least.layout, res.least.policy, true);
  return res;
}

int64_t min_gpus(const ModelConfig& cfg, SearchSpace space, const Device& device, const PlanOptions& options) {
  const int64_t first = space.gpus;
  // It fits with some policy exactly when it fits with full recompute, or with a uniform:N given.
  std::vector<std::string> least = {"full"};
  for (const std::string& p : space.policies)
    if (p != "auto" && Policy::parse(p).is_segmented()) least.push_back(p);
  space.policies = least;
  for (int64_t n = 2 * first; n <= kMinGpusSearched; n *= 2) {
    space.gpus = n;
    space.dp = 0;  // the data-parallel size follows the count
    if (!search_layouts(cfg, space, device, 1, options).best.empty()) return n;
  }
  return 0;
}

}  // namespace remat
