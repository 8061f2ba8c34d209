// Pieces the block kinds share (internal): each adds ops to a Builder with their tags and
// parameter roles, and returns the id of the tensor it produced.
#pragma once

#include <cstdint>
#include <string>

#include "core/builder.h"
#include "remat/block.h"

namespace remat::blocks {

using detail::Builder;

// y = x W^T (+ b) with `out` features in all. The weight starts as `init` (N(0, 0.02) by default);
// the bias at zero. Weight decay on the weight only. Under tensor parallelism (cfg.tp) a Column
// split keeps out / tp features (rounded up) over the whole sequence; a Row split takes x's local
// features and gives all `out` over the residual stream's tokens (block.h, Split).
int linear(Builder& b, const std::string& name, int x, int64_t out, uint32_t tags, const std::string& doc,
           bool bias = true, Init init = Init::Normal, Split split = Split::None);
// A bias-free, column-split linear whose weight is the model parameter `tied_to` (an LM head tied
// to "wte").
int tied_linear(Builder& b, const std::string& name, int x, int64_t out, const std::string& tied_to,
                const std::string& doc);
// LayerNorm over the last dimension: output tagged norm, mean and rstd tagged as statistics.
int layer_norm(Builder& b, const std::string& name, int x, const std::string& doc);
// RMSNorm over the last dimension, or over each group of `group` values of it (one head: Qwen3's q
// and k norms): output tagged norm, its 1/rms per token (per group) as a statistic.
int rms_norm(Builder& b, const std::string& name, int x, const std::string& doc, int64_t group = 0);
// A one-input, one-output op whose output has x's shape.
int unary(Builder& b, OpKind kind, const std::string& name, int x, uint32_t tags, const std::string& doc);
// x unchanged when cfg.dropout is 0, else "<name>_drop" = dropout(x) with its mask "<name>_mask".
// `tags` go on both (the mask also gets tag::kMask).
int dropout(Builder& b, const std::string& name, int x, uint32_t tags, const std::string& what);
// The residual add.
int add(Builder& b, const std::string& name, int x, int y, const std::string& doc);

// Where q, k and v are, for the attention ops: q of `heads` heads from column q_col of the scores
// input, k of kv heads from k_col, v of kv heads from v_col of the values input.
AttentionLayout attention_layout(const ModelConfig& cfg, bool causal, int64_t q_col, int64_t k_col, int64_t v_col);
// Core attention as cfg.attention says: scores, softmax, dropout, probs x V (math), or one fused
// op (flash). `q`, `k` and `v` hold them at the layout's columns (any of them may be one tensor, a
// fused projection). Returns atty (B, T, C).
int core_attention(Builder& b, int q, int k, int v, const AttentionLayout& layout);

}  // namespace remat::blocks
