// ModelConfig: the shape of a model and its data, shared by `remat bench`, `plan` and `train`.
//
//   remat::ModelConfig cfg;            // the seed experiment: 6 seed blocks, dim 512, batch 8, seq 128
//   cfg.arch = "llama";                // any name in remat::block_kinds(): seed, gpt2, llama, moe
//   cfg.kv_heads = 2;                  // grouped-query attention
//   remat::validate(cfg);              // throws remat::Error naming the first bad field
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace remat {

enum class DType : uint8_t { F32, BF16, F16, Bool, I64 };

enum class AttentionImpl : uint8_t {
  Math,   // scores and probabilities materialised as (B, H, T, T) tensors (causal: packed row blocks)
  Flash,  // one fused op that keeps only its output and a (B, H, T) log-sum-exp
};

// Choices of the token block kinds (gpt2, llama). Default takes the kind's own: gpt2 is GPT-2
// (LayerNorm, learned positions, GELU, biases, one qkv linear, tied head), llama is LLaMA (RMSNorm,
// rotary positions, SwiGLU, no biases, separate q/k/v linears, untied head). Any other choice makes
// the block a model people train under another name (Megatron-LM's GPT with rope and SwiGLU,
// Qwen2's biased q/k/v, ...): blocks/decoder.h builds them all.
enum class Norm : uint8_t { Default, Layer, Rms };
enum class Positions : uint8_t { Default, Learned, Rope, None };
enum class Mlp : uint8_t { Default, Gelu, Swiglu };
enum class Switch : uint8_t { Default, Off, On };

// How a mixture-of-experts router scores the experts from its logits (moe).
enum class Router : uint8_t {
  Softmax,   // softmax over all experts (Mixtral, Qwen3-MoE)
  Sigmoid,   // a sigmoid per expert (DeepSeek-V3)
  Sinkhorn,  // Megatron-LM's sinkhorn: experts chosen by Sinkhorn-balanced scores, weighted by a sigmoid
             // (top_k 1) or a softmax (top_k > 1), never divided by their sum (norm_topk is not read)
};

// Where a mixture of experts multiplies each token copy by its routing weight (moe). The same
// function (the experts' second linear has no bias), with different tensors kept for the backward.
enum class ExpertWeights : uint8_t {
  Combine,     // the experts' outputs, weighted as they are summed back into token order (Hugging
               // Face's Mixtral and Qwen3-MoE, torchtitan): the combine keeps the outputs (rows x dim)
  Activation,  // the experts' activation, before their second linear (Megatron-LM's experts.py): the
               // activation and its weighted copy are both kept (rows x ffn each)
};

// How the head computes its cross-entropy (planning bf16/fp16 models: frameworks up-cast first).
enum class Loss : uint8_t {
  Default,  // Fp32 (the model's dtype when that is fp32)
  Fp32,     // Megatron-LM's vocab-parallel cross-entropy: an fp32 copy of the logits turned into the
            // softmax in place and kept for the backward, which writes the gradient over it
  Upcast,   // PyTorch's cross_entropy(logits.float()) under autograd (torchtitan, Hugging Face): the
            // fp32 copy beside the fp32 log-probabilities in the forward, and nll_loss's and
            // log_softmax's fp32 gradients together in the backward
  Model,    // log-probabilities in the model's dtype
  Fused,    // Megatron-LM's --cross-entropy-loss-fusion (its native implementation, under torch.compile):
            // Fp32's tensors, and in the forward and in the backward one more fp32 logits tensor, the new
            // value Inductor makes before writing it over the fp32 copy (bf16 models only)
  Chunked,  // fused linear + cross-entropy over `loss_chunks` chunks of the tokens: only a chunk's
            // fp32 logits ever exist, each recomputed in the backward (torchtune, Liger)
};

struct ModelConfig {
  std::string arch = "seed";  // block kind: a name from block_kinds() (block.h)
  int64_t layers = 6;         // transformer blocks
  int64_t dim = 512;          // model width C
  int64_t heads = 8;          // attention (query) heads; must divide dim
  int64_t kv_heads = 0;       // key/value heads (grouped-query attention); 0 = heads; must divide heads
  int64_t head_size = 0;      // width of one attention head; 0 = dim / heads (Qwen3: 128 at any width)
  int64_t batch = 8;          // sequences per micro-batch B
  int64_t seq = 128;          // tokens per sequence T
  int64_t ffn = 0;            // MLP hidden width; 0 = 4 * dim
  int64_t vocab = 256;        // token models: vocabulary size (256 = bytes)
  double dropout = 0.0;       // drop probability on attention probs and both residual branches; 0 = off
  DType dtype = DType::F32;   // activations and weights
  AttentionImpl attention = AttentionImpl::Math;  // math (T x T tensors) or flash (causal blocks only)
  int64_t attn_block = 128;                       // causal math attention: query rows per stored block (block.h)
  double rope_theta = 10000;                      // llama: base of the rotary position embedding's frequencies
  double norm_eps = 1e-5;                         // epsilon of LayerNorm and RMSNorm
  // One rank of a tensor-parallel group (Megatron-LM's split; planning only, the engine runs tp 1).
  // The stages are built at that rank's shapes: attention heads, key/value heads, the MLP width and
  // the vocabulary (rounded up) divided by tp; the linears carry their column or row split. With
  // sp (sequence parallelism), the norm, dropout and residual tensors hold seq / tp tokens.
  int64_t tp = 1;
  bool sp = false;
  // One rank of a context-parallel group (planning only): it holds seq / cp tokens of every
  // activation; flash attention meets the other ranks' keys and values in a ring.
  int64_t cp = 1;
  // The block's structure (token kinds; Default = the kind's, above).
  Norm norm = Norm::Default;
  Positions positions = Positions::Default;
  Mlp mlp = Mlp::Default;
  Switch bias = Switch::Default;       // biases on every linear
  bool qkv_bias = false;               // biases on q, k and v alone (Qwen2), whatever `bias` says
  Switch tied = Switch::Default;       // the LM head is the token embedding
  Switch fused_qkv = Switch::Default;  // q, k, v from one linear (GPT-2, Megatron-LM) or three (HF Llama, torchtitan)
  Loss loss = Loss::Default;           // the cross-entropy's form (Loss above); Default: by the dtype (resolved_loss)
  int64_t loss_chunks = 8;             // Loss::Chunked: chunks of the micro-batch's tokens, 1..999999
  double rotary_fraction = 1.0;        // positions rope: the share of each head's dimensions turned (GPT-NeoX: 0.25)
  bool parallel_residual = false;      // the MLP reads the block input, not the stream after attention (GPT-NeoX)
  bool qk_norm = false;                // RMSNorm of each head of q and k before rope (Qwen3); separate q, k, v
  // Planning only (a GPU framework's step; the engine refuses it): the norms, attention and SwiGLU
  // as eager PyTorch runs them unfused (torchtitan's and Hugging Face's Llama), whose autograd
  // keeps an fp32 copy of each RMSNorm's input and its normalised value, GQA's keys and values
  // repeated to every head, and SiLU's output, beside what remat's fused ops keep (OpDef::eager_saved).
  bool eager_ops = false;
  // The mixture-of-experts block (arch moe, blocks/moe.cpp): LLaMA's attention, then a router that
  // sends each token to top_k of `experts` SwiGLU MLPs of width `ffn`, and their outputs weighted
  // back together. Ignored by the other kinds.
  int64_t experts = 8;              // routed experts E
  int64_t top_k = 2;                // experts each token goes to
  int64_t shared_ffn = 0;           // width of a shared expert every token also passes (DeepSeek, Qwen2-MoE); 0 = none
  double capacity_factor = 0;       // 0: dropless; c > 0: each expert takes ceil(c * tokens * top_k / E) rows of
                                    // each rank's tokens, and the copies past them are dropped first come,
                                    // first served in (batch, position) order (Switch; Megatron-LM's
                                    // --moe-token-drop-policy position, whose tokens come in (position,
                                    // batch) order; its default, probs, keeps the highest-weight copies
                                    // and is not modelled)
  Router router = Router::Softmax;  // moe: how scores become each token's experts (Router above)
  bool norm_topk = true;            // the top_k weights divided by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3);
                                    // not with top_k 1 under the sigmoid router, whose one weight stays its
                                    // score (Megatron-LM). A softmax top_k 1 weight is then 1, and the router
                                    // learns from the balancing loss alone (Megatron-LM's post-softmax top 1)
  double aux_loss = 0.01;           // coefficient of the load-balancing loss E * sum_e f_e P_e (Switch); 0 = off
  ExpertWeights expert_weights = ExpertWeights::Combine;  // moe: where the routing weights multiply
  // The router's logits and routing weights in fp32 whatever the model's dtype (Megatron-LM's
  // --moe-router-dtype fp32): an unfused weighted activation (GELU's) is made in fp32 and cast
  // back, and the experts' outputs cross the ranks back as an fp32 copy. Nothing changes at dtype fp32.
  bool router_fp32 = false;
  // Planning only: Megatron-LM's allgather token dispatcher (its default), which gathers the
  // tokens of the etp x ep ranks instead of exchanging rows in all-to-alls (ops/expert_parallel.h).
  bool allgather_dispatch = false;
  // Planning only (the engine refuses it): PyTorch's deterministic algorithms, as Megatron-LM's
  // --deterministic-mode turns them on. Its unpermute then sums the experts' outputs back with
  // index_add, whose backward keeps them (rows x dim), where scatter_add keeps its indices only.
  bool deterministic = false;
  // One rank of an expert-parallel group (planning only): it holds experts / ep of the experts and
  // exchanges the dispatched tokens with the group's other ranks (all-to-all), receiving as many
  // rows as it sent when routing is balanced, `expert_imbalance` times as many on the busiest rank.
  int64_t ep = 1;
  double expert_imbalance = 1.0;
  // One rank of an expert-tensor-parallel group (planning only; Megatron-LM's
  // --expert-tensor-parallel-size): each expert's first linears keep ffn / etp of its features and
  // its second linear sums over them, and the dispatch buffer holds the rows of the group's etp
  // ranks (all-gathered after the exchange, reduce-scattered before the way back). Divides tp.
  int64_t etp = 1;

  int64_t hidden() const { return ffn > 0 ? ffn : 4 * dim; }
  int64_t head_dim() const { return head_size > 0 ? head_size : dim / heads; }
  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t tokens() const { return batch * seq; }  // of the whole sequence (all context-parallel ranks)
  // One tensor-parallel rank's share (tp above).
  int64_t rank_heads() const { return heads / tp; }
  int64_t rank_kv() const { return kv() / tp; }
  int64_t rank_hidden() const { return hidden() / tp; }
  int64_t rank_vocab() const { return (vocab + tp - 1) / tp; }
  // Tokens of a sequence this rank holds: seq / cp; in the norm, dropout and residual tensors also
  // divided by tp with sp.
  int64_t local_seq() const { return seq / cp; }
  int64_t rank_seq() const { return sp ? local_seq() / tp : local_seq(); }
  // moe: rows of the dispatch buffer (tokens x top_k dropless; experts x capacity otherwise; times
  // etp, the expert-tensor-parallel group's rows) and the rows each expert takes under a capacity
  // factor (0: dropless).
  int64_t expert_capacity() const;
  int64_t dispatch_rows() const;
  int64_t rank_experts() const { return experts / ep; }
  int64_t rank_expert_hidden() const { return hidden() / etp; }  // an expert's features on one etp rank
};

// Throws remat::Error naming the first invalid field ("ModelConfig.heads ...") and what is allowed:
// sizes, the block kind and what that kind supports (blocks/kinds.cpp).
void validate(const ModelConfig& cfg);

// True for the floating-point types (those that carry gradients).
inline bool is_float(DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; }

// Bytes of one element.
inline int64_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::Bool:
      return 1;
    case DType::I64:
      return 8;
  }
  return 0;
}

// Names as used on the command line and in reports: "fp32"/"bf16"/"fp16", "math"/"flash",
// "layer"/"rms", "learned"/"rope"/"none", "gelu"/"swiglu", "fp32"/"upcast"/"model"/"fused"/"chunked:N". The parsers
// throw remat::Error naming the field and listing the allowed names.
std::string_view to_string(DType t);
std::string_view to_string(AttentionImpl a);
std::string_view to_string(Norm n);
std::string_view to_string(Positions p);
std::string_view to_string(Mlp m);
std::string_view to_string(Router r);
std::string_view to_string(ExpertWeights w);
std::string to_string(Loss l, int64_t chunks);
DType parse_dtype(std::string_view s);
AttentionImpl parse_attention(std::string_view s);
Norm parse_norm(std::string_view s);
Positions parse_positions(std::string_view s);
Mlp parse_mlp(std::string_view s);
Router parse_router(std::string_view s);
ExpertWeights parse_expert_weights(std::string_view s);
// "fp32", "upcast", "model", "fused", "chunked:N" into cfg.loss and cfg.loss_chunks.
void parse_loss(std::string_view s, ModelConfig& cfg);

// The loss as the head computes it: Default resolved by the dtype.
inline Loss resolved_loss(const ModelConfig& c) {
  return c.loss != Loss::Default ? c.loss : (c.dtype == DType::F32 ? Loss::Model : Loss::Fp32);
}

// One line, e.g. "gpt2 L=6 C=512 H=8 B=8 T=1024 fp32 V=50304 dropout=0.1".
std::string describe(const ModelConfig& cfg);

}  // namespace remat
