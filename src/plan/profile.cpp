#include "remat/costs.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <tuple>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "util/atomic_file.h"
#include "util/cache.h"
#include "util/timing.h"

namespace remat {

namespace {

using detail::Clock;
using detail::median;
using detail::ms_since;

using detail::build_identity;
using detail::cache_folder;

nlohmann::json to_json(const CostModel& c) {
  nlohmann::json ops = nlohmann::json::array();
  for (const OpTime& t : c.block) ops.push_back({t.forward_ms, t.backward_ms});
  return {{"block", ops}, {"other_ms", c.other_ms}, {"source", c.source}, {"matmul_gflops", c.matmul_gflops}};
}

CostModel from_json(const nlohmann::json& j) {
  CostModel c;
  for (const auto& op : j.at("block")) c.block.push_back({op.at(0).get<double>(), op.at(1).get<double>()});
  c.other_ms = j.at("other_ms").get<double>();
  c.source = j.at("source").get<std::string>();
  c.matmul_gflops = j.at("matmul_gflops").get<double>();
  return c;
}

// A rate or a time read back from a cache file, which anyone may have edited: positive, finite and
// below what any machine reaches (10^7 GFLOP/s, GB/s or ms).
bool plausible(double v) { return v > 0 && v < 1e7; }

// Why a cached profile cannot be used for a block of `ops` ops, or "" when it can.
std::string check_cached(const CostModel& c, size_t ops, double other_1, double adam) {
  if (c.block.size() != ops) return fmt::format("it times {} ops, the block has {}", c.block.size(), ops);
  for (const OpTime& t : c.block)
    if (!(t.forward_ms >= 0 && t.forward_ms < 1e7) || !(t.backward_ms >= 0 && t.backward_ms < 1e7))
      return fmt::format("an op time of {} / {} ms", t.forward_ms, t.backward_ms);
  if (!(std::abs(other_1) < 1e7) || !(adam >= 0 && adam < 1e7) || !(c.matmul_gflops >= 0 && c.matmul_gflops < 1e7))
    return "a step or rate out of range";
  return "";
}

}  // namespace

// One layer of the config, timed a step at a time (NOTE [The planner], 5).
struct LayerProbe::State {
  explicit State(const ModelConfig& cfg)
      : full(cfg), one(with_one_layer(cfg)), model(make(one, exec)), adam(model->parameters(), AdamOptions{1e-4}) {
    std::tie(input, target) = random_batch(one);
    n_ops = model->spec().block.ops.size();
    // A model without a stem feeds the data to its first block, which then computes no input
    // gradient. Every later block does (the linears' dx GEMMs: a third of their backward), so the
    // layer is timed as an interior one, its input needing a gradient, and what the first block
    // saves is timed on the plain data in the same rounds.
    data_input = !model->spec().has_stem;
    interior = data_input ? input.detach().clone().requires_grad_(true) : input;
    fwd.resize(n_ops);
    bwd.resize(n_ops);
    // Adam's share grows with the layers: it is timed on one block's parameters as well.
    block_params = model->block_params(0);
    for (at::Tensor& p : block_params) p.mutable_grad() = at::ones_like(p);
    block_adam = std::make_unique<Adam>(block_params, AdamOptions{1e-4});
  }
  static ModelConfig with_one_layer(ModelConfig c) {
    c.layers = 1;
    return c;
  }
  static GPT make(const ModelConfig& one, ExecOptions& exec) {
    exec.timer = std::make_shared<OpTimes>();
    at::manual_seed(1);
    return GPT(one, Policy::parse("none"), exec);
  }
  double block_bwd() const {
    double ms = 0;
    for (size_t op = 0; op < n_ops; ++op) ms += exec.timer->backward_ms[op];
    return ms;
  }

  ModelConfig full, one;
  ExecOptions exec;
  GPT model;
  Adam adam;
  at::Tensor input, target, interior;
  size_t n_ops = 0;
  bool data_input = false;
  std::vector<at::Tensor> block_params;
  std::unique_ptr<Adam> block_adam;
  int calls = 0;
  std::vector<std::vector<double>> fwd, bwd;
  std::vector<double> other, first_saving, adam_ms;
};

LayerProbe::LayerProbe(const ModelConfig& cfg) : s_(std::make_unique<State>(cfg)) {}
LayerProbe::~LayerProbe() = default;

void LayerProbe::step() {
  State& s = *s_;
  double plain_bwd = 0;
  if (s.data_input) {
    s.exec.timer->zero();
    s.adam.zero_grad();
    s.model->forward(s.input, s.target).backward();
    plain_bwd = s.block_bwd();
  }
  s.exec.timer->zero();
  s.adam.zero_grad();
  s.interior.mutable_grad() = at::Tensor();
  const auto t0 = Clock::now();
  s.model->forward(s.interior, s.target).backward();
  s.adam.step();
  const double step = ms_since(t0);
  const auto t1 = Clock::now();
  s.block_adam->step();
  const double adam = ms_since(t1);
  s.adam.zero_grad();          // the probe holds no gradients between its steps
  if (s.calls++ == 0) return;  // warm-up
  double block = 0;
  for (size_t op = 0; op < s.n_ops; ++op) {
    s.fwd[op].push_back(s.exec.timer->forward_ms[op]);
    s.bwd[op].push_back(s.exec.timer->backward_ms[op]);
    block += s.exec.timer->forward_ms[op] + s.exec.timer->backward_ms[op];
  }
  s.other.push_back(std::max(0.0, step - block));
  if (s.data_input) s.first_saving.push_back(std::max(0.0, s.block_bwd() - plain_bwd));
  s.adam_ms.push_back(adam);
}

int LayerProbe::rounds() const { return std::max(0, s_->calls - 1); }

double LayerProbe::other_one_layer_ms() const {
  return median(s_->other) - (s_->data_input ? median(s_->first_saving) : 0.0);
}
double LayerProbe::adam_block_ms() const { return median(s_->adam_ms); }

CostModel LayerProbe::costs() const {
  if (rounds() < 1) fail("LayerProbe::costs needs a timed step after the warm-up one; {} step(s) taken", s_->calls);
  CostModel c;
  for (size_t op = 0; op < s_->n_ops; ++op) c.block.push_back({median(s_->fwd[op]), median(s_->bwd[op])});
  c.other_ms = other_one_layer_ms() + static_cast<double>(s_->full.layers - 1) * adam_block_ms();
  c.source = fmt::format("one layer, median of {} steps", rounds());
  c.measured = true;
  return c;
}

CostModel measure_costs(const ModelConfig& cfg, const ThreadConfig& threads, int reps, const std::string& cache_dir) {
  if (reps < 1) fail("measure_costs: reps must be >= 1, got {}", reps);
  ModelConfig one = cfg;
  one.layers = 1;
  const std::string key =
      fmt::format("{} ffn={} attn-block={} threads={} blas={} gemm={} reps={} build={}", describe(one), one.hidden(),
                  one.attn_block, to_string(threads), blas_name(), gemm_name(), reps, build_identity());
  const std::string folder = cache_folder(cache_dir);
  const std::string path = fmt::format("{}/costs-{:016x}.json", folder, std::hash<std::string>{}(key));
  std::string rejected;  // why a cached profile was not used
  if (const std::optional<nlohmann::json> cached = detail::read_cached_json(path, &rejected)) {
    try {
      const nlohmann::json& j = *cached;
      if (j.at("key").get<std::string>() == key) {
        CostModel c = from_json(j.at("costs"));
        const double other_1 = j.at("other_1_ms").get<double>(), adam = j.at("adam_block_ms").get<double>();
        rejected = check_cached(c, make_model(one).block.ops.size(), other_1, adam);
        if (rejected.empty()) {
          c.other_ms = other_1 + static_cast<double>(cfg.layers - 1) * adam;
          c.source += " (cached in " + path + ")";
          c.measured = true;
          c.threads = threads;
          return c;
        }
      }
    } catch (const std::exception& e) {
      rejected = e.what();  // an unreadable cache entry is measured again and replaced
    }
  }

  apply_threads(threads);
  LayerProbe probe(cfg);
  // The matmul rate before and after the rounds: what a later run compares its own rate with.
  const double gflops_before = matmul_gflops(1024, 5);
  for (int r = 0; r <= reps; ++r) probe.step();
  CostModel c = probe.costs();
  c.matmul_gflops = 0.5 * (gflops_before + matmul_gflops(1024, 5));
  c.source = "measured on this machine: " + c.source;
  if (!rejected.empty())
    c.source += fmt::format(" (the cached profile {} was unusable, {}; measured again)", path, rejected);
  c.threads = threads;
  try {
    std::filesystem::create_directories(folder);
    nlohmann::json j = {{"key", key},
                        {"costs", to_json(c)},
                        {"other_1_ms", probe.other_one_layer_ms()},
                        {"adam_block_ms", probe.adam_block_ms()}};
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception&) {
    // Caching is an optimisation: an unwritable cache folder only costs a profile next time.
  }
  return c;
}

MachineRates calibrated_rates(const ThreadConfig& threads, const std::string& cache_dir) {
  const std::string cpu = detail::cpu_model();
  // The rates are the engine's GEMM at 1024^3 and an add: OpenBLAS's kernel matters only when the
  // GEMM is OpenBLAS's. `plan` re-executes for the kernel only then, `bench` always: keyed on the
  // kernel they would keep two calibrations of one machine, measured at different times.
  const std::string blas = gemm_uses_blas() ? " blas=" + blas_name() : "";
  const std::string key = fmt::format("cpu={}{} gemm={} threads={}", cpu, blas, gemm_name(), to_string(threads));
  const std::string folder = cache_folder(cache_dir);
  const std::string path = fmt::format("{}/rates-{:016x}.json", folder, std::hash<std::string>{}(key));
  if (const std::optional<nlohmann::json> cached = detail::read_cached_json(path)) {
    try {
      const nlohmann::json& j = *cached;
      MachineRates r{j.at("matmul_gflops").get<double>(), j.at("memory_gbps").get<double>()};
      if (j.at("key").get<std::string>() == key && plausible(r.matmul_gflops) && plausible(r.memory_gbps)) return r;
    } catch (const std::exception&) {
      // An unreadable calibration is measured again and replaced.
    }
  }
  apply_threads(threads);
  const MachineRates r = measure_rates();
  try {
    std::filesystem::create_directories(folder);
    nlohmann::json j = {{"key", key}, {"matmul_gflops", r.matmul_gflops}, {"memory_gbps", r.memory_gbps}};
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception&) {
    // Unwritable: the next run calibrates again.
  }
  return r;
}

MachineRates measure_rates() {
  MachineRates r;
  r.matmul_gflops = matmul_gflops(1024, 9);
  const at::Tensor a = at::randn({1 << 24}), b = at::randn({1 << 24});
  at::Tensor c = a + b;
  std::vector<double> s;
  for (int i = 0; i < 7; ++i) {
    const auto t0 = Clock::now();
    at::add_out(c, a, b);
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  r.memory_gbps = 3.0 * static_cast<double>(a.nbytes()) / median(s) / 1e9;  // two reads, one write
  return r;
}

}  // namespace remat
