#include "ops/gemm.h"

#include <dlfcn.h>

#include <ATen/ATen.h>

#include "remat/error.h"
#include "util/parallel.h"

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

// Batch dimensions are split in two: those c is expanded over (stride 0, more than one entry),
// whose products add up into one output in index order, and the others, one output each. A task is
// one output: its products in index order, as a plain loop over the whole batch would give them. On
// several kernel threads the tasks spread over the pool with the BLAS on one thread per call, so
// the bits do not depend on the thread count or the split.
template <typename T>
bool try_cblas(const at::Tensor& a, bool ta, const at::Tensor& b, bool tb, at::Tensor& c, double alpha,
               double beta) {
  const GemmFn<T> gemm = cblas<T>();
  if (gemm == nullptr) return false;
  const int64_t rank = a.dim();
  const int64_t m = c.size(rank - 2), n = c.size(rank - 1);
  const int64_t k = ta ? a.size(rank - 2) : a.size(rank - 1);
  std::vector<int64_t> outer, inner;
  for (int64_t d = 0; d < rank - 2; ++d) (c.stride(d) == 0 && c.size(d) > 1 ? inner : outer).push_back(d);
  auto count = [&](const std::vector<int64_t>& dims) {
    int64_t p = 1;
    for (int64_t d : dims) p *= c.size(d);
    return p;
  };
  const int64_t n_outer = count(outer), n_inner = count(inner);
  // Element offsets of batch entry `index` (last dimension fastest) over `dims`, into a, b and c.
  auto offsets = [&](const std::vector<int64_t>& dims, int64_t index, int64_t& oa, int64_t& ob, int64_t& oc) {
    for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
      const int64_t i = index % c.size(*d);
      index /= c.size(*d);
      oa += i * a.stride(*d), ob += i * b.stride(*d), oc += i * c.stride(*d);
    }
  };
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* pc = c.data_ptr<T>();
  auto tasks = [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int64_t oa0 = 0, ob0 = 0, oc0 = 0;
      offsets(outer, o, oa0, ob0, oc0);
      for (int64_t i = 0; i < n_inner; ++i) {
        int64_t oa = oa0, ob = ob0, oc = oc0;
        offsets(inner, i, oa, ob, oc);
        gemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
             static_cast<int>(k), static_cast<T>(alpha), pa + oa, static_cast<int>(a.stride(rank - 2)), pb + ob,
             static_cast<int>(b.stride(rank - 2)), static_cast<T>(beta), pc + oc, static_cast<int>(c.stride(rank - 2)));
      }
    }
  };
  const int threads = kernel_threads();
  if (threads > 1 && n_outer >= 2 * threads) {
    // Measured on 2 cores (Zen 3), the causal row blocks of GPT-2 attention at T = 1024 (64 heads of
    // 128 x c x 64): 42 GFLOP/s with OpenBLAS's 2 threads per call, 78 GFLOP/s as 2 tasks at once,
    // in a standalone loop; the whole model's step did not get faster (NOTE [Threads and BLAS]).
    // The seed model's 128 x 128 x 64 products: no difference beyond the machine's noise.
    SingleThreadedBlas one_thread;
    parallel_chunks(n_outer, std::max<int64_t>(1, n_outer / (4 * threads)), tasks);
  } else {
    tasks(0, n_outer);
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
