// --gemm auto: each class of the engine's products on the GEMM measured fastest here (runtime.h,
// choose_gemm), and the rates a step's floor is measured at.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/runtime.h"
#include "remat/version.h"
#include "util/atomic_file.h"
#include "util/cache.h"
#include "util/gemm.h"
#include "util/parallel.h"
#include "util/timing.h"

namespace remat {

namespace {

using detail::GemmClass;
using detail::GemmImpl;
using detail::GemmTable;
using detail::kGemmClasses;

// The GEMMs a class may run on, in the build.
std::vector<GemmImpl> candidates(int c) {
  std::vector<GemmImpl> out;
  for (GemmImpl i : {GemmImpl::OneDnn, GemmImpl::Blas, GemmImpl::BlasThreads})
    if (detail::available(i) && !(c >= 3 && i == GemmImpl::BlasThreads)) out.push_back(i);
  return out;
}

// Which of n candidates runs j-th in `round`: one order, then the other, so that neither order's
// place in a drift is always one candidate's.
size_t nth_in_round(int round, size_t j, size_t n) { return round % 2 == 0 ? j : n - 1 - j; }

// One class's products, on operands made once: a GPT layer's linears at 1024 tokens (widths 512
// and 2048, both ways), or its attention products (64 heads of 128 x 64, 8 of 1024 x 64).
struct Workload {
  std::function<void()> run;
  double flops = 0;
};

Workload workload(int c) {
  at::manual_seed(11);
  Workload w;
  if (c < 3) {
    auto pairs = std::make_shared<std::vector<std::pair<at::Tensor, at::Tensor>>>();
    auto outs = std::make_shared<std::vector<at::Tensor>>();
    const bool ta = c == 2, tb = c == 0;
    for (auto [in, out] : {std::pair<int64_t, int64_t>{512, 2048}, {2048, 512}}) {
      // NT: x (1024, in) W(out, in)^T; NN: dy (1024, out) W (out, in); TN: dy(1024, out)^T x (1024, in).
      const at::Tensor a = at::randn({1024, c == 0 ? in : out});
      const at::Tensor b = c == 0 ? at::randn({out, in}) : c == 1 ? at::randn({out, in}) : at::randn({1024, in});
      pairs->push_back({a, b});
      outs->push_back(at::empty({c == 2 ? out : 1024, c == 0 ? out : in}));
      w.flops += 2.0 * 1024 * in * out;
    }
    w.run = [pairs, outs, ta, tb] {
      for (size_t i = 0; i < pairs->size(); ++i)
        detail::mm_out((*outs)[i], (*pairs)[i].first, ta, (*pairs)[i].second, tb, 0.0);
    };
    return w;
  }
  const bool ta = c == 5, tb = c == 3;
  struct Heads {
    at::Tensor a, b, out;
  };
  auto sets = std::make_shared<std::vector<Heads>>();
  for (auto [heads, t] : {std::pair<int64_t, int64_t>{64, 128}, {8, 1024}}) {
    const int64_t d = 64;
    Heads h;
    if (c == 3) h = {at::randn({1, heads, t, d}), at::randn({1, heads, t, d}), at::empty({1, heads, t, t})};
    if (c == 4) h = {at::randn({1, heads, t, t}), at::randn({1, heads, t, d}), at::empty({1, heads, t, d})};
    if (c == 5) h = {at::randn({1, heads, t, t}), at::randn({1, heads, t, d}), at::empty({1, heads, t, d})};
    sets->push_back(h);
    w.flops += 2.0 * static_cast<double>(heads) * t * t * d;
  }
  w.run = [sets, ta, tb] {
    for (Heads& h : *sets) detail::batched_gemm(h.a, ta, h.b, tb, h.out, 1.0, 0.0);
  };
  return w;
}

// The choice cached under `key` at `path`, set as the engine's table; false (m untouched) when
// there is none, or it is another key's, or unreadable (measured again and replaced).
bool load_choice(const std::string& path, const std::string& key, GemmMeasurement& m) {
  const std::optional<nlohmann::json> cached = detail::read_cached_json(path);
  if (!cached) return false;
  try {
    const nlohmann::json& j = *cached;
    if (j.at("key").get<std::string>() != key) return false;
    const GemmTable t = detail::parse_gemm_table(j.at("table").get<std::string>());
    std::vector<GemmClassRates> classes;
    for (const auto& c : j.at("classes")) {
      GemmClassRates r;
      r.product = c.at("product").get<std::string>();
      r.chosen = c.at("chosen").get<std::string>();
      for (const auto& [name, rate] : c.at("gflops").items()) r.gflops.emplace_back(name, rate.get<double>());
      classes.push_back(std::move(r));
    }
    if (classes.size() != static_cast<size_t>(kGemmClasses)) return false;
    std::vector<std::pair<std::string, double>> pass_ms;
    for (const auto& p : j.at("pass_ms")) pass_ms.emplace_back(p.at(0).get<std::string>(), p.at(1).get<double>());
    detail::set_gemm_table(t);
    m.classes = std::move(classes);
    m.pass_ms = std::move(pass_ms);
    m.source = "measured earlier, cached in " + path;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void save_choice(const std::string& folder, const std::string& path, const std::string& key, const GemmTable& table,
                 const GemmMeasurement& m) {
  try {
    std::filesystem::create_directories(folder);
    const nlohmann::json j = {{"key", key},
                              {"table", detail::to_string(table)},
                              {"classes", detail::gemm_classes_json(m.classes)},
                              {"pass_ms", m.pass_ms}};
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception&) {
    // Unwritable: the next run measures again.
  }
}

// The incumbent of every class: the loaded BLAS's cblas_sgemm, the GEMM LibTorch's own at::mm
// runs on (oneDNN's where the BLAS has none).
size_t incumbent(const std::vector<GemmImpl>& impls) {
  const auto blas = std::find(impls.begin(), impls.end(), GemmImpl::Blas);
  return blas == impls.end() ? 0 : static_cast<size_t>(blas - impls.begin());
}

// Every candidate of class c, in rounds (a warm-up, then detail::decide_by_rounds') that run each once, in one
// order and then the other, as a pass runs them: the kernel threads poll for their jobs unless the
// BLAS's own threads need the cores. table[c] is set by the rule among those on the kernel threads;
// the BLAS's threads, a choice for the whole pass, are choose_linear_threads' to make.
GemmClassRates measure_class(int c, const ThreadConfig& threads, GemmTable& table) {
  const Workload w = workload(c);
  const std::vector<GemmImpl> impls = candidates(c);
  std::vector<std::vector<double>> ms(impls.size());
  auto run = [&](size_t i) {
    double sample_ms = 0;
    {
      GemmTable t = table;
      t[c] = impls[i];
      detail::set_gemm_table(t);
      detail::KernelThreadsAwake awake(impls[i] != GemmImpl::BlasThreads && threads.aten == 1);
      const auto t0 = detail::Clock::now();
      w.run();
      sample_ms = detail::ms_since(t0);
    }
    if (impls[i] == GemmImpl::BlasThreads) detail::let_blas_threads_sleep();  // every sample starts alike
    return std::max(sample_ms, 1e-3);
  };
  for (size_t i = 0; i < impls.size(); ++i) run(i);  // warm-up: packing buffers, pages, threads
  std::vector<size_t> pooled;                        // the kernel threads' candidates, by index into impls
  for (size_t i = 0; i < impls.size(); ++i)
    if (impls[i] != GemmImpl::BlasThreads) pooled.push_back(i);
  std::vector<GemmImpl> pooled_impls;
  for (size_t i : pooled) pooled_impls.push_back(impls[i]);
  auto pooled_ms = [&] {
    std::vector<std::vector<double>> out;
    for (size_t i : pooled) out.push_back(ms[i]);
    return out;
  };
  auto round = [&](int r) {
    for (size_t j = 0; j < impls.size(); ++j) {
      const size_t i = nth_in_round(r, j, impls.size());
      ms[i].push_back(run(i));
    }
  };
  table[c] = pooled_impls.at(detail::decide_by_rounds(round, pooled_ms, incumbent(pooled_impls)));
  GemmClassRates r;
  r.product = std::string(detail::to_string(static_cast<GemmClass>(c)));
  for (size_t i = 0; i < impls.size(); ++i)
    r.gflops.emplace_back(detail::to_string(impls[i]), w.flops / (detail::median(ms[i]) * 1e6));
  r.chosen = std::string(detail::to_string(table[c]));
  return r;
}

// A pass of every class's products in turn under `t` (on the threads choose_gemm applied), ms: the
// kernel threads poll as BlockExecutor's passes let them (detail::pass_owns_the_cores).
double run_pass(const std::vector<Workload>& classes, const GemmTable& t) {
  detail::set_gemm_table(t);
  double ms = 0;
  {
    detail::KernelThreadsAwake awake(detail::pass_owns_the_cores());
    const auto t0 = detail::Clock::now();
    for (const Workload& w : classes) w.run();
    ms = detail::ms_since(t0);
  }
  if (!detail::gemm_on_kernel_threads()) detail::let_blas_threads_sleep();  // the next pass starts alike
  return ms;
}

// The linears on the BLAS's own threads, or on remat's kernel threads with `table`'s choice: the
// BLAS's threads spin on the cores after each call, and while any product runs on them the kernel
// threads sleep between jobs (waking one costs the host's scheduler), so what they cost shows in a
// whole pass, not in a product timed alone. Passes run in pairs, each in the other order from the
// last; the kernel threads, which the engine's passes own, are the incumbent of
// winner_of_rounds: the BLAS's threads cost most in spells (steps 10-25% slower on a busy
// host) that a median of kGemmRounds passes can miss.
void choose_linear_threads(GemmTable& table, GemmMeasurement& m) {
  if (!detail::available(GemmImpl::BlasThreads)) return;
  std::vector<Workload> classes;
  for (int c = 0; c < kGemmClasses; ++c) classes.push_back(workload(c));
  GemmTable threaded = table;
  for (int c = 0; c < 3; ++c) threaded[c] = GemmImpl::BlasThreads;
  const GemmTable tables[2] = {table, threaded};  // 0: the kernel threads, the incumbent
  std::vector<std::vector<double>> ms(2);
  auto round = [&](int r) {  // r = 0 the warm-up
    for (size_t j = 0; j < 2; ++j) {
      const size_t i = nth_in_round(r, j, 2);
      const double pass_ms = run_pass(classes, tables[i]);
      if (r > 0) ms[i].push_back(pass_ms);
    }
  };
  round(0);
  const size_t chosen = detail::decide_by_rounds(
      round, [&] { return ms; }, 0);
  m.pass_ms = {{"kernel-threads", detail::median(ms[0])}, {"blas-threads", detail::median(ms[1])}};
  if (chosen == 1) {
    table = threaded;
    for (int c = 0; c < 3; ++c) m.classes[static_cast<size_t>(c)].chosen = "blas-threads";
  }
}

}  // namespace

namespace {

// The rounds in which challenger i was not faster than the incumbent; -1 when i is the incumbent or
// its samples are not of the incumbent's rounds.
int slower_rounds(const std::vector<std::vector<double>>& times, size_t incumbent, size_t i) {
  if (incumbent >= times.size()) REMAT_INTERNAL("incumbent {} of {} candidates", incumbent, times.size());
  const std::vector<double>&held = times[incumbent], &t = times[i];
  if (i == incumbent || t.empty() || t.size() != held.size()) return -1;
  int slower = 0;
  for (size_t r = 0; r < t.size(); ++r) slower += t[r] < held[r] ? 0 : 1;
  return slower;
}

// Challenger i's lead in its middle round: the median over rounds of the incumbent's time over
// its own (1.2: 20% faster). REQUIRES: slower_rounds(times, incumbent, i) >= 0.
double median_lead(const std::vector<std::vector<double>>& times, size_t incumbent, size_t i) {
  std::vector<double> leads;
  for (size_t r = 0; r < times[i].size(); ++r) leads.push_back(times[incumbent][r] / times[i][r]);
  return detail::median(leads);
}

// Whether challenger i beats the incumbent under winner_of_rounds' rule, with `lost` rounds forgiven.
bool beats(const std::vector<std::vector<double>>& times, size_t incumbent, size_t i, int lost) {
  const int slower = slower_rounds(times, incumbent, i);
  if (slower < 0 || 2 * slower >= static_cast<int>(times[i].size())) return false;  // a majority, at the least
  return slower <= lost || median_lead(times, incumbent, i) >= kGemmClearLead;
}

}  // namespace

size_t detail::winner_of_rounds(const std::vector<std::vector<double>>& times, size_t incumbent, int lost) {
  size_t chosen = incumbent;
  for (size_t i = 0; i < times.size(); ++i)
    if (beats(times, incumbent, i, lost) &&
        (chosen == incumbent || detail::median(times[i]) < detail::median(times[chosen])))
      chosen = i;
  return chosen;
}

size_t detail::decide_by_rounds(const std::function<void(int round)>& round,
                                const std::function<std::vector<std::vector<double>>()>& times, size_t incumbent) {
  for (int r = 1; r <= kGemmRounds; ++r) round(r);
  const std::vector<std::vector<double>> ten = times();
  const size_t first = winner_of_rounds(ten, incumbent);
  if (first != incumbent || !undecided(ten, incumbent)) return first;
  for (int r = kGemmRounds + 1; r <= 2 * kGemmRounds; ++r) round(r);
  return winner_of_rounds(times(), incumbent, kGemmRoundsLostOfTwice);
}

bool detail::undecided(const std::vector<std::vector<double>>& times, size_t incumbent, int lost) {
  for (size_t i = 0; i < times.size(); ++i) {
    const int slower = slower_rounds(times, incumbent, i);
    if (slower >= 0 && 2 * slower < static_cast<int>(times[i].size()) && !beats(times, incumbent, i, lost))
      return true;  // won most rounds, yet lost more than `lost` without a clear lead
  }
  return false;
}

nlohmann::json detail::gemm_classes_json(const std::vector<GemmClassRates>& classes) {
  nlohmann::json out = nlohmann::json::array();
  for (const GemmClassRates& r : classes) {
    nlohmann::json rates = nlohmann::json::object();
    for (const auto& [name, rate] : r.gflops) rates[name] = rate;
    out.push_back({{"product", r.product}, {"chosen", r.chosen}, {"gflops", rates}});
  }
  return out;
}

GemmMeasurement choose_gemm(const ThreadConfig& threads, const std::string& cache_dir) {
  // Once per machine, GEMM libraries, thread count and remat release: a rebuild of the same release
  // keeps the choice, so a run's bits do not change with it.
  const std::string key = fmt::format("cpu={} {} threads={} remat={}", detail::cpu_model(), detail::gemm_libraries(),
                                      to_string(threads), version());
  const std::string folder = detail::cache_folder(cache_dir);
  const std::string path = fmt::format("{}/gemm-{:016x}.json", folder, std::hash<std::string>{}(key));
  GemmMeasurement m;
  if (load_choice(path, key, m)) return m;
  if (!detail::gemm_available())
    fail_runtime(
        "--gemm auto: this LibTorch exports no oneDNN sgemm and no BLAS with cblas_sgemm is loaded; "
        "remat needs OpenBLAS (make setup)");
  // The trials set the threads and the table: the threads are put back however the measurement
  // ends, the table unless a choice was made.
  struct Trial {
    ThreadConfig threads = current_threads();
    GemmTable table = detail::gemm_table();
    bool chosen = false;
    ~Trial() {
      if (!chosen) detail::set_gemm_table(table);
      apply_threads(threads);
    }
  } trial;
  apply_threads(threads);
  GemmTable table = trial.table;
  for (int c = 0; c < kGemmClasses; ++c) m.classes.push_back(measure_class(c, threads, table));
  choose_linear_threads(table, m);
  detail::set_gemm_table(table);
  trial.chosen = true;
  m.source = fmt::format("measured now, on {}, threads {}", detail::cpu_model(), to_string(threads));
  save_choice(folder, path, key, table, m);
  return m;
}

std::string gemm_record() { return detail::to_string(detail::gemm_table()); }

void restore_gemm(std::string_view record) { detail::set_gemm_table(detail::parse_gemm_table(record)); }

FastestMatmul fastest_matmul_gflops(int n, int reps) {
  if (reps < 1 || reps > 16384) fail("fastest_matmul_gflops: reps must be in 1..16384, got {}", reps);
  // Every GEMM once per round, in one order and then the other: a busy spell slows the GEMMs of
  // its rounds alike, not whichever ran through it.
  const std::vector<GemmImpl> impls = candidates(0);
  std::vector<std::vector<double>> rates(impls.size());
  for (int round = 0; round < reps; ++round)
    for (size_t j = 0; j < impls.size(); ++j) {
      const size_t i = nth_in_round(round, j, impls.size());
      rates[i].push_back(matmul_gflops(n, 1, detail::to_string(impls[i])));
      if (impls[i] == GemmImpl::BlasThreads) detail::let_blas_threads_sleep();  // the next to run has the cores
    }
  FastestMatmul best;
  for (size_t i = 0; i < impls.size(); ++i) {
    const double g = detail::median(rates[i]);
    best.rates.emplace_back(detail::to_string(impls[i]), g);
    if (g > best.gflops) {
      best.gflops = g;
      best.gemm = std::string(detail::to_string(impls[i]));
    }
  }
  return best;
}

}  // namespace remat
