// The engine's matrix products (internal). NOTE [The engine's GEMMs] in docs/design.md.
//
// Every GEMM of the op-level engine runs here, on remat's kernel threads (util/parallel.h), each
// piece one single-threaded GEMM call: a linear's product is cut into tiles of the output, an
// attention op's into one product per (batch, head). The BLAS's own thread pool is never woken by
// the engine, so it cannot spin on the cores the kernel pool needs. The tiles depend on the shapes
// only, never on the thread count, and each covers the whole reduction: the bits are the same on
// any thread count.
//
// Which GEMM runs a piece is the process's GemmChoice (remat/runtime.h): oneDNN's sgemm, which
// Debian's LibTorch loads (libdnnl), with one OpenMP thread per call; or the loaded BLAS's
// cblas_sgemm with its pool set to one thread, and the linears on at::mm (OpenBLAS's threads), as
// before oneDNN was used.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace remat::detail {

// C = alpha op(A) op(B) + beta C for row-major float32 matrices with leading dimensions, on the
// calling thread only. REQUIRES: with the CBLAS choice, a SingleThreadedBlas alive while the
// kernel threads call it.
void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// True when sgemm can run: oneDNN's, or the loaded BLAS's cblas_sgemm.
bool gemm_available();

// c = op(a) op(b) + beta c for 2-D tensors, c written in place. With oneDNN and CPU float32 whose
// last dimensions are contiguous: tiles of at most 256 rows x 512 columns of c over the kernel
// threads, one sgemm each. Otherwise at::mm (the BLAS's own threads).
void mm_out(at::Tensor& c, const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, double beta);

// c = alpha * op(a) @ op(b) + beta * c, batched over all leading dimensions.
// a, b, c: tensors of equal rank >= 3 whose last dimension has stride 1 (any other strides);
// op(x) = x^T (of the last two dimensions) when the matching flag is set. c may be expanded over a
// batch dimension (stride 0) when beta is 1: the products over that dimension are added up, in
// index order. One sgemm per product over the kernel threads; the products that add into one
// shared output run in one task, in index order. CUDA, half types or no GEMM symbol: at::matmul.
void batched_gemm(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& c,
                  double alpha, double beta);

// While alive, the kernel threads may call sgemm at once: with the CBLAS choice, OpenBLAS's pool
// is set to one thread (and restored after); with oneDNN it does nothing.
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
