// The engine's matrix products (internal). NOTE [The engine's GEMMs] in docs/design.md.
//
// Every GEMM of the op-level engine runs here. Each class of product (GemmClass) runs on one
// implementation (GemmImpl), which the process chooses once: by measuring them on this machine
// (remat::choose_gemm, --gemm auto), or as the user says (--gemm onednn|blas). On remat's kernel
// threads (util/parallel.h) each piece is one single-threaded GEMM call: a linear's product cut into
// tiles of the output, an attention op's into one product per (batch, head). The tiles depend on
// the shapes only, never on the thread count, and each covers the whole reduction: the bits are the
// same on any thread count. BlasThreads hands a linear's whole product to at::mm instead (the
// BLAS's own threads split it by rows and columns, never the reduction).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "remat/runtime.h"

namespace remat::detail {

// The classes of the engine's products, each run by one GEMM of the process's choice: a linear's
// forward (x W^T), input gradient (dy W) and weight gradient (dy^T x), and the attention heads'
// products of the same three forms (q k^T, p v, p^T dy).
enum class GemmClass : uint8_t { LinearNT, LinearNN, LinearTN, HeadNT, HeadNN, HeadTN };
inline constexpr int kGemmClasses = 6;
// "linear x W^T", ..., "head p^T dy".
std::string_view to_string(GemmClass c);

// What runs a class's products.
enum class GemmImpl : uint8_t {
  OneDnn,       // oneDNN's sgemm, one call per tile (linears) or product (heads) on remat's kernel threads
  Blas,         // the loaded BLAS's cblas_sgemm the same way, its own pool at one thread when the
                // kernel pool has more than one
  BlasThreads,  // at::mm on the BLAS's own threads (linears only)
};
// "onednn", "blas", "blas-threads", and back (remat::Error naming the allowed ones).
std::string_view to_string(GemmImpl i);
GemmImpl parse_gemm_impl(std::string_view text);
// True when the build can run `i` (oneDNN's sgemm exported; cblas_sgemm for the others).
bool available(GemmImpl i);

// oneDNN's version ("2.6.3"), or "none" when the loaded LibTorch exports no sgemm.
std::string onednn_version();
// The GEMM libraries this process has, as a cache key: "onednn=2.6.3 blas=OpenBLAS 0.3.21 ... kernel=Zen".
// A choice measured on them holds while they are the same.
std::string gemm_libraries();

// The implementation of each class, by GemmClass index.
using GemmTable = std::array<GemmImpl, kGemmClasses>;
GemmTable gemm_table();
// Sets the table. Throws remat::Error for an implementation the build lacks, or BlasThreads for a
// head class. Not to be called while a step runs.
void set_gemm_table(const GemmTable& t);
// "linear=blas-threads,blas-threads,blas-threads;head=onednn,onednn,onednn" (NT, NN, TN), and back.
// parse_gemm_table also takes "onednn" and "blas" (GemmChoice's tables). Throws remat::Error.
std::string to_string(const GemmTable& t);
GemmTable parse_gemm_table(std::string_view text);

// C = alpha op(A) op(B) + beta C for row-major float32 matrices with leading dimensions, on the
// calling thread only, on the implementation of its head class. REQUIRES: a SingleThreadedBlas
// alive while the kernel threads call it; on the BLAS, sizes and leading dimensions at most
// INT_MAX (cblas takes int): past that it throws remat::Error (from a kernel thread, parallel_chunks
// rethrows it to its caller).
void sgemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// True when sgemm can run: oneDNN's, or the loaded BLAS's cblas_sgemm.
bool gemm_available();

// True when every class runs on the kernel threads (no BlasThreads): an executor pass may then keep
// them polling (NOTE [Kernel threads awake]).
bool gemm_on_kernel_threads();

// Whether the kernel threads may poll through a pass: only when every GEMM and loop of the pass runs
// on them (gemm_on_kernel_threads, one ATen thread), so that no BLAS or OpenMP thread needs the
// cores they hold (NOTE [Kernel threads awake]).
bool pass_owns_the_cores();

// c = op(a) op(b) + beta c for 2-D tensors, c written in place, on the implementation of its linear
// class. OneDnn and Blas, for CPU float32 whose last dimensions are contiguous: tiles of at most
// 256 rows x 512 columns of c (tile_shape) over the kernel threads, one GEMM call each. Otherwise,
// and on the BLAS for a reduction or leading dimension past INT_MAX (cblas takes int), at::mm.
void mm_out(at::Tensor& c, const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, double beta);

// The shape of mm_out's tiles for an m x n output: 256 x 512, and while that gives fewer than 4
// tiles, the longer side (as the output clips it; columns on a tie) halved, or the other once it
// is at its least (rows 64, columns 128), until 4 tiles or both are. From the shape alone, so the
// bits never depend on the threads.
struct TileShape {
  int64_t rows = 0, cols = 0;
};
TileShape tile_shape(int64_t m, int64_t n);

// c = alpha * op(a) @ op(b) + beta * c, batched over all leading dimensions.
// a, b, c: tensors of equal rank >= 3 whose last dimension has stride 1 (any other strides);
// op(x) = x^T (of the last two dimensions) when the matching flag is set. c may be expanded over a
// batch dimension (stride 0) when beta is 1: the products over that dimension are added up, in
// index order. One GEMM call per product (its head class's) over the kernel threads; the products that add into one
// shared output run in one task, in index order. CUDA, half types, no GEMM symbol, or on the BLAS
// a size or leading dimension past INT_MAX (cblas takes int): at::matmul.
void batched_gemm(const at::Tensor& a, bool transpose_a, const at::Tensor& b, bool transpose_b, at::Tensor& c,
                  double alpha, double beta);

// Sleeps until OpenBLAS's idle workers have stopped spinning (about 2^28 cycles, 0.08-0.13 s at
// 2-3.5 GHz; 200 ms, with room to spare), so that what runs next on the cores has them to itself.
void let_blas_threads_sleep();

// While alive, the kernel threads may call sgemm at once: OpenBLAS's pool is set to one thread
// (and restored after).
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int previous_ = 0;
};

// The measured classes of choose_gemm as JSON, as its cache and bench's JSON keep them:
// [{"product": ..., "chosen": ..., "gflops": {"onednn": ..., ...}}, ...].
nlohmann::json gemm_classes_json(const std::vector<GemmClassRates>& classes);

// choose_gemm's one rule for every choice it makes: times[i] are candidate i's samples (ms), taken
// in interleaved rounds (sample r of every candidate in round r). The incumbent stays unless
// another candidate was faster than it in more than half the rounds and either in every round but
// at most `lost` or by kGemmClearLead in its middle round (the median over rounds of the
// incumbent's time over its own); of those, the one with the lowest median. A tie then keeps the
// incumbent but in (1 + rounds) / 2^rounds of re-measurements for lost = 1 (a sign test), or where
// at least half the rounds slowed the incumbent alone by 15% or more, so a machine re-measured keeps its
// choice, and its bits, unless one GEMM is faster there.
size_t winner_of_rounds(const std::vector<std::vector<double>>& times, size_t incumbent, int lost = kGemmRoundsLost);
// Whether `times` leave a challenger undecided under that rule: faster than the incumbent in more
// than half the rounds, yet slower in more than `lost` of them, and without a clear lead. choose_gemm then times as
// many rounds again and decides on all of them with kGemmRoundsLostOfTwice.
bool undecided(const std::vector<std::vector<double>>& times, size_t incumbent, int lost = kGemmRoundsLost);
// One choice's timed rounds: round(r) for r = 1..kGemmRounds (each adds a sample of every
// candidate to what times() returns), then kGemmRounds more when no challenger won them and one
// is undecided; the candidate the rule picks from all of them.
size_t decide_by_rounds(const std::function<void(int round)>& round,
                        const std::function<std::vector<std::vector<double>>()>& times, size_t incumbent);

}  // namespace remat::detail
