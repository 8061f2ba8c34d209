// The machine: its CPU, thread settings, which BLAS is loaded, and how fast it multiplies.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace remat {

// Threads for LibTorch's own kernels (OpenMP), and for the BLAS pool (OpenBLAS pthreads) and
// remat's kernel pool, which take the same count. On a 2-core machine the pools fight: idle
// libgomp workers spin on the cores OpenBLAS needs. Some per-op scratch is sized by these
// (LayerNorm's backward, flash attention), so the memory model takes them too.
struct ThreadConfig {
  int aten = 1;  // at::set_num_threads
  int blas = 1;  // openblas_set_num_threads (when the BLAS is OpenBLAS) and remat's kernel threads
};

// The default: ATen 1, BLAS = number of cores. Measured on 2-core machines (docs/design.md, NOTE [Threads and BLAS]).
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

// What a run may let its predicted peak take of `limit` bytes: all but a twentieth, which is left
// for what remat's tracker cannot see (OpenBLAS's and oneDNN's own scratch, the libraries' code).
int64_t planned_share(int64_t limit);
// The memory limit of a run given none: nine tenths of available_memory(), the tenth left to the
// page cache and the machine's other processes. 0 when unknown.
int64_t usable_memory();

// What this process runs with now: at::get_num_threads() and remat's kernel threads.
ThreadConfig current_threads();

// This machine's CPU as every cached calibration is keyed on: the first processor's model name,
// family, model and stepping in /proc/cpuinfo and the vector units CPUID shows, e.g. "AMD EPYC
// (family 25, model 17, stepping 1; avx2 fma)"; elsewhere (Arm) the model name, if any, with the
// core's implementer, part, variant and revision; "unknown cpu" without /proc/cpuinfo.
std::string cpu_name();
// The kind of CPU as a folder name, under which make run, make eager and make profile keep each
// kind's tables (results/by-cpu/KIND): vendor, family, model and widest vector unit on x86
// ("intel-6-167-avx512"), the architecture, implementer and part elsewhere ("aarch64-0x41-0xd0c").
// Throws remat::Error when /proc/cpuinfo cannot be read.
std::string cpu_kind();

// The loaded BLAS, e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake", or "unknown (not OpenBLAS)";
// notes when the remat CLI chose the kernel (remat/blas_kernel.h), or else when OPENBLAS_CORETYPE
// in the environment forced it.
std::string blas_name();

// Which GEMM the op-level engine runs (docs/design.md, NOTE [The engine's GEMMs]). The engine's
// products fall in six classes: a linear's forward (x W^T), input gradient (dy W) and weight
// gradient (dy^T x), and attention's per-head q k^T, p v and p^T dy. Each class runs on one GEMM:
// oneDNN's sgemm or the BLAS's cblas_sgemm, one call per tile or head on remat's kernel threads, or
// (linears) at::mm on the BLAS's own threads. The choice is per process, made before any step.
// A signal handler of the program's own that may run while a step computes must run on an
// alternate stack (SA_ONSTACK, with a sigaltstack on every thread that calls the engine, which runs
// products too): oneDNN's JIT GEMMs point the stack pointer into heap buffers, below which a
// signal frame overwrites the heap. remat's kernel threads block asynchronous signals (the remat
// CLI's handler runs so).
enum class GemmChoice : uint8_t {
  Auto,    // each class on the BLAS unless another GEMM won its timed rounds here (choose_gemm); until then,
           // oneDNN when the loaded LibTorch exports its sgemm (Debian's does), else the BLAS
  OneDnn,  // oneDNN's sgemm for every class
  Blas,    // the loaded BLAS: cblas_sgemm per attention product, the linears on at::mm (its threads)
};

// "auto", "onednn", "blas". Throws remat::Error listing them otherwise.
GemmChoice parse_gemm(std::string_view text);

// Sets the engine's GEMM for this process: OneDnn or Blas for every class, Auto the default before
// measuring. Throws remat::Error for OneDnn when the loaded LibTorch does not export it. Not to be
// called while a step runs.
void set_gemm(GemmChoice choice);

// One class of products timed on every GEMM this build has.
struct GemmClassRates {
  std::string product;                                 // "linear dy W"
  std::vector<std::pair<std::string, double>> gflops;  // ("onednn", 61.2), ("blas", 74.0), ("blas-threads", 97.5)
  std::string chosen;                                  // what the class runs on: "blas"
};
// Timed rounds of every choice choose_gemm makes (after one untimed), and how many of them a
// challenger may lose and still replace the incumbent: one busy round on a shared host does not
// keep a faster GEMM out. A challenger that won most rounds but lost more than that (a busy spell
// over several), without a clear lead (kGemmClearLead, which decides at once), is timed in as many
// rounds again, and may lose kGemmRoundsLostOfTwice of all 2 kGemmRounds. A true tie wins 9 or 10 of 10 rounds in 11 of
// 1024 re-measurements, and 17 of 20 after 6 to 8 of the first 10 in 615 of 2^20: the incumbent stays in 98.9% of them.
inline constexpr int kGemmRounds = 10;
inline constexpr int kGemmRoundsLost = 1;
inline constexpr int kGemmRoundsLostOfTwice = 3;
// A challenger that won most rounds also replaces the incumbent, whatever it lost, when it was
// this many times faster in its middle round (the median of the incumbent's time over its own):
// on a host busy in spells, a GEMM 30% faster by its median can lose a round in four to a spell
// that fell on its sample, and the sign test alone would keep the slower one. A tie reaches it
// only when at least half the rounds slowed the incumbent alone by 15% or more.
inline constexpr double kGemmClearLead = 1.15;
struct GemmMeasurement {
  std::vector<GemmClassRates> classes;
  // A pass of every class in turn, ms, with the linears on remat's kernel threads and on the BLAS's
  // own ("kernel-threads", "blas-threads"); empty when the build has no threaded BLAS.
  std::vector<std::pair<std::string, double>> pass_ms;
  std::string source;  // "measured now, on CPU, threads ...", or "measured earlier, cached in PATH"
};

// --gemm auto: times each class of the engine's products on every GEMM this build has (shapes of a
// GPT layer: 1024 tokens at widths 512 and 2048; 64 heads of 128 x 64 and 8 of 1024 x 64), on
// `threads`, in kGemmRounds rounds that run each GEMM once (in one order, then the other; as many
// again while a challenger is undecided), and keeps each class on the BLAS unless another GEMM on
// remat's kernel threads was faster in all rounds but kGemmRoundsLost (kGemmRoundsLostOfTwice of
// twice the rounds), or in most rounds by kGemmClearLead (detail::winner_of_rounds). Whether the linears run on the
// BLAS's own threads instead is a property of the whole pass (the kernel threads poll for their jobs only when every
// product runs on them), so it is chosen by timing a pass of every class both ways, by the same rule. The result is
// cached per CPU model, BLAS and its kernel, oneDNN version, threads and remat release (cache_dir, or remat's cache
// folder, $REMAT_CACHE): a machine chooses once, and the same choice gives the same bits. A few seconds when it
// measures.
GemmMeasurement choose_gemm(const ThreadConfig& threads, const std::string& cache_dir = "");

// While on, no measurement remat caches for this machine (the GEMM choice, the op costs, the
// machine's rates) is read: each is taken again at every use and replaces the cached one, for a
// cache written while the machine was busy. Off by default (`--remeasure` turns it on).
void set_remeasure(bool on);
// Whether set_remeasure is on.
bool remeasuring();

// The engine's GEMM per class as text ("linear=onednn,onednn,blas;head=onednn,onednn,blas"):
// what a bench records and a saved run keeps, since the bits depend on it.
std::string gemm_record();
// Sets what gemm_record() gave (also "onednn" and "blas"). Throws remat::Error for text it did not
// give, or a GEMM this build lacks.
void restore_gemm(std::string_view record);

// What the engine's GEMMs run now, e.g. "oneDNN 2.6.3 sgemm on remat's kernel threads (head q k^T,
// head p v, head p^T dy); at::mm on the BLAS's threads (linear x W^T, linear dy W, linear dy^T x)".
std::string gemm_name();

// Whether any class runs on the loaded BLAS: only then does the engine's speed depend on the BLAS
// kernel.
bool gemm_uses_blas();

// The float32 matmul rate in GFLOP/s of the engine's GEMM for the linear dy W class, or of `gemm`
// when given ("onednn", "blas", "blas-threads"): the median of `reps` n x n x n products after one
// warm-up. Throws remat::Error for a GEMM this build lacks, or n or reps outside 1..16384.
double matmul_gflops(int n = 1024, int reps = 9, std::string_view gemm = {});

// The same rate on every GEMM this build has, medians of `reps` rounds that run each once: what a
// step's matmul floor is measured at (the fastest of them), since no step's products can run
// faster than the fastest GEMM here.
struct FastestMatmul {
  double gflops = 0;                                  // the fastest's rate
  std::string gemm;                                   // and its name: "blas-threads"
  std::vector<std::pair<std::string, double>> rates;  // every GEMM's, in the order tried
};
FastestMatmul fastest_matmul_gflops(int n = 1024, int reps = 5);

// The CPU's float32 peak: fused multiply-adds (AVX-512 when the CPU has it, else AVX2) in 12
// independent chains on `threads` threads at once, the fastest of 3 rounds of about 0.2 s. What no
// GEMM can beat.
struct PeakRate {
  double gflops = 0;
  std::string how;  // "AVX2 FMA, 8 lanes, 12 chains, on 2 threads at once"
};
PeakRate peak_gflops(int threads);

}  // namespace remat
