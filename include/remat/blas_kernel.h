// OpenBLAS's kernel choice: the kernel it loaded, the best one this CPU runs, and a self-check.
//
// Debian's OpenBLAS (DYNAMIC_ARCH) picks its kernels once, when it loads, from the CPU model. A
// model newer than the library (an Intel Xeon of model 207 for 0.3.21) falls back to the SSE3
// kernels ("Prescott"), 3.8x slower than the AVX-512 ones the CPU runs. OPENBLAS_CORETYPE
// overrides the choice, and is read only at load time: the remat CLI sets it and re-executes
// itself once, before any work (tools/remat.cpp, `--blas-kernel auto|keep|NAME`).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace remat::blas {

// What the CPU and the OS support (cpuid, xgetbv). All false off x86-64.
struct CpuFeatures {
  bool intel = false, amd = false;
  bool sse42 = false, avx = false, avx2 = false, fma = false;
  bool avx512 = false;       // F, BW, VL and DQ, with the OS saving the ZMM state
  bool avx512_bf16 = false;  // Cooper Lake and later
};
CpuFeatures cpu_features();

// openblas_get_corename() of the loaded library ("Zen", "Prescott"); "" when it is not OpenBLAS.
std::string loaded_kernel();

// The x86-64 kernels this build of remat knows, slowest first.
const std::vector<std::string>& known_kernels();

// The fastest kernel `cpu` runs: Cooperlake, SkylakeX, Zen or Haswell, Sandybridge, Nehalem,
// Prescott.
std::string best_kernel(const CpuFeatures& cpu);

// True when `cpu` has the instructions `kernel` uses (a known kernel at or below best_kernel(cpu));
// a kernel above it dies of SIGILL at its first product.
bool can_run(const CpuFeatures& cpu, std::string_view kernel);

// The kernel `auto` moves to: best_kernel(cpu) when `loaded` is a known kernel below it (an older
// instruction set), else "" (keep what OpenBLAS chose: it knows this CPU).
std::string upgrade(const CpuFeatures& cpu, std::string_view loaded);

// A 67 x 45 x 39 float32 matmul through at::mm (the BLAS) against a double-precision loop: true
// when every element agrees to 1e-4 of its terms' magnitude. Milliseconds. `perturb` is added to
// one element of the BLAS result first (tests: the check must catch a wrong element).
bool sgemm_self_check(float perturb = 0);

}  // namespace remat::blas
