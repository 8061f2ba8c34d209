#include "ops/gemm.h"

#include <dlfcn.h>

#include <ATen/ATen.h>

#include "remat/error.h"

namespace remat::detail {

namespace {

// CBLAS constants (cblas.h): row-major, no-transpose, transpose.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

template <typename T>
using GemmFn = void (*)(int, int, int, int, int, int, T, const T*, int, const T*, int, T, T*, int);

template <typename T>
GemmFn<T> cblas() {
  static const GemmFn<T> fn =
      reinterpret_cast<GemmFn<T>>(dlsym(RTLD_DEFAULT, sizeof(T) == 4 ? "cblas_sgemm" : "cblas_dgemm"));
  return fn;
}

template <typename T>
bool try_cblas(const at::Tensor& a, bool ta, const at::Tensor& b, bool tb, at::Tensor& c, double alpha,
               double beta) {
  const GemmFn<T> gemm = cblas<T>();
  if (gemm == nullptr) return false;
  const int64_t rank = a.dim();
  const int64_t m = c.size(rank - 2), n = c.size(rank - 1);
  const int64_t k = ta ? a.size(rank - 2) : a.size(rank - 1);
  const int64_t batch = c.numel() / (m * n);
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* pc = c.data_ptr<T>();
  std::vector<int64_t> index(static_cast<size_t>(rank - 2), 0);
  for (int64_t i = 0; i < batch; ++i) {
    int64_t oa = 0, ob = 0, oc = 0;
    for (int64_t d = 0; d < rank - 2; ++d) {
      oa += index[d] * a.stride(d);
      ob += index[d] * b.stride(d);
      oc += index[d] * c.stride(d);
    }
    gemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
         static_cast<int>(k), static_cast<T>(alpha), pa + oa, static_cast<int>(a.stride(rank - 2)), pb + ob,
         static_cast<int>(b.stride(rank - 2)), static_cast<T>(beta), pc + oc, static_cast<int>(c.stride(rank - 2)));
    for (int64_t d = rank - 3; d >= 0; --d) {  // next batch index, last dimension fastest
      if (++index[d] < c.size(d)) break;
      index[d] = 0;
    }
  }
  return true;
}

using SetThreads = void (*)(int);
using GetThreads = int (*)();

}  // namespace

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  const GemmFn<float> gemm = cblas<float>();
  if (gemm == nullptr) fail_runtime("the loaded BLAS has no cblas_sgemm; remat needs OpenBLAS (make setup)");
  gemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
       static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

SingleThreadedBlas::SingleThreadedBlas() {
  static const auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  static const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (get == nullptr || set == nullptr) return;
  previous_ = get();
  if (previous_ != 1) set(1);
}

SingleThreadedBlas::~SingleThreadedBlas() {
  static const auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr && previous_ > 1) set(previous_);
}

void batched_gemm(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& c,
                  double alpha, double beta) {
  const int64_t rank = c.dim();
  if (a.dim() != rank || b.dim() != rank || rank < 3)
    fail_runtime("batched_gemm: ranks {}, {}, {} must be equal and >= 3", a.dim(), b.dim(), rank);
  for (int64_t d = 0; d < rank - 2; ++d)
    if (c.stride(d) == 0 && c.size(d) > 1 && beta != 1.0)
      fail_runtime("internal: batched_gemm into an expanded output needs beta 1, got {}", beta);
  const bool unit = a.stride(rank - 1) == 1 && b.stride(rank - 1) == 1 && c.stride(rank - 1) == 1;
  if (unit && c.device().is_cpu() && a.scalar_type() == c.scalar_type() && b.scalar_type() == c.scalar_type()) {
    if (c.scalar_type() == at::kFloat && try_cblas<float>(a, transpose_a, b, transpose_b, c, alpha, beta)) return;
    if (c.scalar_type() == at::kDouble && try_cblas<double>(a, transpose_a, b, transpose_b, c, alpha, beta)) return;
  }
  const at::Tensor opa = transpose_a ? a.transpose(-1, -2) : a;
  const at::Tensor opb = transpose_b ? b.transpose(-1, -2) : b;
  at::Tensor product = at::matmul(opa, opb);
  if (alpha != 1.0) product.mul_(alpha);
  // An output expanded over some batch dimension (stride 0: grouped-query heads sharing k and v)
  // takes the sum over that dimension, as the CBLAS loop accumulates it.
  at::Tensor out = c;
  for (int64_t d = 0; d < rank - 2; ++d)
    if (c.stride(d) == 0 && c.size(d) > 1) {
      product = product.sum(d, /*keepdim=*/true);
      out = out.narrow(d, 0, 1);
    }
  if (beta == 0.0) out.copy_(product);
  else out.mul_(beta).add_(product);
}

}  // namespace remat::detail
