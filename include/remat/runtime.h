// The machine: thread settings, which BLAS is loaded, and how fast it multiplies.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace remat {

// Threads for LibTorch's own kernels (OpenMP), and for the BLAS pool (OpenBLAS pthreads) and
// remat's kernel pool, which take the same count. On a 2-core machine the pools fight: idle
// libgomp workers spin on the cores OpenBLAS needs. Some per-op scratch is sized by these
// (LayerNorm's backward, flash attention), so the memory model takes them too.
struct ThreadConfig {
  int aten = 1;  // at::set_num_threads
  int blas = 1;  // openblas_set_num_threads (when the BLAS is OpenBLAS) and remat's kernel threads
};

// The default: ATen 1, BLAS = number of cores. Measured on the 2-core machine (README, "Threads").
ThreadConfig default_threads();

// "A/B" (ATen A, BLAS B) or "N" (both N), each at most 4 per core. Throws remat::Error for anything
// else.
ThreadConfig parse_threads(std::string_view text);

// Applies both settings to this process. remat's own pointwise kernels run on `blas` threads too,
// from a pool whose idle threads sleep, except through an engine pass (src/util/parallel.h).
void apply_threads(const ThreadConfig& t);

// "1/2".
std::string to_string(const ThreadConfig& t);

// What each of `ranks` processes sharing this machine runs with (remat train --nproc): one ATen
// thread, and this machine's cores / ranks for BLAS and remat's kernels.
ThreadConfig data_parallel_threads(int ranks);

// This machine's memory from /proc/meminfo: MemTotal, and MemAvailable (what a new process may
// use without swapping). 0 when unknown.
int64_t physical_memory();
int64_t available_memory();

// What this process runs with now: at::get_num_threads() and remat's kernel threads.
ThreadConfig current_threads();

// The loaded BLAS, e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake", or "unknown (not OpenBLAS)";
// notes when the remat CLI chose the kernel (remat/blas_kernel.h), or else when OPENBLAS_CORETYPE
// in the environment forced it.
std::string blas_name();

// Which GEMM the op-level engine runs (docs/design.md, NOTE [The engine's GEMMs]). Every piece of
// a product is one single-threaded call on remat's kernel threads; the choice is per process.
enum class GemmChoice : uint8_t {
  Auto,    // OneDnn when the loaded LibTorch exports oneDNN's sgemm (Debian's does), else Blas
  OneDnn,  // oneDNN's sgemm: linears in tiles of the output, attention one call per (batch, head)
  Blas,    // the loaded BLAS: cblas_sgemm per attention product, the linears on at::mm (its threads)
};

// "auto", "onednn", "blas". Throws remat::Error listing them otherwise.
GemmChoice parse_gemm(std::string_view text);

// Sets the engine's GEMM for this process (default Auto). Throws remat::Error for OneDnn when the
// loaded LibTorch does not export it. Not to be called while a step runs.
void set_gemm(GemmChoice choice);

// What the engine's GEMMs run now, e.g. "oneDNN 2.6.3 sgemm, one thread per tile on remat's
// kernel threads".
std::string gemm_name();

// Whether the engine's GEMMs run on the loaded BLAS (GemmChoice Blas, or Auto without oneDNN):
// only then does the engine's speed depend on the BLAS kernel.
bool gemm_uses_blas();

// Float32 matmul rate in GFLOP/s of the engine's GEMM (as a linear runs it): the median of `reps`
// n x n x n products after one warm-up.
double matmul_gflops(int n = 1024, int reps = 9);

}  // namespace remat
