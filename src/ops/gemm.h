// Strided batched matrix products for the attention ops (internal).
//
// LibTorch 1.13's CPU bmm loops over the batch with a dispatched select + mm per slice; at the
// attention shapes of the seed model that costs more than the arithmetic. Here each (batch, head)
// product is one CBLAS call on a strided view of the packed tensors, with leading dimensions
// instead of permuted copies, spread over remat's kernel threads (util/parallel.h) with the BLAS
// on one thread per call. CPU float32/float64 use the loaded BLAS's cblas_?gemm; anything else
// (CUDA, half types, or no CBLAS symbol) falls back to at::matmul on the same views.
#pragma once

#include <ATen/core/Tensor.h>

namespace remat::detail {

// c = alpha * op(a) @ op(b) + beta * c, batched over all leading dimensions.
// a, b, c: tensors of equal rank >= 3 whose last dimension has stride 1 (any other strides);
// op(x) = x^T (of the last two dimensions) when the matching flag is set. c may be expanded over a
// batch dimension (stride 0) when beta is 1: the products over that dimension are added up, in
// index order.
void batched_gemm(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& c,
                  double alpha, double beta);

// C = alpha op(A) op(B) + beta C for row-major float32 matrices with leading dimensions: one call
// of the loaded BLAS's cblas_sgemm. Throws remat::Error when the BLAS has no CBLAS interface.
void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// While alive, the BLAS runs every call on the calling thread (OpenBLAS's own pool set to one
// thread), for kernels that spread their GEMMs over remat's kernel threads themselves.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace remat::detail
