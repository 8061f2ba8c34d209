#include "util/gemm.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "remat/blas_kernel.h"
#include "remat/error.h"
#include "remat/runtime.h"
#include "util/parallel.h"
#include "util/text.h"

namespace remat {
namespace detail {

namespace {

template <typename F>
F symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

// oneDNN's row-major sgemm (dnnl.h: dnnl_sgemm; its status is an int) and its version.
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
struct DnnlVersion {
  int major, minor, patch;
  const char* hash;
  unsigned cpu_runtime, gpu_runtime;
};

DnnlSgemm dnnl_sgemm() {
  static const DnnlSgemm fn = symbol<DnnlSgemm>("dnnl_sgemm");
  return fn;
}

// CBLAS constants (cblas.h): row-major, no-transpose, transpose.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

template <typename T>
using CblasGemm = void (*)(int, int, int, int, int, int, T, const T*, int, const T*, int, T, T*, int);

template <typename T>
CblasGemm<T> cblas() {
  static const CblasGemm<T> fn = symbol<CblasGemm<T>>(sizeof(T) == 4 ? "cblas_sgemm" : "cblas_dgemm");
  return fn;
}

GemmClass head_class(bool ta, bool tb) { return ta ? GemmClass::HeadTN : tb ? GemmClass::HeadNT : GemmClass::HeadNN; }
GemmClass linear_class(bool ta, bool tb) {
  return ta ? GemmClass::LinearTN : tb ? GemmClass::LinearNT : GemmClass::LinearNN;
}

// The table GemmChoice OneDnn (or Blas) sets.
GemmTable uniform_table(bool onednn) {
  GemmTable t;
  for (int c = 0; c < kGemmClasses; ++c)
    t[c] = onednn ? GemmImpl::OneDnn : c < 3 ? GemmImpl::BlasThreads : GemmImpl::Blas;
  return t;
}

// The process's table, read by every product (set between steps only).
std::atomic<GemmImpl> g_table[kGemmClasses];
const bool g_table_initialised = [] {
  const GemmTable init = uniform_table(dnnl_sgemm() != nullptr);
  for (int c = 0; c < kGemmClasses; ++c) g_table[c].store(init[c]);
  return true;
}();

GemmImpl impl_of(GemmClass c) { return g_table[static_cast<int>(c)].load(std::memory_order_relaxed); }

// oneDNN threads with OpenMP: its sgemm runs on omp_get_max_threads() threads of the calling
// thread, an OpenMP setting each thread holds for itself. Set to one for the call, then put back.
class OneOmpThread {
 public:
  OneOmpThread() {
    static const auto get = symbol<int (*)()>("omp_get_max_threads");
    if (get != nullptr && (previous_ = get()) != 1) set()(1);
  }
  ~OneOmpThread() {
    if (previous_ != 1) set()(previous_);
  }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  static void (*set())(int) {
    static const auto fn = symbol<void (*)(int)>("omp_set_num_threads");
    return fn;
  }
  int previous_ = 1;
};

// cblas takes its sizes and leading dimensions as int: a product on the BLAS with one past INT_MAX
// runs on ATen instead (mm_out's at::mm, batched_gemm's at::matmul); sgemm refuses it.
bool fits_cblas(std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes)
    if (s > std::numeric_limits<int>::max()) return false;
  return true;
}

// One product on this thread. REQUIRES: on the BLAS, fits_cblas of its sizes (checked by the callers).
template <typename T>
void gemm_here(GemmImpl impl, bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (sizeof(T) == 4) {
    if (impl == GemmImpl::OneDnn) {
      OneOmpThread one;
      dnnl_sgemm()(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
  }
  cblas<T>()(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
             static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
             static_cast<int>(ldc));
}

template <typename T>
bool can_run(GemmImpl impl) {
  return (sizeof(T) == 4 && impl == GemmImpl::OneDnn) ? dnnl_sgemm() != nullptr : cblas<T>() != nullptr;
}

// Tiles of the output: at most 256 rows by 512 columns, each over the whole of k, and cut finer
// (tile_shape) while the product has fewer than 4 tiles, so that a short product (an expert's
// rows) still spreads over the cores; from the shape alone, never the thread count.
// NOTE [The engine's GEMMs] has the measurements.
constexpr int64_t kTileRows = 256, kTileCols = 512, kMinTileRows = 64, kMinTileCols = 128, kMinTiles = 4;

// A transposed A whose rows are 4 KiB or longer puts every row of a tile's panel on a page of its
// own: oneDNN's sgemm then ran a linear's weight gradient (dy^T x: A is dy, lda its width) at 57-69
// GFLOP/s on one thread where the same product from a packed panel ran at 81-83 (seed fc and qkv,
// lda 2048 and 1536; median of 21 alternated runs each). Such panels are copied first, row by row,
// into a buffer of the thread's own (k x 256 floats, its storage kept between calls, outside the tensor
// accounting like oneDNN's own packing buffers). The sgemm's results do not depend on lda: the
// bits are those of the unpacked call (Gemm.PackedPanelHasTheBitsOfTheStridedOne).
constexpr int64_t kPackLda = 1024;

void sgemm_tiled(GemmImpl impl, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const TileShape tile = tile_shape(m, n);
  const int64_t tr = tile.rows, tc = tile.cols;  // plain names: the lambda below captures them (C++17)
  const int64_t rows = (m + tr - 1) / tr, cols = (n + tc - 1) / tc;
  const bool pack = impl == GemmImpl::OneDnn && ta && lda >= kPackLda;
  // Every tile on one kernel thread, even a product of one tile: the BLAS's own threads would spin
  // on the cores the pass's kernel threads hold (with one kernel thread there are none to spin on).
  std::optional<SingleThreadedBlas> one_thread;
  if (impl != GemmImpl::OneDnn && kernel_threads() > 1) one_thread.emplace();
  // Packed, a chunk is one row of tiles: its panel is copied once, for all of the row's tiles. (A
  // transposed A of lda >= 1024 is a weight gradient's dy^T, whose m is lda: 4 rows of tiles at least.)
  parallel_chunks(rows * cols, pack ? cols : 1, [&](int64_t begin, int64_t end) {
    float* panel = nullptr;
    int64_t panel_row = -1;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / cols * tr, j = t % cols * tc;
      const int64_t mr = std::min(tr, m - i);
      const float* at = ta ? a + i : a + i * lda;  // rows i.. of op(A): columns of A when transposed
      int64_t ld = lda;
      if (pack) {
        if (panel_row != i) {
          panel = thread_scratch(Scratch::GemmPanel, k * mr);
          for (int64_t r = 0; r < k; ++r) std::copy_n(at + r * lda, mr, panel + r * mr);
          panel_row = i;
        }
        at = panel, ld = mr;
      }
      const float* bt = tb ? b + j * ldb : b + j;
      gemm_here<float>(impl, ta, tb, mr, std::min(tc, n - j), k, alpha, at, ld, bt, ldb, beta, c + i * ldc + j, ldc);
    }
  });
}

// Batch dimensions are split in two: those c is expanded over (stride 0, more than one entry),
// whose products add up into one output in index order, and the others, one output each. A task is
// one output: its products in index order, as a plain loop over the whole batch would give them.
template <typename T>
void batched(const at::Tensor& a, bool ta, const at::Tensor& b, bool tb, at::Tensor& c, double alpha, double beta) {
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
  const int64_t lda = a.stride(rank - 2), ldb = b.stride(rank - 2), ldc = c.stride(rank - 2);
  const GemmImpl impl = impl_of(head_class(ta, tb));
  std::optional<SingleThreadedBlas> one_thread;  // as sgemm_tiled; a double product is the BLAS's whatever the class
  if ((sizeof(T) == 8 || impl != GemmImpl::OneDnn) && kernel_threads() > 1) one_thread.emplace();
  parallel_chunks(n_outer, 1, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      int64_t oa0 = 0, ob0 = 0, oc0 = 0;
      offsets(outer, o, oa0, ob0, oc0);
      for (int64_t i = 0; i < n_inner; ++i) {
        int64_t oa = oa0, ob = ob0, oc = oc0;
        offsets(inner, i, oa, ob, oc);
        gemm_here<T>(impl, ta, tb, m, n, k, static_cast<T>(alpha), pa + oa, lda, pb + ob, ldb, static_cast<T>(beta),
                     pc + oc, ldc);
      }
    }
  });
}

}  // namespace

TileShape tile_shape(int64_t m, int64_t n) {
  TileShape t{kTileRows, kTileCols};
  const auto tiles = [&] { return (m + t.rows - 1) / t.rows * ((n + t.cols - 1) / t.cols); };
  while (tiles() < kMinTiles) {
    // Halve the tile's longer side as the output clips it (columns on a tie), or the other one once
    // that side is at its least: a tile's packed panels grow with rows + columns, its work with
    // rows x columns, so the squarer tile packs less for the same work.
    const bool cols_longer = std::min(t.cols, n) >= std::min(t.rows, m);
    if (t.cols > kMinTileCols && (cols_longer || t.rows == kMinTileRows))
      t.cols /= 2;
    else if (t.rows > kMinTileRows)
      t.rows /= 2;
    else
      break;
  }
  return t;
}

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  const GemmImpl impl = impl_of(head_class(ta, tb));
  if (!can_run<float>(impl)) fail_runtime("the loaded BLAS has no cblas_sgemm; remat needs OpenBLAS (make setup)");
  if (impl != GemmImpl::OneDnn && !fits_cblas({m, n, k, lda, ldb, ldc}))
    fail_runtime("a {} x {} x {} product with leading dimensions {}, {}, {} is past the BLAS's int sizes", m, n, k, lda,
                 ldb, ldc);
  gemm_here<float>(impl, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

bool gemm_available() { return can_run<float>(GemmImpl::OneDnn) || can_run<float>(GemmImpl::Blas); }

bool gemm_on_kernel_threads() {
  for (int c = 0; c < kGemmClasses; ++c)
    if (g_table[c].load() == GemmImpl::BlasThreads) return false;
  return true;
}

bool pass_owns_the_cores() { return gemm_on_kernel_threads() && current_threads().aten == 1; }

void mm_out(at::Tensor& c, const at::Tensor& a, bool ta, const at::Tensor& b, bool tb, double beta) {
  const GemmImpl impl = impl_of(linear_class(ta, tb));
  const bool tiled =
      impl != GemmImpl::BlasThreads && can_run<float>(impl) && c.device().is_cpu() && c.scalar_type() == at::kFloat &&
      a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.stride(1) == 1 && b.stride(1) == 1 &&
      c.stride(1) == 1 &&
      // oneDNN takes int64 sizes; on the BLAS, a tile's m and n are small, k and the strides the product's
      (impl == GemmImpl::OneDnn || fits_cblas({ta ? a.size(0) : a.size(1), a.stride(0), b.stride(0), c.stride(0)}));
  if (tiled) {
    sgemm_tiled(impl, ta, tb, c.size(0), c.size(1), ta ? a.size(0) : a.size(1), 1.0f, a.data_ptr<float>(), a.stride(0),
                b.data_ptr<float>(), b.stride(0), static_cast<float>(beta), c.data_ptr<float>(), c.stride(0));
    return;
  }
  const at::Tensor opa = ta ? a.t() : a, opb = tb ? b.t() : b;
  if (beta == 0.0)
    at::mm_out(c, opa, opb);
  else
    at::addmm_out(c, c, opa, opb, beta, 1.0);
}

void batched_gemm(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& c,
                  double alpha, double beta) {
  const int64_t rank = c.dim();
  if (a.dim() != rank || b.dim() != rank || rank < 3)
    fail_runtime("batched_gemm: ranks {}, {}, {} must be equal and >= 3", a.dim(), b.dim(), rank);
  for (int64_t d = 0; d < rank - 2; ++d)
    if (c.stride(d) == 0 && c.size(d) > 1 && beta != 1.0)
      REMAT_INTERNAL("batched_gemm into an expanded output needs beta 1, got {}", beta);
  const bool unit = a.stride(rank - 1) == 1 && b.stride(rank - 1) == 1 && c.stride(rank - 1) == 1;
  const GemmImpl impl = impl_of(head_class(transpose_a, transpose_b));
  const bool fits = (c.scalar_type() == at::kFloat && impl == GemmImpl::OneDnn) ||  // int64 sizes
                    fits_cblas({c.size(rank - 2), c.size(rank - 1), transpose_a ? a.size(rank - 2) : a.size(rank - 1),
                                a.stride(rank - 2), b.stride(rank - 2), c.stride(rank - 2)});
  if (unit && fits && c.device().is_cpu() && a.scalar_type() == c.scalar_type() && b.scalar_type() == c.scalar_type()) {
    if (c.scalar_type() == at::kFloat && can_run<float>(impl))
      return batched<float>(a, transpose_a, b, transpose_b, c, alpha, beta);
    if (c.scalar_type() == at::kDouble && can_run<double>(GemmImpl::Blas))
      return batched<double>(a, transpose_a, b, transpose_b, c, alpha, beta);
  }
  const at::Tensor opa = transpose_a ? a.transpose(-1, -2) : a;
  const at::Tensor opb = transpose_b ? b.transpose(-1, -2) : b;
  at::Tensor product = at::matmul(opa, opb);
  if (alpha != 1.0) product.mul_(alpha);
  // An output expanded over some batch dimension (stride 0: grouped-query heads sharing k and v)
  // takes the sum over that dimension, as the loop above accumulates it.
  at::Tensor out = c;
  for (int64_t d = 0; d < rank - 2; ++d)
    if (c.stride(d) == 0 && c.size(d) > 1) {
      product = product.sum(d, /*keepdim=*/true);
      out = out.narrow(d, 0, 1);
    }
  if (beta == 0.0)
    out.copy_(product);
  else
    out.mul_(beta).add_(product);
}

void let_blas_threads_sleep() { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

SingleThreadedBlas::SingleThreadedBlas() {
  static const auto get = symbol<int (*)()>("openblas_get_num_threads");
  static const auto set = symbol<void (*)(int)>("openblas_set_num_threads");
  if (get == nullptr || set == nullptr) return;
  previous_ = get();
  if (previous_ != 1) set(1);
}

SingleThreadedBlas::~SingleThreadedBlas() {
  static const auto set = symbol<void (*)(int)>("openblas_set_num_threads");
  if (set != nullptr && previous_ > 1) set(previous_);
}

std::string_view to_string(GemmClass c) {
  static constexpr std::string_view names[kGemmClasses] = {"linear x W^T", "linear dy W", "linear dy^T x",
                                                           "head q k^T",   "head p v",    "head p^T dy"};
  return names[static_cast<int>(c)];
}

std::string_view to_string(GemmImpl i) {
  return i == GemmImpl::OneDnn ? "onednn" : i == GemmImpl::Blas ? "blas" : "blas-threads";
}

GemmImpl parse_gemm_impl(std::string_view text) {
  for (GemmImpl i : {GemmImpl::OneDnn, GemmImpl::Blas, GemmImpl::BlasThreads})
    if (text == to_string(i)) return i;
  fail("GEMM '{}' is unknown; allowed: onednn, blas, blas-threads", text);
}

bool available(GemmImpl i) { return can_run<float>(i); }

std::string onednn_version() {
  if (const auto version = symbol<const DnnlVersion* (*)()>("dnnl_version"))
    if (const DnnlVersion* v = version()) return fmt::format("{}.{}.{}", v->major, v->minor, v->patch);
  return dnnl_sgemm() != nullptr ? "unknown" : "none";
}

std::string gemm_libraries() {
  std::string blas = "none";
  if (const auto config = symbol<char* (*)()>("openblas_get_config")) blas = config();
  return fmt::format("onednn={} blas={} kernel={} cblas={}", onednn_version(), blas, blas::loaded_kernel(),
                     available(GemmImpl::Blas) ? "yes" : "no");
}

GemmTable gemm_table() {
  GemmTable t;
  for (int c = 0; c < kGemmClasses; ++c) t[c] = g_table[c].load();
  return t;
}

void set_gemm_table(const GemmTable& t) {
  for (int c = 0; c < kGemmClasses; ++c) {
    if (!available(t[c]))
      fail(
          "GemmChoice: {} for {} is not in this build (the loaded LibTorch exports no oneDNN sgemm, or the BLAS no "
          "cblas_sgemm)",
          to_string(t[c]), to_string(static_cast<GemmClass>(c)));
    if (c >= 3 && t[c] == GemmImpl::BlasThreads)
      fail("GemmChoice: blas-threads runs linears only, not {}", to_string(static_cast<GemmClass>(c)));
  }
  for (int c = 0; c < kGemmClasses; ++c) g_table[c].store(t[c]);
}

std::string to_string(const GemmTable& t) {
  return fmt::format("linear={},{},{};head={},{},{}", to_string(t[0]), to_string(t[1]), to_string(t[2]),
                     to_string(t[3]), to_string(t[4]), to_string(t[5]));
}

GemmTable parse_gemm_table(std::string_view text) {
  if (text == "onednn" || text == "blas") return uniform_table(text == "onednn");
  GemmTable t;
  const std::string s(text);
  auto impl = [&](const std::string& name) {
    try {
      return parse_gemm_impl(name);
    } catch (const Error&) {
      fail("GemmChoice '{}' names an unknown GEMM '{}'; allowed per class: onednn, blas, blas-threads (linears only)",
           text, name);
    }
  };
  const size_t semi = s.find(';');
  if (s.rfind("linear=", 0) != 0 || semi == std::string::npos || s.compare(semi + 1, 5, "head=") != 0)
    fail(
        "GemmChoice '{}' is unknown; allowed: auto, onednn, blas, or a record such as "
        "'linear=onednn,onednn,blas;head=onednn,onednn,blas'",
        text);
  int c = 0;
  for (const std::string& part : {s.substr(7, semi - 7), s.substr(semi + 6)}) {
    const std::vector<std::string> names = split_fields(part, ',');
    if (names.size() != 3)
      fail("GemmChoice '{}' names {} GEMMs for the {}; give three ({})", text, names.size(),
           c == 0 ? "linears" : "heads", c == 0 ? "x W^T, dy W, dy^T x" : "q k^T, p v, p^T dy");
    for (const std::string& name : names) {
      t[c] = impl(name);
      if (c >= 3 && t[c] == GemmImpl::BlasThreads)
        fail("GemmChoice '{}': blas-threads runs linears only, not {}", text, to_string(static_cast<GemmClass>(c)));
      ++c;
    }
  }
  return t;
}

}  // namespace detail

GemmChoice parse_gemm(std::string_view text) {
  if (text == "auto") return GemmChoice::Auto;
  if (text == "onednn") return GemmChoice::OneDnn;
  if (text == "blas") return GemmChoice::Blas;
  fail("GemmChoice '{}' is unknown; allowed: auto, onednn, blas", text);
}

void set_gemm(GemmChoice choice) {
  const bool exported = detail::dnnl_sgemm() != nullptr;
  if (choice == GemmChoice::OneDnn && !exported)
    fail("GemmChoice 'onednn': the loaded LibTorch exports no oneDNN sgemm (dnnl_sgemm); allowed here: auto, blas");
  detail::set_gemm_table(detail::uniform_table(choice != GemmChoice::Blas && exported));
}

bool gemm_uses_blas() {
  for (const detail::GemmImpl i : detail::gemm_table())
    if (i != detail::GemmImpl::OneDnn) return true;
  return false;
}

std::string gemm_name() {
  using detail::GemmImpl;
  const detail::GemmTable t = detail::gemm_table();
  const std::string onednn = "oneDNN " + detail::onednn_version();
  auto name = [&](GemmImpl i) {
    return i == GemmImpl::OneDnn ? onednn + " sgemm on remat's kernel threads"
           : i == GemmImpl::Blas ? std::string("the BLAS's cblas_sgemm on remat's kernel threads")
                                 : std::string("at::mm on the BLAS's threads");
  };
  std::string out;
  for (GemmImpl i : {GemmImpl::OneDnn, GemmImpl::Blas, GemmImpl::BlasThreads}) {
    if (std::count(t.begin(), t.end(), i) == detail::kGemmClasses) return name(i) + " (every product)";
    std::string classes;
    for (int c = 0; c < detail::kGemmClasses; ++c)
      if (t[c] == i)
        classes += fmt::format("{}{}", classes.empty() ? "" : ", ", to_string(static_cast<detail::GemmClass>(c)));
    if (!classes.empty()) out += fmt::format("{}{} ({})", out.empty() ? "" : "; ", name(i), classes);
  }
  return out;
}

}  // namespace remat
