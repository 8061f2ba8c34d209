// A transformer block as data.
//
// A BlockSpec is the table of every named activation of one block (name, shape, dtype, the op that
// produces it, whether any backward reads it) and the list of op nodes that connect them, in
// forward order. Nothing else knows a size: the executor allocates by it, the memory report sums
// it, the planner searches over it. Shapes are concrete for one ModelConfig, in elements.
//
//   BlockSpec b = make_block(cfg);               // cfg.arch picks the kind: seed or gpt2
//   for (const TensorSpec& t : b.tensors)        // "ln1 (8, 1024, 512) fp32 2.0 MiB"
//     fmt::print("{} {} {}\n", t.name, t.shape, t.bytes());
//
// Adding a kind (say llama: RMSNorm, RoPE, SwiGLU) means adding its ops to OpKind (with their
// forward/backward pair in src/ops/) and a builder function in block.cpp; the executor and planner
// read only this table.
//
// A whole model is stages of the same form (ModelSpec): an optional stem (token + position
// embedding), `layers` copies of the block, and a head (final norm, LM head, cross-entropy; or MSE
// for the seed model). The executor runs all three the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"

namespace remat {

enum class OpKind : uint8_t {
  Linear,      // y = x W^T + b                      in: x         out: y
  LayerNorm,   // y = (x - mean) * rstd * w + b      in: x         out: y, mean, rstd
  Gelu,        // y = gelu_tanh(x)                   in: x         out: y
  Relu,        // y = max(x, 0)                      in: x         out: y
  DropoutMask, // keep-mask from a seed               in: (none)    out: mask
  Dropout,     // y = x * mask / (1 - p)             in: x, mask   out: y
  Scores,      // s = q k^T / sqrt(D) (+ causal)     in: qkv       out: scores   (B, H, T, T)
  Softmax,     // p = softmax(s, -1)                 in: scores    out: probs
  AttnValues,  // a = p v, heads merged              in: probs, qkv  out: atty   (B, T, C)
  Add,         // y = a + b                          in: a, b      out: y
  Embedding,   // x = wte[tokens] + wpe[0:T]         in: tokens    out: x
  CrossEntropy,// loss = mean -log softmax(z)[t]     in: logits, targets  out: loss, logp
  MseLoss,     // loss = mean (y - t)^2              in: y, target out: loss
  FlashAttention,  // fused core attention             in: qkv       out: atty, lse (B, H, T)
  Count,
};

// How an op's backward produces the gradient of one input (the memory model replays this).
enum class GradKind : uint8_t {
  None,   // no gradient: masks, token ids, targets
  Fresh,  // a new tensor the size of the input
  Alias,  // the output's gradient itself, passed through (residual add): no new memory
  Slot,   // written in place into the input's gradient; the first writer allocates it zeroed
  // Written over the output's gradient dy when this op holds dy's only reference (the op made
  // dy's slot, nothing shares it); otherwise Fresh. Pointwise ops: gelu, relu, dropout, softmax.
  OverDy,
  // Written over the input itself when this backward is the input's last reader (the schedule
  // frees it right after: Step::last_read); otherwise Fresh. attn_values over probs.
  OverInput,
};

// What one kind of op consumes, produces, and keeps for its backward. One row per OpKind.
struct OpInfo {
  const char* name;
  int n_in;
  int n_out;
  int n_params;
  unsigned bwd_reads_in;   // bit i set: the backward reads input i
  unsigned bwd_reads_out;  // bit i set: the backward reads output i
  GradKind grad_in[2];     // per input
};
const OpInfo& op_info(OpKind kind);

// How attention scores and probabilities are stored.
//
// Not causal: one (B, H, T, T) tensor. Causal: the T query rows are cut into blocks of `block` rows;
// block r keeps only the key columns [0, end of block r) that the causal mask can leave non-zero, as
// a contiguous (B, H, rows(r), cols(r)) tensor, and the blocks follow one another in one 1-D
// tensor. At T = 1024 and block = 128 that is 56% of T x T, for memory and for every op that
// touches it. Entries above the diagonal inside a block are masked (-inf scores, 0 probabilities).
// With a single block (T <= block) the causal layout is the plain (B, H, T, T) one.
struct AttentionLayout {
  int64_t batch = 0, heads = 0, seq = 0;
  int64_t block = 0;       // query rows per block; == seq when not causal
  bool causal = false;

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
AttentionLayout attention_layout(const ModelConfig& cfg, bool causal);

struct TensorSpec {
  std::string name;             // unique in the block: "x", "ln1", "probs", ...
  std::vector<int64_t> shape;   // elements per dimension
  DType dtype = DType::F32;
  int producer = -1;            // index of the op that produces it; -1 for a block input
  bool read_by_backward = false;  // false: transient, freed after its last forward use
  std::string doc;              // one line for reports: "attention probabilities"

  int64_t numel() const;
  int64_t bytes() const;
};

struct ParamSpec {
  std::string name;             // "qkv.weight"
  std::vector<int64_t> shape;
};

struct OpNode {
  OpKind kind;
  std::string name;             // "qkv", "attn.drop", ...
  std::vector<int> in;          // tensor ids, as OpInfo orders them
  std::vector<int> out;         // tensor ids
  std::vector<int> params;      // parameter ids (Linear: weight[, bias]; LayerNorm: weight, bias)
  double p = 0.0;               // DropoutMask, Dropout: drop probability
  AttentionLayout attn;         // Scores, Softmax, AttnValues: heads, causal mask, storage
};

// Matmul FLOPs of one op (2 per multiply-add); other ops count 0.
struct OpFlops {
  int64_t forward = 0;
  int64_t backward = 0;
};

struct BlockSpec {
  std::string kind;                  // "seed", "gpt2", "gpt2.stem", "gpt2.head", "seed.head"
  DType dtype = DType::F32;          // activations and parameters
  std::vector<TensorSpec> tensors;   // the table; index = tensor id
  std::vector<OpNode> ops;           // forward order
  std::vector<ParamSpec> params;
  std::vector<int> inputs;           // tensor ids of the inputs (always kept): x; or x, targets
  int output = -1;                   // tensor id of the output: y, or the loss

  // Tensor id by name, or -1.
  int find(std::string_view name) const;
  bool is_input(int tensor) const;
  // Tensor ids a policy may save or recompute: read by some backward, not an input.
  std::vector<int> choosable() const;
  // Tensor ids that the backward of op `op` reads, from op_info().
  std::vector<int> bwd_reads(int op) const;
  // Matmul FLOPs of op `op`.
  OpFlops flops(int op) const;
  // Bytes op `op` allocates and frees inside one call, beyond its outputs (forward) or beyond the
  // gradients of its inputs and parameters (backward): LibTorch temporaries such as an unreduced
  // loss. Checked against the tracker by the memory-model tests.
  // `aten_threads`: LibTorch's CPU LayerNorm backward keeps a (2, threads, C) buffer.
  int64_t forward_scratch(int op) const;
  int64_t backward_scratch(int op, int aten_threads) const;
  // Bytes of parameter `param`'s gradient.
  int64_t param_bytes(int param) const;
  // Sum over all ops.
  OpFlops flops() const;
  // Elements in all parameters.
  int64_t param_numel() const;
  // Comma-separated names of choosable tensors (for error messages).
  std::string choosable_names() const;
};

// The block of cfg.arch at cfg's sizes. REQUIRES: validate(cfg) passes.
BlockSpec make_block(const ModelConfig& cfg);

// A whole model as stages.
struct ModelSpec {
  bool has_stem = false;  // gpt2: tokens -> embedding (-> dropout); seed: the data is the input
  BlockSpec stem;
  BlockSpec block;        // repeated cfg.layers times
  BlockSpec head;         // gpt2: final LayerNorm, LM head tied to wte, cross-entropy; seed: MSE
  int64_t layers = 0;

  // Matmul FLOPs of one forward + backward of the whole model (recompute not counted).
  int64_t step_flops() const;
};
ModelSpec make_model(const ModelConfig& cfg);

// "(8, 128, 512)".
std::string shape_str(const std::vector<int64_t>& shape);
// "2.0 MiB", "512 B", "1.50 GiB".
std::string bytes_str(int64_t bytes);

}  // namespace remat
