#include "util/gemm.h"

#include <gtest/gtest.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "remat/error.h"
#include "remat/runtime.h"
#include "test_util.h"
#include "util/gemm_testing.h"
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

// c = op(a) op(b) + beta c through mm_out, on `threads` kernel threads; c starts as `c0`.
at::Tensor product(const at::Tensor& a, bool ta, const at::Tensor& b, bool tb, const at::Tensor& c0, double beta,
                   int threads) {
  const KernelThreads pool(threads);
  at::Tensor c = c0.clone();
  mm_out(c, a, ta, b, tb, beta);
  return c;
}

// 600 and 1100 x 1100 outputs: three or five row tiles and three column tiles, the last of each ragged; every
// transpose pair; written fresh (beta 0) and added into (beta 1). Float32 sums in another order
// than at::mm's: equal within rounding.
TEST(Gemm, TiledProductIsTheProduct) {
  at::manual_seed(3);
  const int64_t n = 1100, k = 70;
  for (const int64_t m : {100, 600, 1100})  // 100: tiles of 64 rows; a transposed A of 1100 columns is packed
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const double beta : {0.0, 1.0}) {
          const at::Tensor a = ta ? at::randn({k, m}) : at::randn({m, k});
          const at::Tensor b = tb ? at::randn({n, k}) : at::randn({k, n});
          const at::Tensor c0 = at::randn({m, n});
          const at::Tensor want = at::mm(ta ? a.t() : a, tb ? b.t() : b).add(c0, beta);
          EXPECT_TRUE(testing::close(product(a, ta, b, tb, c0, beta, 2), want, 1e-5))
              << "m " << m << " ta " << ta << " tb " << tb << " beta " << beta;
        }
}

// A short product is cut until it has 4 tiles, the longer side of the tile first, so that an
// expert's few hundred rows still spread over the cores in squarish tiles; a linear of 1024
// tokens keeps 256 x 512.
TEST(Gemm, AShortProductIsCutIntoFourSquarishTiles) {
  using Shape = std::pair<int64_t, int64_t>;
  const auto shape = [](int64_t m, int64_t n) {
    const TileShape t = tile_shape(m, n);
    return Shape{t.rows, t.cols};
  };
  EXPECT_EQ(shape(1024, 1536), Shape(256, 512));
  EXPECT_EQ(shape(1024, 512), Shape(256, 512));  // 4 x 1
  EXPECT_EQ(shape(256, 1024), Shape(256, 256));  // 1 x 4
  EXPECT_EQ(shape(256, 512), Shape(256, 128));   // a tie at 256 x 256: columns
  EXPECT_EQ(shape(512, 512), Shape(256, 256));   // 2 x 2
  EXPECT_EQ(shape(2048, 100), Shape(256, 512));  // 8 x 1
  EXPECT_EQ(shape(40, 512), Shape(256, 128));    // 40 rows: the columns are cut
  EXPECT_EQ(shape(100, 100), Shape(64, 128));    // 2 x 1: no finer than 64 x 128
}

// A transposed A with rows of 1024 floats or more (a weight gradient's dy^T) is copied into a
// packed panel per row tile before its sgemm: the bits are those of the same tiles read in place.
TEST(Gemm, PackedPanelHasTheBitsOfTheStridedOne) {
  at::manual_seed(5);
  const int64_t m = 1100, n = 1100, k = 70;  // lda 1100: packed; ragged row and column tiles
  const at::Tensor a = at::randn({k, m}), b = at::randn({k, n});
  at::Tensor want = at::empty({m, n});
  for (int64_t i = 0; i < m; i += 256)  // the tiles mm_out cuts (256 x 512), each read in place
    for (int64_t j = 0; j < n; j += 512)
      sgemm(true, false, std::min<int64_t>(256, m - i), std::min<int64_t>(512, n - j), k, 1.0f, a.data_ptr<float>() + i,
            m, b.data_ptr<float>() + j, n, 0.0f, want.data_ptr<float>() + i * n + j, n);
  EXPECT_TRUE(same_bits(product(a, true, b, false, at::zeros({m, n}), 0.0, 2), want));
  EXPECT_TRUE(same_bits(product(a, true, b, false, at::zeros({m, n}), 0.0, 1), want));
}

// The tiles come from the shape alone. A linear's x W^T of 30 rows by 1100 columns: split by
// thread instead, two threads would get 15-row pieces, and oneDNN 2.6 computes a product of fewer
// than 16 such rows with another kernel, whose bits differ in the last place.
TEST(Gemm, TiledProductHasTheSameBitsOnOneThreadOrTwo) {
  at::manual_seed(4);
  const at::Tensor a = at::randn({30, 512}), b = at::randn({1100, 512}), c0 = at::zeros({30, 1100});
  EXPECT_TRUE(testing::bitwise_equal(product(a, false, b, true, c0, 0.0, 2), product(a, false, b, true, c0, 0.0, 1)));
}

// oneDNN runs each call on one OpenMP thread, an OpenMP setting of the calling thread: ATen's own
// thread count (which it sets through OpenMP) is the same after the call.
TEST(Gemm, LeavesTheCallersOpenMpThreadsAsTheyWere) {
  const testing::AtenThreads two(2);
  const at::Tensor a = at::randn({300, 40}), b = at::randn({40, 600});
  at::Tensor c = at::empty({300, 600});
  mm_out(c, a, false, b, false, 0.0);
  const auto omp_threads = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  EXPECT_EQ(at::get_num_threads(), 2);
  if (omp_threads != nullptr) {
    EXPECT_EQ(omp_threads(), 2);
  }
}

// cblas takes int sizes: an operand whose row stride is past INT_MAX (one row of a view with a
// huge stride) runs on ATen instead of reaching cblas_sgemm with a wrapped leading dimension.
TEST(Gemm, AStridePastIntRunsOnATen) {
  if (!available(GemmImpl::Blas)) GTEST_SKIP() << "no cblas_sgemm";
  const GemmTableScope blas("linear=blas,blas,blas;head=blas,blas,blas");
  at::manual_seed(6);
  const at::Tensor row = at::randn({8}), b = at::randn({8, 3});
  const at::Tensor a = row.as_strided({1, 8}, {int64_t{1} << 31, 1});
  at::Tensor c = at::zeros({1, 3});
  mm_out(c, a, false, b, false, 0.0);
  at::Tensor heads = at::zeros({1, 1, 3});
  batched_gemm(row.as_strided({1, 1, 8}, {8, int64_t{1} << 31, 1}), false, b.view({1, 8, 3}), false, heads, 1.0, 0.0);
  const at::Tensor want = at::mm(row.view({1, 8}), b);
  EXPECT_TRUE(testing::close(c, want, 1e-6));
  EXPECT_TRUE(testing::close(heads.view({1, 3}), want, 1e-6));
}

// --gemm blas runs the linears on at::mm: its bits exactly.
TEST(Gemm, BlasChoiceRunsTheLinearsOnTheBlas) {
  const GemmTableScope scope;
  set_gemm(GemmChoice::Blas);
  at::manual_seed(5);
  const at::Tensor a = at::randn({300, 64}), b = at::randn({700, 64}), c0 = at::zeros({300, 700});
  EXPECT_TRUE(testing::bitwise_equal(product(a, false, b, true, c0, 0.0, 2), at::mm(a, b.t())));
  EXPECT_NE(gemm_name().find("BLAS"), std::string::npos) << gemm_name();
}

TEST(Gemm, UnknownChoiceIsRefusedWithWhatIsAllowed) {
  EXPECT_EQ(parse_gemm("onednn"), GemmChoice::OneDnn);
  try {
    parse_gemm("mkl");
    FAIL() << "accepted 'mkl'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'mkl'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("auto, onednn, blas"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace remat::detail
