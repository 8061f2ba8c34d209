#include "ops/gemm.h"

#include <gtest/gtest.h>

#include <cstring>

#include <ATen/ATen.h>

#include "util/parallel.h"
#include "util/parallel_testing.h"

namespace remat::detail {
namespace {

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && std::memcmp(a.data_ptr<float>(), b.data_ptr<float>(), a.nbytes()) == 0;
}

// The attention shape: q, k as strided column slices of one packed (batch, T, heads * 2 * D)
// tensor viewed as (batch, heads, T, D), and dq-like products added into an existing output.
struct Operands {
  at::Tensor a, b, c0;
};

Operands attention_like(int64_t batch, int64_t heads, int64_t t, int64_t d) {
  at::manual_seed(7);
  const at::Tensor packed = at::randn({batch, t, heads * 2 * d});
  auto view = [&](int64_t col) {
    return packed.narrow(2, col, heads * d).view({batch, t, heads, d}).permute({0, 2, 1, 3});
  };
  return {view(0), view(heads * d), at::randn({batch, heads, t, t})};
}

// c += a b^T, one BLAS call per (batch, head) in index order on one BLAS thread: the reference.
at::Tensor plain_loop(const Operands& o, bool expanded) {
  SingleThreadedBlas one;
  at::Tensor c = expanded ? o.c0.narrow(1, 0, 1).clone() : o.c0.clone();
  for (int64_t i = 0; i < o.a.size(0); ++i)
    for (int64_t h = 0; h < o.a.size(1); ++h) {
      const at::Tensor a = o.a[i][h], b = o.b[i][h];
      at::Tensor out = c[i][expanded ? 0 : h];
      sgemm(false, true, a.size(0), b.size(0), a.size(1), 0.5f, a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(),
            b.stride(0), 1.0f, out.data_ptr<float>(), out.stride(0));
    }
  return c;
}

at::Tensor batched(const Operands& o, bool expanded, int threads) {
  const KernelThreads pool(threads);
  at::Tensor c = expanded ? o.c0.narrow(1, 0, 1).clone() : o.c0.clone();
  at::Tensor view = expanded ? c.expand(o.c0.sizes()) : c;
  batched_gemm(o.a, false, o.b, true, view, 0.5, 1.0);
  return c;
}

// 8 x 4 products: enough tasks for the pool on two threads.
TEST(BatchedGemm, GivesThePlainLoopsBitsOnOneThreadOrTwo) {
  const Operands o = attention_like(8, 4, 33, 16);
  const at::Tensor want = plain_loop(o, false);
  EXPECT_TRUE(same_bits(batched(o, false, 1), want));
  EXPECT_TRUE(same_bits(batched(o, false, 2), want));
}

// An output shared by the heads (stride 0, as a grouped-query key gradient): one task adds them
// in head order, so two threads never write it at once and the sum is the loop's.
TEST(BatchedGemm, SumsIntoASharedOutputInIndexOrderOnAnyThreadCount) {
  const Operands o = attention_like(8, 4, 33, 16);
  const at::Tensor want = plain_loop(o, true);
  EXPECT_TRUE(same_bits(batched(o, true, 1), want));
  EXPECT_TRUE(same_bits(batched(o, true, 2), want));
}

}  // namespace
}  // namespace remat::detail
