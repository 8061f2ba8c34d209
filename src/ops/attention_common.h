// Shared by the attention ops (internal): q, k and v as strided views of the tensors that hold
// them, the causal row blocks of an AttentionLayout, and dense <-> packed conversion for tests.
//
// Heads are viewed five-dimensional, (B, KV, G, T, D) with G = heads / kv_heads query heads per key
// and value head: q of head kv * G + g is [b, kv, g], and k and v are expanded over G (stride 0), so
// one batched GEMM covers multi-head and grouped-query attention alike. A gradient written through
// an expanded view is accumulated over g in a fixed order.
#pragma once

#include <functional>
#include <initializer_list>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"

namespace remat::ops::attention {

// q of every head as (B, KV, G, T, D), from columns q_col.. of `src` (B, T, W).
at::Tensor q_view(const at::Tensor& src, const AttentionLayout& l);
// k or v (from columns `col`..) as (B, KV, G, T, D), expanded over G.
at::Tensor kv_view(const at::Tensor& src, int64_t col, const AttentionLayout& l);
// A (B, T, H D) tensor (the attention output, heads merged) as (B, KV, G, T, D).
at::Tensor heads_view(const at::Tensor& btc, const AttentionLayout& l);
// Block r of a scores/probs tensor as (B, KV, G, rows, cols).
at::Tensor block_view(const at::Tensor& packed, const AttentionLayout& l, int64_t r);
// 1 / sqrt(D).
double scale(const AttentionLayout& l);
// Sets the entries above the causal diagonal of block r to the lowest finite value (its exp
// underflows to exactly 0, and the fast softmax never meets an infinity).
void mask_block(at::Tensor& block, const AttentionLayout& l, int64_t r);

// The products of the attention ops head by head (NOTE [The engine's GEMMs], 5): true when they
// can run on remat's own GEMM (util/gemm.h) on these CPU float32 tensors, whose last dimension
// is contiguous.
bool head_products(std::initializer_list<const at::Tensor*> tensors);
// For tests: while one is alive, head_products answers false, so float32 takes the batched path
// (the two must give the same bits). Not for use while an op runs on another thread.
struct BatchedPathForTests {
  BatchedPathForTests();
  ~BatchedPathForTests();
  BatchedPathForTests(const BatchedPathForTests&) = delete;
  BatchedPathForTests& operator=(const BatchedPathForTests&) = delete;
};
// Runs fn(b, kv) for every (batch, key/value head) on the kernel threads, one task each: a task
// runs the products of that key/value head's query heads, so the head's operands, copied once into
// the task's buffers, serve all its causal row blocks from cache.
void for_each_kv_head(const AttentionLayout& l, const std::function<void(int64_t b, int64_t kv)>& fn);
// Copies `rows` rows of `width` floats, `ld` apart in src, one after the other into dst.
void pack_rows(const float* src, int64_t ld, int64_t rows, int64_t width, float* dst);
// Where block r's (rows x cols) matrix of query head h (0 <= h < heads) of batch entry b starts
// in a packed scores/probs tensor: elements before it.
int64_t matrix_offset(const AttentionLayout& l, int64_t r, int64_t b, int64_t h);
// Sets the entries above the causal diagonal of one (rows x cols) matrix of block r to the lowest
// finite float.
void mask_matrix(float* s, const AttentionLayout& l, int64_t r);

// For references (tests): the blocks of a packed tensor as differentiable (B, H, rows, cols) views,
// and the packed tensor made from such blocks.
std::vector<at::Tensor> blocks_of(const at::Tensor& packed, const AttentionLayout& l);
at::Tensor pack_blocks(const std::vector<at::Tensor>& blocks, const AttentionLayout& l);
// q, k or v of `heads` heads from columns `col`.. of src (B, T, W), as (B, heads, T, D), for
// references.
at::Tensor heads_of(const at::Tensor& src, int64_t col, int64_t heads, const AttentionLayout& l);

// Matmul FLOPs of scores or attn_values: one multiply-add per stored score per head dimension.
OpFlops flops(const BlockSpec& spec, const OpNode& node);

}  // namespace remat::ops::attention
