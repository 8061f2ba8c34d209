#include "remat/blas_kernel.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <ATen/ATen.h>

namespace remat::blas {

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  f.intel = b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;  // "GenuineIntel"
  f.amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;    // "AuthenticAMD"
  __get_cpuid(1, &a, &b, &c, &d);
  f.sse42 = c & (1u << 20);
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  const bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6;
  f.avx = avx && ymm;
  if (max_leaf >= 7) {
    __get_cpuid_count(7, 0, &a, &b, &c, &d);
    f.avx2 = f.avx && (b & (1u << 5));
    const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
    f.avx512 = avx512 && zmm;
    __get_cpuid_count(7, 1, &a, &b, &c, &d);
    f.avx512_bf16 = f.avx512 && (a & (1u << 5));
  }
  f.fma = f.fma && f.avx;
#endif
  return f;
}

std::string loaded_kernel() {
  auto corename = reinterpret_cast<char* (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return corename == nullptr ? std::string() : std::string(corename());
}

const std::vector<std::string>& known_kernels() {
  static const std::vector<std::string> k = {"Prescott", "Nehalem",  "Sandybridge", "Haswell",
                                             "Zen",      "SkylakeX", "Cooperlake"};
  return k;
}

namespace {

// Instruction-set level: Haswell and Zen share AVX2 + FMA.
int level(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char ch) { return std::tolower(ch); });
  if (n == "prescott" || n == "core2" || n == "penryn" || n == "dunnington" || n == "atom") return 0;
  if (n == "nehalem" || n == "barcelona" || n == "opteron" || n == "opteron_sse3") return 1;
  if (n == "sandybridge" || n == "bulldozer" || n == "piledriver" || n == "steamroller" || n == "excavator") return 2;
  if (n == "haswell" || n == "zen") return 3;
  if (n == "skylakex") return 4;
  if (n == "cooperlake" || n == "sapphirerapids") return 5;
  return -1;
}

}  // namespace

std::string best_kernel(const CpuFeatures& cpu) {
  if (cpu.avx512_bf16) return "Cooperlake";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return cpu.amd ? "Zen" : "Haswell";
  if (cpu.avx) return "Sandybridge";
  if (cpu.sse42) return "Nehalem";
  return "Prescott";
}

bool can_run(const CpuFeatures& cpu, std::string_view kernel) {
  const int need = level(kernel);
  return need >= 0 && need <= level(best_kernel(cpu));
}

std::string upgrade(const CpuFeatures& cpu, std::string_view loaded) {
  const int have = level(loaded);
  const std::string best = best_kernel(cpu);
  return have >= 0 && have < level(best) ? best : std::string();
}

bool sgemm_self_check(float perturb) {
  const int64_t m = 67, k = 45, n = 39;
  at::Tensor a = at::empty({m, k}, at::kFloat), b = at::empty({k, n}, at::kFloat);
  float* pa = a.data_ptr<float>();
  float* pb = b.data_ptr<float>();
  uint32_t x = 2463534242u;  // xorshift: no generator state touched
  auto next = [&] {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    return static_cast<float>(x % 2001) / 1000.0f - 1.0f;
  };
  for (int64_t i = 0; i < m * k; ++i) pa[i] = next();
  for (int64_t i = 0; i < k * n; ++i) pb[i] = next();
  at::Tensor c = at::mm(a, b);
  float* pc = c.data_ptr<float>();
  pc[(m / 2) * n + n / 3] += perturb;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = 0, scale = 0;
      for (int64_t t = 0; t < k; ++t) {
        want += static_cast<double>(pa[i * k + t]) * pb[t * n + j];
        scale += std::fabs(static_cast<double>(pa[i * k + t]) * pb[t * n + j]);
      }
      if (!(std::fabs(pc[i * n + j] - want) <= 1e-4 * (scale + 1e-30))) return false;
    }
  return true;
}

}  // namespace remat::blas
