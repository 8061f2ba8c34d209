// What a GPU training framework allocates beyond the model's tensors (layout.h, Framework). Each
// term is one named allocation with the code that makes it; docs/planner.md lists the sources.
#include <algorithm>

#include <fmt/format.h>

#include "remat/block.h"
#include "remat/error.h"
#include "remat/layout.h"

namespace remat {

std::string_view to_string(Framework f) { return f == Framework::Megatron ? "megatron" : "torchtitan"; }

bool allgather_dispatch(const PlanOptions& o, const Device& d) {
  return o.framework == Framework::Megatron && o.allgather_dispatch && !d.engine;
}

Framework parse_framework(std::string_view text) {
  if (text == "megatron") return Framework::Megatron;
  if (text == "torchtitan") return Framework::Torchtitan;
  fail("unknown PlanOptions.framework '{}'; allowed: megatron (Megatron-LM with Transformer Engine), torchtitan", text);
}

namespace {

constexpr int64_t MiB = int64_t{1} << 20;

// PyTorch's cuBLAS workspaces, allocated through the caching allocator at the first GEMM of each
// cuBLAS handle and stream, and kept (aten/src/ATen/cuda/CublasHandlePool.cpp,
// getChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG when set, else 4096 KiB x 8 on compute
// capability 9.x to 12.x (Hopper and Blackwell; PyTorch 2.x before them gave it to 9.0 alone) and
// 4096 KiB x 2 + 16 KiB x 8 elsewhere. Handles are per thread, and the backward runs on
// autograd's own device thread: two workspaces (the forward's and the backward's; seen as two
// blocks of the size on an H200, tools/gpu_memory.py --trace).
Allocation torch_cublas(const PlanOptions& o, const Device& d) {
  const int64_t bytes = o.cublas_workspace > 0     ? o.cublas_workspace
                        : d.sm >= 90 && d.sm < 130 ? 8 * 4 * MiB
                                                   : 2 * 4 * MiB + 8 * 16 * 1024;
  return {"cuBLAS workspaces (PyTorch)", 2 * bytes,
          "PyTorch's workspace for its cuBLAS GEMMs, one per thread that runs them (the forward's, autograd's "
          "backward thread), kept from the first GEMM on"};
}

// Whether the block turns q and k by rotary embeddings (its kind's default or ModelConfig::positions).
bool turns_positions(const ModelConfig& c) {
  const ModelSpec m = make_model(c);
  return std::any_of(m.block.ops.begin(), m.block.ops.end(), [](const OpNode& op) { return op.kind == OpKind::Rope; });
}

}  // namespace

std::vector<Allocation> fixed_allocations(const PlanOptions& o, const Device& d, const ModelConfig& c, const Layout& l,
                                          int stage) {
  if (d.engine) return {};  // remat's own trainer: the memory model replays all of it
  const bool first = stage == 0, last = stage == l.pp - 1;
  const ModelConfig rank = rank_config(c, l);
  const int64_t tokens = rank.batch * rank.local_seq();  // a rank's tokens of one micro-batch
  std::vector<Allocation> out;
  out.push_back(torch_cublas(o, d));
  if (o.framework == Framework::Megatron) {
    const int64_t te_workspace = d.sm >= 90 ? 32 * MiB : 4 * MiB;
    out.push_back({"cuBLAS workspace (Transformer Engine)", te_workspace,
                   "Transformer Engine's own workspace for its GEMMs (module/base.py get_workspace)"});
    // A mixture of experts' grouped GEMM (--moe-grouped-gemm, TE GroupedLinear) runs its experts on
    // 4 streams, each with a workspace of its own, 1 KiB over the size, cached from the first call
    // (transformer_engine/pytorch/cpp_extensions/gemm.py, common/util/multi_stream.cpp).
    if (routes_experts(c.arch) && o.grouped_gemm)
      out.push_back({"cuBLAS workspaces (grouped GEMM, Transformer Engine)", 4 * (te_workspace + 1024),
                     "Transformer Engine's workspaces for the experts' grouped GEMM, one per stream of 4"});
    // The default token dispatcher (allgather) gathers the tokens of the expert-tensor- and
    // expert-parallel group (etp x ep ranks, each with its seq / tp share under sequence
    // parallelism) into one buffer from Megatron's global memory buffer, kept from the first
    // layer's dispatch on and reused by every layer (token_dispatcher.py, use_global_buffer=True;
    // parallel_state.py GlobalMemoryBuffer).
    const int64_t group = l.ep * l.etp;
    if (routes_experts(c.arch) && group > 1 && allgather_dispatch(o, d))
      out.push_back({"gathered tokens (allgather dispatcher)",
                     rank.batch * rank.rank_seq() * group * c.dim * dtype_size(c.dtype),
                     "the expert-parallel group's tokens in the global memory buffer the dispatcher gathers "
                     "them into, kept"});
    // megatron/core/utils.py get_batch_on_this_tp_rank: the first stage gets tokens and position
    // ids (int64), the last labels (int64) and the loss mask (fp32), both the attention mask.
    int64_t batch = 0;
    if (first) batch += 2 * 8 * tokens;
    if (last) batch += (8 + 4) * tokens;
    if (o.batch_mask && (first || last)) batch += l.micro_batch * c.seq * c.seq;
    out.push_back({"micro-batch", batch,
                   fmt::format("tokens and positions (first stage), labels and loss mask (last stage){} of the "
                               "micro-batch in flight, on every tensor-parallel rank",
                               o.batch_mask ? ", the bool attention mask (both)" : "")});
  } else {
    out.push_back({"micro-batch", (first ? 8 * tokens : 0) + (last ? 8 * tokens : 0),
                   "input ids (first stage) and labels (last stage) of the micro-batch in flight, int64"});
    // torchtitan's Llama registers freqs_cis, complex64 (seq, head_dim / 2), as a buffer of the
    // model: on every pipeline stage, whole (buffers are not sharded).
    if (turns_positions(c))
      out.push_back(
          {"RoPE table", c.seq * (c.head_dim() / 2) * 8,
           "torchtitan's freqs_cis buffer: a complex64 rotation for each position and pair of a head's dims"});
  }
  return out;
}

// The CUDA context with the kernels a training step loads (cuBLAS, attention, the optimizer's, a
// one-rank NCCL communicator's): the bytes a GPU held outside PyTorch's allocator after a
// torchtitan Llama step on one H200 with PyTorch 2.11 and CUDA 13, the same in every run of
// validation/h200.json (8 and 70B shapes, 1 to 4 micro-batches). `make validate` fails a plan that
// counts less. The context alone is smaller (287-430 MB with lazy module loading:
// pytorch/pytorch#86509, #109888). Not measured here: other GPUs and CUDA versions, Megatron-LM
// with Transformer Engine, and NCCL's kernels on several ranks; where they hold less the term
// leaves the allocator less than it could have, and where they hold more it is short.
constexpr int64_t kCudaContextBytes = 1372389376;

// NCCL's buffers, as NCCL 2.22 and later allocate them (NVIDIA/nccl src/transport/p2p.cc, at
// v2.22.3-1 and v2.27.7-1): a connection between two GPUs of a node is one allocation rounded up
// to 2 MiB (CUDA_IPC_MIN). The receiving side holds the LL (512 KiB), LL128 (4915200 B) and SIMPLE
// (4 MiB, NCCL_BUFFSIZE) buffers with a 4 KiB header: 10 MiB; the sending side its header: 2 MiB.
// (On A100, NCCL's "read" mode moves SIMPLE's buffer to the sender: 6 + 6 MiB.) A ring channel
// receives from one neighbour and sends to the other, and a point-to-point channel to a peer that
// both sends and receives holds both ends: 12 MiB a channel either way.
constexpr int64_t kNcclChannelBytes = 12 * MiB;
// A ring communicator's channels: 24 on an 8-GPU NVSwitch node (NCCL's own log on 8 x H100, "24
// coll channels"; src/graph/search.cc's speed array for sm90 gives 6, doubled by
// ncclTopoDupChannels and again in src/graph/connect.cc). Counted the same for a ring across nodes,
// whose channels follow its network cards (not modelled).
constexpr int64_t kNcclRingChannels = 24;
// Point-to-point channels per peer: 32 inside an NVLink node (src/graph/paths.cc,
// ncclTopoGetNchannels, capped at NCCL_MAX_P2P_NCHANNELS and a power of two: the log's "32 p2p
// channels per peer"), all connected on the first send or receive (src/enqueue.cc); 2 across nodes
// (NCCL_NCHANNELS_PER_NET_PEER), counted at the NVLink connections' size (the network transport's
// own buffers are not modelled). NVIDIA/nccl#1685: an all-to-all of 8 H100s held 3.28 GB more
// after its first call; 7 peers here count 2.82 GB.
constexpr int64_t kNcclNodePeerChannels = 32, kNcclNetPeerChannels = 2;

int64_t nccl_ring_bytes() { return kNcclRingChannels * kNcclChannelBytes; }

int64_t nccl_peer_bytes(bool same_node) {
  return (same_node ? kNcclNodePeerChannels : kNcclNetPeerChannels) * kNcclChannelBytes;
}

namespace {

// Along a line of `line` ranks `apart` GPUs from one another, in nodes of `per_node` GPUs: the
// most other members of the line one rank has in its own node. A node holds ceil(per_node / apart)
// of them where the line starts at its first GPU.
int64_t members_in_node(int64_t apart, int64_t line, int64_t per_node) {
  return std::min(line, (per_node + apart - 1) / apart) - 1;
}

// Of a rank's two neighbours on such a line (the one before it and the one after), the most in its
// own node: both where the three fit in a node (2 apart + 1 GPUs), one where two do.
int64_t neighbours_in_node(int64_t apart, int64_t line, int64_t per_node) {
  return std::min(line - 1, 2 * apart < per_node ? int64_t{2} : apart < per_node ? int64_t{1} : int64_t{0});
}

// The NCCL buffers of `peers` point-to-point peers, `in_node` of them (at most) in the rank's node.
int64_t peer_bytes(int64_t peers, int64_t in_node) {
  in_node = std::min(peers, in_node);
  return in_node * nccl_peer_bytes(true) + (peers - in_node) * nccl_peer_bytes(false);
}

}  // namespace

std::vector<Allocation> outside_allocator(const PlanOptions& o, const Device& d, const ModelConfig& c,
                                          const Layout& l) {
  if (d.engine) return {};
  std::vector<Allocation> out;
  out.push_back({"CUDA context", kCudaContextBytes, "the driver's context and the kernels a step loads"});
  const int64_t ring = nccl_ring_bytes();
  auto nccl = [&](const char* group, int64_t ranks, int64_t bytes) {
    if (ranks > 1)
      out.push_back({fmt::format("NCCL buffers ({})", group), bytes, "allocated by NCCL for its channels"});
  };
  nccl("tensor-parallel group", l.tp, ring);
  nccl("context-parallel group", l.cp, ring);
  nccl("data-parallel group", l.shards(), ring);
  // Optimizer instances (megatron/core/parallel_state.py): the gradients reduce-scattered and the
  // weights gathered within an instance, the shards all-reduced across the instances, over one
  // group for the dense parameters and the experts alike.
  if (l.optimizer_instances > 1) {
    nccl("distributed optimizer instance", l.optimizer_shards(), ring);
    nccl("across optimizer instances", l.optimizer_instances, ring);
  }
  // Pipeline sends and receives with the neighbouring stages, tp x cp x dp ranks apart (two, or one
  // when pp is 2), on the stage with the most of them in its node (neighbours_in_node). The first
  // and last stage of a pipeline without virtual stages have one neighbour: counted as the others,
  // on the safe side.
  nccl("pipeline neighbours", l.pp,
       peer_bytes(std::min<int64_t>(2, l.pp - 1), neighbours_in_node(l.tp * l.cp * l.dp, l.pp, d.gpus_per_node)));
  // A word embedding tied to the head across the first and last stage: Megatron-LM all-reduces its
  // gradient over the embedding group (parallel_state.py, _EMBEDDING_GROUP), a communicator of its
  // own (counted on every stage, on the safe side).
  if (l.pp > 1 && with_choices_resolved(c).tied == Switch::On) nccl("tied embedding group", 2, ring);
  if (!routes_experts(c.arch)) return out;
  // A mixture of experts (Megatron-LM's groups; every process group is one NCCL communicator):
  // both token dispatchers gather over the etp x ep ranks (the allgather dispatcher its tokens,
  // the alltoall one its token counts); the alltoall dispatcher's all-to-all is a send and a
  // receive to every other rank of the expert-parallel group (etp apart: those in the same node
  // over NVLink, the rest across nodes) and its gather over the expert-tensor-parallel ranks a
  // ring. The experts' gradients are reduced over a ring of their own when they are sharded unlike
  // the dense parameters (ep > 1, or etp other than tp).
  nccl("expert- and expert-tensor-parallel group", l.ep * l.etp, ring);
  if (!allgather_dispatch(o, d)) {
    nccl("expert-parallel all-to-all", l.ep, peer_bytes(l.ep - 1, members_in_node(l.etp, l.ep, d.gpus_per_node)));
    nccl("expert-tensor-parallel group", l.etp, ring);
  }
  if (l.ep > 1 || l.etp != l.tp) {
    nccl("expert-data-parallel group", l.expert_shards(), ring);
    if (l.optimizer_instances > 1) nccl("experts' distributed optimizer instance", l.expert_optimizer_shards(), ring);
  }
  return out;
}

}  // namespace remat
