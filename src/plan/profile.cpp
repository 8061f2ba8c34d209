#include "remat/costs.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/model.h"
#include "remat/optim.h"
#include "util/atomic_file.h"
#include "util/timing.h"

namespace remat {

namespace {

using detail::Clock;
using detail::median;
using detail::ms_since;

// Identifies the code being timed: the running executable's size and modification time. A rebuilt
// remat times its ops afresh instead of trusting what an older build measured.
std::string build_identity() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown-build";
  const auto size = std::filesystem::file_size(exe, ec);
  const auto time = std::filesystem::last_write_time(exe, ec).time_since_epoch().count();
  return fmt::format("{}:{}:{}", exe.string(), size, time);
}

std::string cache_folder(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* c = std::getenv("REMAT_CACHE")) return c;
  if (const char* x = std::getenv("XDG_CACHE_HOME")) return std::string(x) + "/remat";
  if (const char* h = std::getenv("HOME")) return std::string(h) + "/.cache/remat";
  return ".remat-cache";
}

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

}  // namespace

CostModel measure_costs(const ModelConfig& cfg, const ThreadConfig& threads, int reps, const std::string& cache_dir) {
  if (reps < 1) fail("measure_costs: reps must be >= 1, got {}", reps);
  ModelConfig one = cfg;
  one.layers = 1;
  const std::string key = fmt::format("{} ffn={} attn-block={} threads={} blas={} gemm={} reps={} build={}",
                                      describe(one), one.hidden(), one.attn_block, to_string(threads), blas_name(),
                                      gemm_name(), reps,
                                      build_identity());
  const std::string folder = cache_folder(cache_dir);
  const std::string path = fmt::format("{}/costs-{:016x}.json", folder, std::hash<std::string>{}(key));
  if (std::ifstream in(path); in) {
    try {
      const nlohmann::json j = nlohmann::json::parse(in);
      if (j.at("key").get<std::string>() == key) {
        CostModel c = from_json(j.at("costs"));
        const double other_1 = j.at("other_1_ms").get<double>(), adam = j.at("adam_block_ms").get<double>();
        c.other_ms = other_1 + static_cast<double>(cfg.layers - 1) * adam;
        c.source += " (cached in " + path + ")";
        c.threads = threads;
        return c;
      }
    } catch (const std::exception&) {
      // An unreadable cache entry is measured again and replaced.
    }
  }

  apply_threads(threads);
  ExecOptions exec;
  exec.timer = std::make_shared<OpTimes>();
  at::manual_seed(1);
  GPT model(one, Policy::parse("none"), exec);
  auto [input, target] = random_batch(one);
  Adam adam(model->parameters(), AdamOptions{1e-4});
  const size_t n_ops = model->spec().block.ops.size();
  // A model without a stem feeds the data to its first block, which then computes no input
  // gradient. Every later block does (the linears' dx GEMMs: a third of their backward), so the
  // layer is timed as an interior one, its input needing a gradient, and what the first block saves
  // is timed on the plain data in the same rounds.
  const bool data_input = !model->spec().has_stem;
  const at::Tensor interior = data_input ? input.detach().clone().requires_grad_(true) : input;
  std::vector<std::vector<double>> fwd(n_ops), bwd(n_ops);
  std::vector<double> other, first_saving;
  auto block_bwd = [&] {
    double ms = 0;
    for (size_t op = 0; op < n_ops; ++op) ms += exec.timer->backward_ms[op];
    return ms;
  };
  // The matmul rate before and after the rounds: what a later run compares its own rate with.
  const double gflops_before = matmul_gflops(1024, 5);
  for (int r = 0; r <= reps; ++r) {
    double plain_bwd = 0;
    if (data_input) {
      exec.timer->zero();
      adam.zero_grad();
      model->forward(input, target).backward();
      plain_bwd = block_bwd();
    }
    exec.timer->zero();
    adam.zero_grad();
    interior.mutable_grad() = at::Tensor();
    const auto t0 = Clock::now();
    model->forward(interior, target).backward();
    adam.step();
    const double step = ms_since(t0);
    if (r == 0) continue;  // warm-up
    double block = 0;
    for (size_t op = 0; op < n_ops; ++op) {
      fwd[op].push_back(exec.timer->forward_ms[op]);
      bwd[op].push_back(exec.timer->backward_ms[op]);
      block += exec.timer->forward_ms[op] + exec.timer->backward_ms[op];
    }
    other.push_back(std::max(0.0, step - block));
    if (data_input) first_saving.push_back(std::max(0.0, block_bwd() - plain_bwd));
  }
  // Adam's share grows with the layers: time it on one block's parameters.
  std::vector<double> adam_ms;
  {
    std::vector<at::Tensor> params = model->block_params(0);
    for (at::Tensor& p : params) p.mutable_grad() = at::ones_like(p);
    Adam block_adam(params, AdamOptions{1e-4});
    for (int r = 0; r <= reps; ++r) {
      const auto t0 = Clock::now();
      block_adam.step();
      if (r > 0) adam_ms.push_back(ms_since(t0));
    }
  }

  CostModel c;
  c.matmul_gflops = 0.5 * (gflops_before + matmul_gflops(1024, 5));
  for (size_t op = 0; op < n_ops; ++op) c.block.push_back({median(fwd[op]), median(bwd[op])});
  const double other_1 = median(other) - median(first_saving), adam_block = median(adam_ms);
  c.source = fmt::format("measured on this machine: one layer, median of {} steps", reps);
  c.threads = threads;
  try {
    std::filesystem::create_directories(folder);
    nlohmann::json j = {{"key", key}, {"costs", to_json(c)}, {"other_1_ms", other_1}, {"adam_block_ms", adam_block}};
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception&) {
    // Caching is an optimisation: an unwritable cache folder only costs a profile next time.
  }
  c.other_ms = other_1 + static_cast<double>(cfg.layers - 1) * adam_block;
  return c;
}

MachineRates calibrated_rates(const ThreadConfig& threads, const std::string& cache_dir) {
  std::string cpu = "unknown cpu";
  if (std::ifstream info("/proc/cpuinfo"); info)
    for (std::string line; std::getline(info, line);)
      if (line.rfind("model name", 0) == 0) {
        cpu = line.substr(line.find(':') + 1);
        break;
      }
  const std::string key =
      fmt::format("cpu={} blas={} gemm={} threads={}", cpu, blas_name(), gemm_name(), to_string(threads));
  const std::string folder = cache_folder(cache_dir);
  const std::string path = fmt::format("{}/rates-{:016x}.json", folder, std::hash<std::string>{}(key));
  if (std::ifstream in(path); in) {
    try {
      const nlohmann::json j = nlohmann::json::parse(in);
      MachineRates r{j.at("matmul_gflops").get<double>(), j.at("memory_gbps").get<double>()};
      if (j.at("key").get<std::string>() == key && r.matmul_gflops > 0 && r.memory_gbps > 0) return r;
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
