#include "ops/attention_common.h"

#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>

#include "util/gemm.h"
#include "util/parallel.h"

namespace remat::ops::attention {

at::Tensor q_view(const at::Tensor& src, const AttentionLayout& l) {
  const int64_t B = src.size(0), T = src.size(1), D = l.head_dim;
  return src.narrow(2, l.q_col, l.heads * D).view({B, T, l.kv(), l.group(), D}).permute({0, 2, 3, 1, 4});
}

at::Tensor kv_view(const at::Tensor& src, int64_t col, const AttentionLayout& l) {
  const int64_t B = src.size(0), T = src.size(1), D = l.head_dim;
  return src.narrow(2, col, l.kv() * D)
      .view({B, T, l.kv(), 1, D})
      .permute({0, 2, 3, 1, 4})
      .expand({B, l.kv(), l.group(), T, D});
}

at::Tensor heads_view(const at::Tensor& btc, const AttentionLayout& l) {
  return btc.view({btc.size(0), btc.size(1), l.kv(), l.group(), l.head_dim}).permute({0, 2, 3, 1, 4});
}

at::Tensor block_view(const at::Tensor& packed, const AttentionLayout& l, int64_t r) {
  const at::Tensor flat =
      l.blocks() == 1 ? packed.view({-1}) : packed.narrow(0, l.offset(r), l.offset(r + 1) - l.offset(r));
  return flat.view({l.batch, l.kv(), l.group(), l.rows(r), l.cols(r)});
}

double scale(const AttentionLayout& l) { return 1.0 / std::sqrt(static_cast<double>(l.head_dim)); }

namespace {

// On the kernel pool, a few (batch, head) matrices per chunk: a fill has no bits to vary.
template <typename T>
void mask_rows(T* p, int64_t matrices, int64_t rows, int64_t cols, int64_t first) {
  const T lowest = std::numeric_limits<T>::lowest();
  detail::parallel_chunks(matrices, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t i = 0; i < rows; ++i) {
        T* row = p + (m * rows + i) * cols;
        std::fill(row + std::min(cols, first + i + 1), row + cols, lowest);
      }
  });
}

}  // namespace

void mask_block(at::Tensor& s, const AttentionLayout& l, int64_t r) {
  const int64_t rows = l.rows(r), cols = l.cols(r), first = l.first_row(r);
  if (s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == at::kFloat)
    mask_rows(s.data_ptr<float>(), l.batch * l.heads, rows, cols, first);
  else if (s.device().is_cpu() && s.is_contiguous() && s.scalar_type() == at::kDouble)
    mask_rows(s.data_ptr<double>(), l.batch * l.heads, rows, cols, first);
  else
    s.masked_fill_(at::ones({rows, cols}, s.options().dtype(at::kBool)).triu_(first + 1), -INFINITY);
}

namespace {
int g_batched_for_tests = 0;  // live BatchedPathForTests
}  // namespace

BatchedPathForTests::BatchedPathForTests() { ++g_batched_for_tests; }
BatchedPathForTests::~BatchedPathForTests() { --g_batched_for_tests; }

bool head_products(std::initializer_list<const at::Tensor*> tensors) {
  if (g_batched_for_tests > 0) return false;
  for (const at::Tensor* t : tensors)
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->stride(-1) != 1) return false;
  return detail::gemm_available();
}

void for_each_kv_head(const AttentionLayout& l, const std::function<void(int64_t b, int64_t kv)>& fn) {
  std::optional<detail::SingleThreadedBlas> one_thread;
  if (detail::kernel_threads() > 1) one_thread.emplace();
  detail::parallel_chunks(l.batch * l.kv(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i / l.kv(), i % l.kv());
  });
}

void pack_rows(const float* src, int64_t ld, int64_t rows, int64_t width, float* dst) {
  for (int64_t i = 0; i < rows; ++i) std::copy_n(src + i * ld, width, dst + i * width);
}

int64_t matrix_offset(const AttentionLayout& l, int64_t r, int64_t b, int64_t h) {
  return l.offset(r) + (b * l.heads + h) * l.rows(r) * l.cols(r);
}

void mask_matrix(float* s, const AttentionLayout& l, int64_t r) {
  const int64_t rows = l.rows(r), cols = l.cols(r), first = l.first_row(r);
  for (int64_t i = 0; i < rows; ++i)
    std::fill(s + i * cols + std::min(cols, first + i + 1), s + (i + 1) * cols, std::numeric_limits<float>::lowest());
}

std::vector<at::Tensor> blocks_of(const at::Tensor& packed, const AttentionLayout& l) {
  std::vector<at::Tensor> out;
  for (int64_t r = 0; r < l.blocks(); ++r) {
    const at::Tensor flat =
        l.blocks() == 1 ? packed.reshape({-1}) : packed.narrow(0, l.offset(r), l.offset(r + 1) - l.offset(r));
    out.push_back(flat.view({l.batch, l.heads, l.rows(r), l.cols(r)}));
  }
  return out;
}

at::Tensor pack_blocks(const std::vector<at::Tensor>& blocks, const AttentionLayout& l) {
  if (l.blocks() == 1) return blocks[0];
  std::vector<at::Tensor> flat;
  for (const at::Tensor& b : blocks) flat.push_back(b.reshape({-1}));
  return at::cat(flat);
}

at::Tensor heads_of(const at::Tensor& src, int64_t col, int64_t heads, const AttentionLayout& l) {
  const int64_t B = src.size(0), T = src.size(1), D = l.head_dim;
  return src.narrow(2, col, heads * D).reshape({B, T, heads, D}).permute({0, 2, 1, 3});
}

OpFlops flops(const BlockSpec&, const OpNode& node) {
  const int64_t f = 2 * node.attn.numel() * node.attn.head_dim;
  return {f, 2 * f};
}

}  // namespace remat::ops::attention
