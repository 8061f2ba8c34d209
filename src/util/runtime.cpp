#include "remat/runtime.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "remat/error.h"
#include "util/cache.h"
#include "util/gemm.h"
#include "util/parallel.h"
#include "util/timing.h"

namespace remat {

namespace {

template <typename F>
F openblas_symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

int positive_int(std::string_view s, std::string_view text) {
  int v = s.empty() || s.size() > 4 ? -1 : 0;  // at most 4 digits: the sum cannot overflow
  for (size_t i = 0; v >= 0 && i < s.size(); ++i) v = s[i] >= '0' && s[i] <= '9' ? v * 10 + (s[i] - '0') : -1;
  if (v <= 0) fail("ThreadConfig '{}': expected N or A/B with positive integers (e.g. 1/2: ATen 1, BLAS 2)", text);
  return v;
}

}  // namespace

ThreadConfig default_threads() {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return {1, static_cast<int>(cores)};
}

ThreadConfig data_parallel_threads(int ranks) { return {1, std::max(1, default_threads().blas / std::max(1, ranks))}; }

ThreadConfig parse_threads(std::string_view text) {
  const size_t slash = text.find('/');
  const ThreadConfig t =
      slash == std::string_view::npos
          ? ThreadConfig{positive_int(text, text), positive_int(text, text)}
          : ThreadConfig{positive_int(text.substr(0, slash), text), positive_int(text.substr(slash + 1), text)};
  // Past a few threads per core they only wait for each other (999 ATen threads on 2 cores take
  // minutes for a millisecond step).
  const int most = 4 * default_threads().blas;
  if (t.aten > most || t.blas > most)
    fail("ThreadConfig '{}': at most {} threads each on this machine's {} cores (4 per core)", text, most,
         default_threads().blas);
  return t;
}

void apply_threads(const ThreadConfig& t) {
  at::set_num_threads(t.aten);
  if (auto set = openblas_symbol<void (*)(int)>("openblas_set_num_threads")) set(t.blas);
  detail::set_kernel_threads(t.blas);
}

std::string to_string(const ThreadConfig& t) { return std::to_string(t.aten) + "/" + std::to_string(t.blas); }

ThreadConfig current_threads() { return {at::get_num_threads(), detail::kernel_threads()}; }

std::string cpu_name() { return detail::cpu_model(); }

std::string cpu_kind() { return detail::cpu_kind(); }

std::string blas_name() {
  auto config = openblas_symbol<char* (*)()>("openblas_get_config");
  if (config == nullptr) return "unknown (not OpenBLAS)";
  std::string name = config();
  if (const char* note = std::getenv("REMAT_BLAS_NOTE"))  // the remat CLI chose (tools/remat.cpp)
    name += std::string(" (") + note + ")";
  else if (const char* forced = std::getenv("OPENBLAS_CORETYPE"))
    name += std::string(" (kernels forced by OPENBLAS_CORETYPE=") + forced + ")";
  return name;
}

double matmul_gflops(int n, int reps, std::string_view gemm) {
  if (n < 1 || n > 16384) fail("matmul_gflops: n must be in 1..16384, got {}", n);
  if (reps < 1 || reps > 16384) fail("matmul_gflops: reps must be in 1..16384, got {}", reps);
  // Another GEMM for the linear dy W class while this runs, the process's table put back after.
  struct Swap {
    detail::GemmTable before = detail::gemm_table();
    explicit Swap(std::string_view gemm) {
      if (gemm.empty()) return;
      detail::GemmTable t = before;
      t[static_cast<int>(detail::GemmClass::LinearNN)] = detail::parse_gemm_impl(gemm);
      detail::set_gemm_table(t);
    }
    ~Swap() { detail::set_gemm_table(before); }
  } swap(gemm);
  const at::Tensor a = at::randn({n, n});
  const at::Tensor b = at::randn({n, n});
  at::Tensor c = at::empty({n, n});
  detail::mm_out(c, a, false, b, false, 0.0);  // warm-up: threads, caches, pages
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = detail::Clock::now();
    detail::mm_out(c, a, false, b, false, 0.0);
    ms.push_back(detail::ms_since(t0));
  }
  return 2.0 * n * n * static_cast<double>(n) / (detail::median(ms) * 1e6);
}

namespace {
int64_t meminfo(const char* key) {
  std::ifstream in("/proc/meminfo");
  const std::string k = key;
  for (std::string line; std::getline(in, line);)
    if (line.rfind(k, 0) == 0) return std::atoll(line.c_str() + k.size()) * 1024;
  return 0;
}
}  // namespace

int64_t physical_memory() { return meminfo("MemTotal:"); }
int64_t available_memory() { return meminfo("MemAvailable:"); }

int64_t planned_share(int64_t limit) { return limit / 20 * 19; }

int64_t usable_memory() { return available_memory() / 10 * 9; }

}  // namespace remat
