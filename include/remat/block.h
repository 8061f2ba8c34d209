// The tensor table: a transformer block as data.
//
// A BlockSpec is the table of every named activation of one block (name, shape, dtype, tags, the op
// that produces it, whether any backward reads it), its parameters (shape and role), and the list of
// op nodes that connect them, in forward order. Nothing else knows a size: the executor allocates
// by it, the memory model sums it, the planner searches over it. Shapes are concrete for one
// ModelConfig, in elements.
//
//   remat::BlockSpec b = remat::make_block(cfg);     // cfg.arch picks the kind: seed, gpt2, llama, moe
//   for (const remat::TensorSpec& t : b.tensors)     // "ln1 (8, 1024, 512) fp32 16.0 MiB"
//     fmt::print("{} {} {}\n", t.name, remat::shape_str(t.shape), remat::bytes_str(t.bytes()));
//
// A model is stages of the same form (ModelSpec): an optional stem (embedding), `layers` copies of
// the block, and a head (final norm, LM head, loss). Each block kind is one file in src/blocks/
// (builders for its stem, block and head); each op is one file in src/ops/. See docs/design.md,
// NOTE [Blocks as data].
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"
#include "remat/ops.h"
#include "remat/runtime.h"

namespace remat {

// What a tensor is, independent of its name, so that a preset means the same on every block kind.
namespace tag {
constexpr uint32_t kAttnCore = 1u << 0;   // the T x T tensors: scores, probabilities, their dropout
constexpr uint32_t kMlpAct = 1u << 1;     // the MLP activation output (GELU; the SwiGLU product)
constexpr uint32_t kMlpInner = 1u << 2;   // the MLP's inner tensors: first linear, activation, its mask
constexpr uint32_t kNormOut = 1u << 3;    // a normalisation's output (LayerNorm, RMSNorm)
constexpr uint32_t kNormStat = 1u << 4;   // a normalisation's per-token statistics (mean, rstd)
constexpr uint32_t kMask = 1u << 5;       // a dropout keep-mask
constexpr uint32_t kRouter = 1u << 6;     // a mixture of experts' router: logits, probabilities, top-k weights
constexpr uint32_t kExperts = 1u << 7;    // the routed experts' tensors: dispatched tokens, their MLPs, the combine
constexpr uint32_t kExpertAct = 1u << 8;  // the routed experts' activation (their SwiGLU product)
constexpr uint32_t kShared = 1u << 9;     // the shared expert's tensors
}  // namespace tag

// How attention scores and probabilities are stored, and where q, k and v are.
//
// Not causal: one (B, H, T, T) tensor. Causal: the T query rows are cut into blocks of `block` rows;
// block r keeps only the key columns [0, end of block r) that the causal mask can leave non-zero, as
// a contiguous (B, H, rows(r), cols(r)) tensor, and the blocks follow one another in one 1-D
// tensor. At T = 1024 and block = 128 that is 56% of T x T, for memory and for every op that
// touches it. Entries above the diagonal inside a block are masked (probability exactly 0).
// With a single block (T <= block) the causal layout is the plain (B, H, T, T) one.
//
// q of head h is columns [q_col + h D, q_col + (h + 1) D) of the scores op's input; k of head h is
// at k_col + (h / group) D of the same tensor, v at v_col + (h / group) D of attn_values' second
// input, where group = heads / kv_heads (grouped-query attention shares K and V).
struct AttentionLayout {
  int64_t batch = 0, heads = 0, seq = 0;
  int64_t block = 0;  // query rows per block; == seq when not causal
  bool causal = false;
  int64_t kv_heads = 0;  // heads of K and V; 0 = heads
  int64_t head_dim = 0;  // D
  int64_t q_col = 0, k_col = 0, v_col = 0;
  // Context-parallel ranks (planning): `seq` is this rank's share of the queries, and the keys and
  // values of all `ring` shares pass through in a ring (flash attention only).
  int64_t ring = 1;

  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t group() const { return heads / kv(); }
  int64_t blocks() const { return (seq + block - 1) / block; }
  int64_t first_row(int64_t r) const { return r * block; }
  int64_t rows(int64_t r) const { return std::min(block, seq - r * block); }
  int64_t cols(int64_t r) const { return causal ? first_row(r) + rows(r) : seq; }
  // Elements before block r, and in all blocks.
  int64_t offset(int64_t r) const;
  int64_t numel() const { return offset(blocks()); }
  // (B, H, T, T) for one block, (numel) for several.
  std::vector<int64_t> shape() const;
};

// How the mixture-of-experts ops route tokens (route, dispatch, combine; blocks/moe.cpp).
struct Routing {
  int64_t experts = 0;         // E
  int64_t top_k = 0;           // experts per token
  int64_t capacity = 0;        // rows each expert takes (ModelConfig::expert_capacity()); 0: dropless
  bool sigmoid = false;        // scores: a sigmoid per expert, else a softmax over them
  bool normalize = true;       // the top_k weights divided by their sum
  double aux_loss = 0;         // coefficient of the load-balancing loss, whose gradient route's backward adds
  int64_t ep = 1;              // expert-parallel ranks (planning): dispatch and combine exchange their rows
  bool sinkhorn = false;       // experts chosen by scores balanced over the experts (Sinkhorn-Knopp, Megatron-LM's
                               // sinkhorn router), not by the probabilities; the weights are probabilities still
  bool deterministic = false;  // planning: unpermute as PyTorch's deterministic index_add (ModelConfig::deterministic)
  bool fp32_return = false;    // planning: fp32 routing weights on a half-precision model (ModelConfig::router_fp32)
  bool allgather = false;      // planning: Megatron-LM's allgather token dispatcher (ModelConfig::allgather_dispatch)
  int64_t etp = 1;             // expert-tensor-parallel ranks (planning): the dispatch buffer holds their rows,
                               // all-gathered after the exchange and reduce-scattered before the way back

  bool exchanges() const { return ep > 1 || etp > 1; }  // dispatch and combine move rows between ranks
};

struct TensorSpec {
  std::string name;            // unique in the block: "x", "ln1", "probs", ...
  std::vector<int64_t> shape;  // elements per dimension
  DType dtype = DType::F32;
  int producer = -1;              // index of the op that produces it; -1 for a block input
  bool read_by_backward = false;  // false: transient, freed after its last forward use
  uint32_t tags = 0;              // tag:: bits
  std::string doc;                // one line for reports: "attention probabilities"

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t bytes() const { return numel() * dtype_size(dtype); }
};

// How a parameter starts.
enum class Init : uint8_t {
  Zeros,
  Ones,
  Normal,          // N(0, std)
  ResidualNormal,  // N(0, std / sqrt(2 * layers)): GPT-2's scaling of the residual projections
};

struct ParamSpec {
  std::string name;  // unique in its stage: "qkv.weight"
  std::vector<int64_t> shape;
  Init init = Init::Normal;
  double std = 0.02;    // Normal, ResidualNormal
  bool decay = true;    // AdamW's weight decay applies (matrices), or not (biases, norms)
  std::string tied_to;  // non-empty: this is the model parameter of that name (the LM head
                        // tied to the stem's "wte"), not a parameter of its own
  bool expert = false;  // a routed expert's: sharded over the expert-data-parallel ranks

  int64_t numel() const;
};

// How an op is split over the ranks of a tensor-parallel group (Megatron-LM; ModelConfig.tp). A
// stage of a tensor-parallel config is one rank's: its tensors and parameters are the rank's shards.
enum class Split : uint8_t {
  None,    // every rank holds and computes all of it
  Column,  // linear: the output features are split, the input is whole; the backward all-reduces dx
           // (with sp: the input is all-gathered along the sequence, forward and again in backward,
           // the gathered copy a transient, and dx is reduce-scattered)
  Row,     // linear: the input features are split; the output is all-reduced (with sp:
           // reduce-scattered along the sequence, and dy all-gathered in backward)
  Vocab,   // embedding and cross-entropy: the vocabulary is split; the embedding's output is reduced
           // like Row's, the loss's maximum and sum are all-reduced per token
};

struct TensorParallel {
  Split split = Split::None;
  int64_t ranks = 1;  // ModelConfig.tp
  bool seq = false;   // ModelConfig.sp

  bool active() const { return ranks > 1 && split != Split::None; }
};

struct OpNode {
  OpKind kind;
  std::string name;         // "qkv", "probs_drop", ...
  std::vector<int> in;      // tensor ids, as the op's definition orders them
  std::vector<int> out;     // tensor ids
  std::vector<int> params;  // parameter ids of the stage
  double p = 0.0;           // dropout: drop probability
  double eps = 0.0;         // norms: epsilon
  double theta = 0.0;       // rotary embedding: frequency base
  AttentionLayout attn;     // attention ops: heads, causal mask, storage
  int64_t in_col = 0;       // rope: the columns of its input it turns, [in_col, in_col + in_width)
  int64_t in_width = 0;     //   (q and k of a fused qkv projection); 0: all of them
  int64_t chunks = 0;       // chunked_cross_entropy: chunks of the tokens it runs one at a time
  bool upcast = false;      // cross_entropy on bf16/fp16 logits: PyTorch's autograd of logits.float()
  bool compiled = false;    // cross_entropy as Megatron-LM's fused one under torch.compile (Loss::Fused)
  bool eager = false;       // planning: run unfused by eager PyTorch (ModelConfig::eager_ops, OpDef::eager_saved)
  int64_t rotary_dims = 0;  // rope: the leading dimensions of each head it turns; 0: all (attn.head_dim)
  Routing routing;          // route, dispatch: the mixture of experts' routing
  TensorParallel tp;        // how the op is split over tensor-parallel ranks
};

struct BlockSpec {
  std::string kind;                 // "seed", "gpt2", "gpt2.stem", "gpt2.head", "llama.logits", ...
  DType dtype = DType::F32;         // activations and parameters
  std::vector<TensorSpec> tensors;  // the table; index = tensor id
  std::vector<OpNode> ops;          // forward order
  std::vector<ParamSpec> params;
  std::vector<int> inputs;  // tensor ids of the inputs (always kept): x; or x, targets
  int output = -1;          // tensor id of the output: y, logits, or the loss

  // Tensor id by name, or -1.
  int find(std::string_view name) const;
  bool is_input(int tensor) const;
  // Position of `tensor` in `inputs`, or -1.
  int input_index(int tensor) const;
  // Tensor ids a policy may save or recompute: read by some backward, not an input.
  std::vector<int> choosable() const;
  // Tensor ids that the backward of op `op` reads, from its definition.
  std::vector<int> bwd_reads(int op) const;
  // Matmul FLOPs of op `op`, and of all ops.
  OpFlops flops(int op) const;
  OpFlops flops() const;
  // Bytes op `op` allocates and frees inside one call, beyond its outputs (forward) or beyond the
  // gradients of its inputs and parameters (backward): temporaries such as an unreduced loss.
  // Some depend on the threads (LibTorch's LayerNorm backward and flash attention keep a buffer
  // per thread).
  int64_t forward_scratch(int op, const ThreadConfig& ctx) const;
  int64_t backward_scratch(int op, const ThreadConfig& ctx) const;
  // Planning: bytes eager PyTorch's autograd keeps beside op `op`'s saved tensors while its first
  // output lives (OpNode::eager); 0 for the engine's ops.
  int64_t eager_saved(int op) const;
  // Bytes op `op` sends over its tensor-parallel group (ring collectives), or over its
  // expert-parallel group (all-to-all), forward and backward.
  OpComm comm(int op) const;
  // Bytes of parameter `param` (and of its gradient).
  int64_t param_bytes(int param) const;
  // Elements in all parameters (tied ones included).
  int64_t param_numel() const;
  // Comma-separated names of choosable tensors (for error messages).
  std::string choosable_names() const;
};

// A whole model as stages.
struct ModelSpec {
  std::string arch;
  bool has_stem = false;  // token models: tokens -> embedding; seed: the data is the first input
  BlockSpec stem;
  BlockSpec block;   // repeated `layers` times
  BlockSpec head;    // final norm, LM head, cross-entropy; seed: MSE
  BlockSpec logits;  // the head without its loss (sampling); empty kind when the arch has none
  int64_t layers = 0;

  // Matmul FLOPs of one forward + backward of the whole model, as a step computes them: recompute
  // not counted, nor the input gradients of the first block when there is no stem (the data needs
  // none).
  int64_t step_flops() const;
  // Elements of all distinct parameters (a tied parameter counts once).
  int64_t param_numel() const;
};

// The registered block kinds, in the order `--arch` lists them: "seed", "gpt2", "llama", "moe".
std::vector<std::string> block_kinds();
// Whether a kind routes tokens to experts (moe): ModelConfig.ep and Layout.ep apply to it.
bool routes_experts(std::string_view kind);
// Whether a kind's attention is causal (gpt2, llama, moe): only those run flash attention.
bool attends_causally(std::string_view kind);
// A one-line description of a kind, for --help.
std::string block_kind_doc(std::string_view kind);
// cfg with each choice it leaves Default (norm, positions, mlp, bias, tied, qkv, loss) set to the
// one its kind builds: two configs of one kind that agree here build the same blocks. A kind that
// takes no choices (seed) keeps cfg's. Throws remat::Error for an unknown cfg.arch.
ModelConfig with_choices_resolved(const ModelConfig& cfg);
// The block of cfg.arch at cfg's sizes. Throws remat::Error when validate(cfg) does.
BlockSpec make_block(const ModelConfig& cfg);
// The whole model of cfg.arch. Throws remat::Error when validate(cfg) does.
ModelSpec make_model(const ModelConfig& cfg);

}  // namespace remat
