// Planning a multi-GPU run: the memory of every GPU, exactly, and the step time, for the layouts
// large runs use (Megatron-LM's tensor, sequence and pipeline parallelism; data parallelism with
// ZeRO), before anyone books the cluster.
//
//   remat::Layout l;
//   l.tp = 8, l.sp = true, l.pp = 8, l.micro_batch = 1, l.global_batch = 64;
//   remat::LayoutPlan p = remat::plan_layout(cfg, l, remat::parse_device("a100-80gb"), "attn");
//   p.rank().memory.total_peak()   // bytes on the most-loaded GPU
//   p.time.step_s                  // estimated seconds per step
//
// Memory comes from the tensor table at one rank's shapes (ModelConfig::tp, sp) and the memory
// model's replay of that rank's step: its pipeline chunks under the 1F1B schedule, its share of
// the parameters, gradients and optimizer state. Nothing is an approximation of the table: a rank's
// bytes are the bytes of the tensors remat's schedules keep, to the byte. Times are estimates from
// the device's stated rates and the assumptions Device lists. See docs/design.md, NOTE [Parallel
// layouts].
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"
#include "remat/costs.h"
#include "remat/memory_model.h"

namespace remat {

// An accelerator and how it is connected. Vendor figures are peak rates; the efficiencies are
// assumptions (what a training step reaches of them) and are printed with every plan.
struct Device {
  std::string name;        // "a100-80gb"
  int64_t memory = 0;      // bytes per device, as the driver reports its total
  double bf16_tflops = 0;  // dense bf16/fp16 matmul peak
  double fp32_tflops = 0;  // fp32 matmul peak (no TF32)
  double hbm_gbps = 0;     // memory bandwidth
  double intra_gbps = 0;   // per device, one direction, inside a node (NVLink)
  double inter_gbps = 0;   // per device, one direction, between nodes (InfiniBand)
  int64_t gpus_per_node = 8;
  double matmul_efficiency = 0.7;  // assumption: share of the matmul peak
  double memory_efficiency = 0.8;  // assumption: share of the memory bandwidth
  double link_efficiency = 0.7;    // assumption: share of the link bandwidth collectives reach
  std::string source;              // where the figures come from
  bool engine = false;             // this machine's CPU: remat's own engine and trainer (tp = pp = 1)
  int sm = 90;                     // CUDA compute capability x 10 (90 Hopper, 80 Ampere): workspace sizes

  // Matmul rate in GFLOP/s for a dtype, after the efficiency.
  double matmul_gflops(DType dtype) const;
};

// The presets: h100-80gb, h100-96gb, h200-141gb, a100-80gb, a100-40gb, cpu.
std::vector<std::string> device_names();
// A preset; "cpu" (this machine: memory from /proc/meminfo, rates from calibrated_rates);
// "custom:MEM,TFLOPS,GBPS[,INTRA_GBPS[,INTER_GBPS[,GPUS_PER_NODE]]]" (bf16 TFLOPS, HBM GB/s,
// e.g. custom:96GiB,700,3000,400,50,8); or the path of a JSON file with Device's field names.
// Throws remat::Error naming the bad part and what is allowed.
Device parse_device(std::string_view text);

// The training framework each GPU runs (PlanOptions::framework): what it holds beyond the model's
// tensors, and how it runs what the tensor table leaves open. Every term is named with its reason
// (fixed_allocations; docs/planner.md gives the sources).
enum class Framework : uint8_t {
  Megatron,    // Megatron-LM with Transformer Engine: fp32 main-gradient buffers filled by the weight
               // GEMMs themselves, the distributed optimizer as ZeRO-1, the batch with its mask
  Torchtitan,  // torchtitan at 9dec370 (December 2024, its published benchmarks' code): FSDP2
               // (fully_shard per block and on the model), foreach AdamW, eager (unfused) Llama
               // ops, the batch without a mask
};
// "megatron" or "torchtitan".
std::string_view to_string(Framework f);
// "megatron", "torchtitan". Throws remat::Error listing them otherwise.
Framework parse_framework(std::string_view text);

// One of a GPU's fixed allocations, named, with why it is there.
struct Allocation {
  std::string name;   // "cuBLAS workspace (PyTorch)"
  int64_t bytes = 0;  // on each device that has it
  std::string why;    // what allocates it, and when
};

// Bounds on what one plan is asked: sequences per optimizer step (Llama 3 405B trained with 2048
// of 8192 tokens; a million is far past any run) and policies tried in one search.
inline constexpr int64_t kMaxGlobalBatch = int64_t{1} << 20;
inline constexpr size_t kMaxPolicies = 64;
// The most GPUs a plan takes, and the most any one parallel degree may be.
inline constexpr int64_t kMostGpus = int64_t{1} << 20;
// Bytes a plan on this machine's engine leaves to the system and other processes (PlanOptions::reserve -1).
inline constexpr int64_t kCpuReserve = int64_t{2} << 30;

// How one training step is laid out over tp x cp x pp x dp devices. Ranks are ordered
// tensor-parallel first (inside a node), then context-parallel, then data-parallel, then pipeline
// (Megatron-LM's order).
struct Layout {
  int64_t tp = 1;   // tensor-parallel ranks (Megatron's column/row split), inside a node
  bool sp = false;  // sequence parallelism over the tp ranks
  int64_t cp = 1;   // context-parallel ranks: the sequence split, attention in a ring
  int64_t pp = 1;   // pipeline stages (1F1B schedule)
  int64_t vpp = 1;  // model chunks per pipeline stage (interleaved 1F1B when > 1)
  // An uneven pipeline (vpp 1): the layers of the first and the last stage (Megatron-LM's
  // --decoder-first/last-pipeline-num-layers), the others sharing the rest evenly; 0: all even.
  int64_t first_layers = 0, last_layers = 0;
  int64_t dp = 1;  // data-parallel replicas
  // Expert-parallel ranks (arch moe): the routed experts split over ep ranks, which exchange their
  // tokens in all-to-alls; expert-tensor-parallel ranks (etp, dividing tp): each expert's linears
  // split over etp ranks of the tensor-parallel group. Megatron-LM's expert grid: the tp x cp x dp
  // ranks of a stage regrouped as etp x ep x edp; the experts' parameters are sharded over the
  // expert-data-parallel ranks, edp = dp x cp x tp / (ep x etp).
  int64_t ep = 1;
  int64_t etp = 1;  // 1 here; search_layouts takes SearchSpace::etp, tp unless given (Megatron-LM's default)
  int zero = 0;     // ZeRO stage 0-3 (1 is Megatron's distributed optimizer)
  // ZeRO-1 as Megatron-LM's --num-distributed-optimizer-instances: the data- x context-parallel
  // ranks split into this many instances of consecutive ranks, each sharding the optimizer state
  // over its own ranks (optimizer_shards), the instances' shards all-reduced with one another; 1:
  // one instance over them all. The weight and gradient buffers stay whole on every rank.
  int64_t optimizer_instances = 1;
  bool fsdp = false;         // FSDP2 over dp x cp instead (torchtitan): sharded fp32 weights as the master
                             // copy, each stage's weights all-gathered for its passes and its gradients
                             // reduce-scattered after its backward, overlapped with compute
  int64_t micro_batch = 1;   // sequences per micro-batch
  int64_t global_batch = 0;  // sequences per optimizer step, all replicas; 0 = micro_batch * dp
  int grad_bytes = 4;        // bytes per gradient element in the buffers: 4 (Megatron's fp32
                             // main_grad) or 2 (the ZeRO paper's fp16 gradients)

  int64_t gpus() const { return tp * cp * pp * dp; }
  bool uneven() const { return first_layers > 0 || last_layers > 0; }
  // Ranks the gradients are reduced over and the optimizer state is sharded over: the data- and
  // context-parallel ranks (Megatron-LM's DP x CP group).
  int64_t shards() const { return dp * cp; }
  // The ranks that hold the same experts' shards: the expert-data-parallel group.
  int64_t expert_shards() const { return dp * cp * tp / (ep * etp); }
  // The ranks the optimizer state is sharded over (ZeRO-1's instance), of the dense parameters and
  // of the routed experts'.
  int64_t optimizer_shards() const { return shards() / optimizer_instances; }
  int64_t expert_optimizer_shards() const { return expert_shards() / optimizer_instances; }
  // Whether a stage's ranks regroup as etp x ep x edp: etp divides tp, and ep the ranks over etp.
  bool expert_grid_divides() const { return tp % etp == 0 && shards() * tp / etp % ep == 0; }
  // Sequences per step.
  int64_t batch() const { return global_batch > 0 ? global_batch : micro_batch * dp; }
  // Micro-batches per step on each pipeline (gradient accumulation follows).
  int64_t micro_batches() const { return batch() / (micro_batch * dp); }
};

// "tp 8 + sp, pp 8, dp 4, zero 1, micro-batch 1 x 16"; for a mixture of experts (`experts`) also
// "ep 8" when ep > 1 and "etp 1" when etp is not tp (Megatron-LM's default).
std::string to_string(const Layout& l, bool experts = false);

// One rank's model under `l`: `cfg` split as l splits it (tp, sp, cp, ep, etp), running one
// micro-batch of l.micro_batch sequences.
ModelConfig rank_config(const ModelConfig& cfg, const Layout& l);

// The layers of pipeline stage `stage` of `l` over a model of `layers`: its chunks, in order.
std::vector<LayerRange> stage_layers(int64_t layers, const Layout& l, int64_t stage);

// Throws remat::Error naming the first field of `l` that does not fit `cfg` on `device` (tp must
// divide the heads and fit in a node, pp * vpp must divide the layers, the global batch must split
// into micro-batches, ...).
void validate(const Layout& l, const ModelConfig& cfg, const Device& device);

// One pipeline stage: what each of its devices holds and runs.
struct RankPlan {
  int stage = 0;                   // 0 .. pp - 1
  std::vector<LayerRange> chunks;  // its layers
  std::string policy;              // the recompute policy of its layers, as a policy string
  StepMemory memory;               // exact, for its data-parallel rank with the largest shard
  std::vector<Allocation> fixed;   // the framework's fixed allocations, summed in memory.fixed
  int64_t params = 0;              // parameters this stage's GPUs hold (their tensor-parallel share)
  // memory.allocated_peak and memory.reserved_peak: PyTorch's caching allocator replayed over the
  // stage's step (memory_model.h, StepShape::cuda) for the plans a search reports, and for
  // plan_layout with PlanOptions::all_stages, on the stages that can hold the largest (the first,
  // the last and the one with the most bytes); 0 on the others and on the engine's CPU device.
  double micro_ms = 0;     // forward + backward (+ recompute) of one micro-batch, all chunks
  double backward_ms = 0;  // the backward part of micro_ms
  double p2p_ms = 0;       // sending and receiving activations and gradients per micro-batch
};

// Where the time of one step goes (seconds), from the device's rates and Device's assumptions.
struct LayoutTime {
  double compute_s = 0;     // micro-batches on the slowest stage, recompute and TP collectives included
  double recompute_s = 0;   // of compute_s: the recomputation
  double tp_comm_s = 0;     // of compute_s: tensor-parallel collectives, expert-parallel all-to-alls and the
                            // context-parallel ring's sends where they outlast the attention (op_comm_ms)
  double bubble_s = 0;      // pipeline fill and drain: (pp - 1) / vpp slowest micro-batches
  double p2p_s = 0;         // pipeline sends, not overlapped
  double dp_comm_s = 0;     // gradient reduction (and ZeRO gathers) over the data-parallel group
  double dp_exposed_s = 0;  // of dp_comm_s: what the last micro-batch's backward does not hide
  double optimizer_s = 0;   // Adam over this rank's share
  double step_s = 0;        // compute + bubble + p2p + exposed dp + optimizer
  double mfu = 0;           // model FLOPs per second over the devices' bf16/fp32 peak
  double tokens_per_s = 0;  // the global batch's tokens over step_s
};

// One layout planned: its layout, the policy of each stage, the memory of each and the step time.
struct LayoutPlan {
  Layout layout;
  std::string policy;  // as asked: a policy string, or "auto"
  int64_t budget = 0;  // bytes per device it must fit
  double margin = 0;   // share of the peak kept free: fits means peak (1 + margin) <= budget
  int64_t params = 0;  // parameters of the model, each counted once
  // The largest reserved peak of the stages (with the allocator replayed) over the budget, or within
  // kReservedUncertainty of it: the caching allocator may not find room.
  bool reserved_tight = false;
  std::vector<RankPlan> ranks;  // per pipeline stage (the ones replayed)
  int worst = 0;                // index into ranks of the most-loaded stage
  bool fits = false;
  LayoutTime time;

  const RankPlan& rank() const { return ranks[static_cast<size_t>(worst)]; }
  int64_t peak() const { return rank().memory.total_peak(); }
};

// Options of plan_layout and search_layouts.
// What a plan's fit allows for beyond its predicted peak: the model's uncertainty, as validated
// against measured runs (docs/validation.md: the allocated-peak predictions are at worst 2.1% low,
// 3.6% for a mixture of experts whose routing drifted without a load-balancing loss; the reserved
// ones up to 6% low and 8% high, on 14 runs of FSDP2 only).
inline constexpr double kAllocatedUncertainty = 0.05;
inline constexpr double kReservedUncertainty = 0.12;

struct PlanOptions {
  Framework framework = Framework::Megatron;  // whose training step the plan replays
  bool batch_mask = true;            // Megatron: the dataloader puts a bool (micro-batch, 1, s, s) attention mask on
                                     // the GPU (off: --no-create-attention-mask-in-dataloader)
  bool fused_wgrad = true;           // Megatron: weight GEMMs accumulate into the fp32 gradient buffers directly
                                     // (off: --no-gradient-accumulation-fusion, a bf16 weight gradient first)
  bool grouped_gemm = true;          // Megatron, moe: the local experts run as one grouped GEMM (--moe-grouped-gemm,
                                     // Transformer Engine's GroupedLinear, with a workspace per stream); off: one
                                     // GEMM per expert (SequentialMLP)
  bool allgather_dispatch = true;    // Megatron, moe: the allgather token dispatcher (Megatron's default), which
                                     // keeps the group's gathered tokens in a buffer; false: alltoall
  bool deterministic = false;        // Megatron: --deterministic-mode, PyTorch's deterministic algorithms
                                     // (ModelConfig::deterministic: a mixture of experts' unpermute keeps more)
  int64_t cublas_workspace = 0;      // bytes of PyTorch's cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG); 0: its
                                     // default for the device (32 MiB on Hopper, 8.125 MiB before)
  bool expandable_segments = false;  // PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  // FSDP2's root (fully_shard on the model: the embedding, the final norm and the head) freed after
  // the forward and gathered again for the head's backward, as PyTorch 2.8 and later do when
  // reshard_after_forward=True is passed (torchtitan passes it); false: kept gathered from the
  // forward to the end of the backward, as PyTorch before 2.8 did whatever was passed.
  bool fsdp_root_reshard = true;
  bool pure_dtype = false;  // no fp32 copies: weights, gradients and Adam state in the model's dtype
                            // (torchtune's and others' pure bf16 training)
  int64_t reserve = -1;     // bytes per device outside PyTorch's allocator; -1: outside_allocator()'s named terms
                            // on a GPU (the CUDA context, NCCL's buffers), kCpuReserve on the CPU
  int64_t budget = 0;       // bytes per device a stage's peak may reach; 0 = device memory - reserve
  double margin = -1;       // share of a stage's peak kept free for what the model misses; -1:
                            // kAllocatedUncertainty on a GPU, 0 on this machine's engine (exact)
  bool all_stages = true;   // replay every pipeline stage (false: the first two and the last,
                            // which hold the most; the search's shortcut, NOTE [Parallel layouts])
};

// The plan of one layout: every stage's memory and the step time. `policy` is a policy string for
// every layer ("none", "attn", "full", "layers:..."), or "auto": each stage gets the fastest
// per-layer choice of the block's frontier that fits the budget (NOTE [Parallel layouts]). Throws
// remat::Error when validate() does or the policy is bad.
LayoutPlan plan_layout(const ModelConfig& cfg, const Layout& layout, const Device& device, const std::string& policy,
                       const PlanOptions& options = {});

// What search_layouts tries.
struct SearchSpace {
  int64_t gpus = 0;                                                                      // devices in all
  int64_t global_batch = 0;                                                              // sequences per step
  std::vector<std::string> policies = {"none", "attn", "attn+mlp-act", "full", "auto"};  // each layout tries these
  // ZeRO stages tried: Megatron-LM's DDP and distributed optimizer, the stages validated against
  // measured runs. 2 and 3 (the ZeRO paper's accounting, no measured run behind it) when listed
  // or fixed (zero_fixed).
  std::vector<int> zero = {0, 1};
  std::vector<int64_t> micro_batches = {1, 2, 4, 8};  // micro-batch sizes tried
  int grad_bytes = 4;                                 // a gradient element's bytes (4: fp32 buffers)
  int64_t max_vpp = 4;  // the most model chunks per stage tried when vpp is searched (pp > 1)
  // Fixed by the caller when > 0 (tp, pp, dp, vpp) or >= 0 (zero_fixed, sp_fixed: 0 or 1).
  int64_t tp = 0, pp = 0, dp = 0, vpp = 0, micro_batch = 0;
  int64_t ep = 0;   // expert-parallel ranks, arch moe (0: searched over the experts' divisors)
  int64_t etp = 0;  // expert-tensor-parallel ranks, arch moe (0: tp, Megatron-LM's default)
  int64_t cp = 1;   // context-parallel ranks (not searched)
  int64_t first_layers = 0, last_layers = 0;  // an uneven pipeline's first and last stages (Layout)
  bool fsdp = false;                          // every layout shards with FSDP2 (zero 0)
  int zero_fixed = -1, sp_fixed = -1;         // -1: searched; else the ZeRO stage, and sp off (0) or on (1)
  int64_t optimizer_instances = 1;            // Layout::optimizer_instances; > 1 tries ZeRO-1 alone
  bool sp_with_tp = false;                    // tp > 1 always with sp (torchtitan's tensor-parallel plan has no other)
};

struct SearchResult {
  std::vector<LayoutPlan> best;  // the fastest that fit, fastest first, each replayed in full
  int64_t evaluated = 0;         // stage memory replays run (memoized ones not counted)
  int64_t candidates = 0;        // layouts that pass validate()
  std::string refused;           // the first refusal of validate() in the space searched, if any
  LayoutPlan least;              // when none fits: the one with the smallest per-device peak
};

// `policy` for every layer of `block`, as a layout runs it ("auto" is the search's, not this):
// refuses a budget (a layout plans each stage against the device's memory), an unknown tensor, a
// preset with nothing to drop in the block, a layer range past `layers`. Throws remat::Error naming
// the policy and what is allowed.
ResolvedPolicy resolve_layout_policy(const std::string& policy, const BlockSpec& block, int64_t layers);

// Every layout of `space` on `device` (tp dividing the heads and within a node; pp any count up to the
// layers, split evenly when it divides them, else with the middle stages at ceil(layers / pp) and
// the first and last sharing the rest, as torchtitan splits; dp = gpus / (tp cp pp), micro-batch,
// ZeRO stage, sp, vpp, recompute): the `top` fastest that fit the device's memory, fastest first,
// or, when none fits, the one with the smallest per-device peak (SearchResult::least); a layout
// the config cannot take is skipped, the first such refusal kept (SearchResult::refused). Throws
// remat::Error, naming the value, for an invalid config, space or `top`.
SearchResult search_layouts(const ModelConfig& cfg, const SearchSpace& space, const Device& device, int top,
                            const PlanOptions& options = {});

// Whether a mixture of experts' tokens go by Megatron-LM's allgather dispatcher on `device`
// (PlanOptions::allgather_dispatch under Megatron-LM; never on remat's own engine).
bool allgather_dispatch(const PlanOptions& options, const Device& device);

// What `options.framework` allocates on each GPU of pipeline stage `stage` of `l`, beyond the
// tensors the memory model replays: its GEMM workspaces and the micro-batch it keeps on the GPU.
// `cfg` is the model (whole, not a rank's share).
std::vector<Allocation> fixed_allocations(const PlanOptions& options, const Device& device, const ModelConfig& cfg,
                                          const Layout& l, int stage);

// NCCL's buffers on a GPU (NCCL 2.22 and later; the sources are in src/plan/frameworks.cpp): for one
// ring communicator (24 channels), and for one point-to-point peer that it sends to and receives
// from (32 channels inside a node, 2 across nodes).
int64_t nccl_ring_bytes();
int64_t nccl_peer_bytes(bool same_node);

// What a GPU of layout `l` holds outside PyTorch's caching allocator, each named with its reason:
// the CUDA context and NCCL's buffers, one set per communicator the layout uses (for a mixture of
// experts, those of its token dispatcher). Empty for the CPU.
std::vector<Allocation> outside_allocator(const PlanOptions& options, const Device& device, const ModelConfig& cfg,
                                          const Layout& l);

// The largest GPU count min_gpus tries: a bound on its doubling, four times the largest published
// training runs (Llama 3 405B: 16,384 GPUs).
inline constexpr int64_t kMinGpusSearched = 65536;
// The smallest power-of-two multiple of space.gpus (up to kMinGpusSearched) at which some layout fits, or 0.
int64_t min_gpus(const ModelConfig& cfg, SearchSpace space, const Device& device, const PlanOptions& options = {});

}  // namespace remat
