// ModelConfig: the shape of a model and its data, shared by `remat bench`, `plan` and `train`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace remat {

enum class Arch : uint8_t {
  Seed,  // the seed note's block: multi-head attention + Linear/ReLU/Linear FFN, residuals, no norm
  Gpt2,  // GPT-2: pre-LayerNorm, causal attention, GELU MLP, optional dropout
};

enum class DType : uint8_t { F32, BF16, F16, Bool, I64 };

enum class AttentionImpl : uint8_t {
  Math,   // scores and probabilities materialised as (B, H, T, T) tensors
  Flash,  // fused kernel: keeps only the output and a (B, H, T) log-sum-exp (CUDA, LibTorch 2.x)
};

struct ModelConfig {
  Arch arch = Arch::Seed;
  int64_t layers = 6;         // transformer blocks
  int64_t dim = 512;          // model width C
  int64_t heads = 8;          // attention heads; dim must be divisible by heads
  int64_t batch = 8;          // sequences per micro-batch B
  int64_t seq = 128;          // tokens per sequence T
  int64_t ffn = 0;            // MLP hidden width; 0 = 4 * dim
  int64_t vocab = 256;        // gpt2: vocabulary size (256 = bytes)
  double dropout = 0.0;       // gpt2: drop probability on attention probs and both residual branches
  DType dtype = DType::F32;   // activations and weights
  AttentionImpl attention = AttentionImpl::Math;
  int64_t attn_block = 128;   // causal attention: query rows per block (block.h, AttentionLayout)

  int64_t hidden() const { return ffn > 0 ? ffn : 4 * dim; }
  int64_t head_dim() const { return dim / heads; }
  int64_t tokens() const { return batch * seq; }
};

// Throws remat::Error naming the first invalid field and the allowed range.
void validate(const ModelConfig& cfg);

// Bytes of one element.
int64_t dtype_size(DType t);

// Names as used on the command line and in reports: "seed"/"gpt2", "fp32"/"bf16"/"fp16",
// "math"/"flash". The parsers throw remat::Error listing the allowed names.
std::string_view to_string(Arch a);
std::string_view to_string(DType t);
std::string_view to_string(AttentionImpl a);
Arch parse_arch(std::string_view s);
DType parse_dtype(std::string_view s);
AttentionImpl parse_attention(std::string_view s);

// One line, e.g. "gpt2 L=6 C=512 H=8 B=8 T=1024 fp32 dropout=0.1".
std::string describe(const ModelConfig& cfg);

}  // namespace remat
