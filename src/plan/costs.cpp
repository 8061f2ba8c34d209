// Op costs: the model of time the planner optimises, and the one place that picks its source.
#include "remat/costs.h"

#include <algorithm>

#include <fmt/format.h>

#include "remat/error.h"
#include "remat/model.h"

namespace remat {

double CostModel::none_step_ms(int64_t layers) const {
  double block_ms = 0;
  for (const OpTime& t : block) block_ms += t.forward_ms + t.backward_ms;
  return static_cast<double>(layers) * block_ms + other_ms;
}

double CostModel::recompute_ms(const Schedule& schedule) const {
  double ms = 0;
  for (int op : schedule.recomputed) ms += block[op].forward_ms;
  return ms;
}

CostModel::OpStepMs CostModel::op_ms(const CompiledStep& plan) const {
  OpStepMs t;
  t.forward.assign(block.size(), 0.0);
  t.recompute.assign(block.size(), 0.0);
  t.backward.assign(block.size(), 0.0);
  for (const CompiledStage& st : plan.stages) {
    if (st.role != CompiledStage::Role::Block) continue;
    for (size_t op = 0; op < block.size(); ++op) {
      t.forward[op] += block[op].forward_ms;
      t.backward[op] += block[op].backward_ms;
    }
    for (int op : st.schedule->recomputed) t.recompute[op] += block[op].forward_ms;
    if (st.segment >= 0)  // a uniform:N segment reruns every forward op of its stages
      for (size_t op = 0; op < block.size(); ++op) t.recompute[op] += block[op].forward_ms;
  }
  return t;
}

double CostModel::step_ms(const CompiledStep& plan) const {
  double ms = none_step_ms(plan.model->layers);
  for (double r : op_ms(plan).recompute) ms += r;
  return ms;
}

namespace {

// Bytes an op reads and writes: inputs, outputs and parameters forward; the backward reads what
// it keeps and the output gradients, and writes the input and parameter gradients.
std::pair<int64_t, int64_t> bytes_moved(const BlockSpec& b, int op) {
  const OpNode& node = b.ops[op];
  int64_t params = 0;
  for (int p : node.params) params += b.param_bytes(p);
  int64_t in = 0, out = 0, reads = 0;
  for (int t : node.in) in += b.tensors[t].bytes();
  for (int t : node.out) out += b.tensors[t].bytes();
  for (int t : b.bwd_reads(op)) reads += b.tensors[t].bytes();
  return {in + out + params, reads + out + in + 2 * params};
}

double roofline_ms(int64_t flops, int64_t bytes, const MachineRates& r) {
  return std::max(static_cast<double>(flops) / (r.matmul_gflops * 1e6),
                  static_cast<double>(bytes) / (r.memory_gbps * 1e6));
}

}  // namespace

double MachineRates::comm_gbps(const BlockSpec& b, int op) const {
  if (b.ops[op].attn.ring > 1 && ring_gbps > 0) return ring_gbps;
  return b.ops[op].routing.exchanges() && expert_gbps > 0 ? expert_gbps : link_gbps;
}

namespace {

OpTime roofline(const BlockSpec& b, int op, const MachineRates& rates) {
  const OpFlops f = b.flops(op);
  const auto [fwd_bytes, bwd_bytes] = bytes_moved(b, op);
  return {roofline_ms(f.forward, fwd_bytes, rates), roofline_ms(f.backward, bwd_bytes, rates)};
}

OpTime comm_beyond(const BlockSpec& b, int op, const MachineRates& rates, const OpTime& compute) {
  const OpComm c = b.comm(op);
  const double gbps = rates.comm_gbps(b, op);
  if ((c.forward > 0 || c.backward > 0) && !(gbps > 0))
    fail(
        "op '{}' is split over tensor-, context- or expert-parallel ranks; MachineRates.link_gbps must be positive, "
        "got {}",
        b.ops[op].name, gbps);
  OpTime t{c.forward > 0 ? c.forward / (gbps * 1e6) : 0.0, c.backward > 0 ? c.backward / (gbps * 1e6) : 0.0};
  if (b.ops[op].attn.ring > 1)
    t = {std::max(0.0, t.forward_ms - compute.forward_ms), std::max(0.0, t.backward_ms - compute.backward_ms)};
  return t;
}

}  // namespace

OpTime op_comm_ms(const BlockSpec& b, int op, const MachineRates& rates) {
  return comm_beyond(b, op, rates, roofline(b, op, rates));
}

OpTime estimate_op(const BlockSpec& b, int op, const MachineRates& rates) {
  OpTime t = roofline(b, op, rates);
  const OpTime c = comm_beyond(b, op, rates, t);
  t.forward_ms += c.forward_ms;
  t.backward_ms += c.backward_ms;
  return t;
}

CostModel estimate_costs(const ModelSpec& spec, const MachineRates& rates) {
  if (!(rates.matmul_gflops > 0) || !(rates.memory_gbps > 0))
    fail("MachineRates must be positive, got {} GFLOP/s and {} GB/s", rates.matmul_gflops, rates.memory_gbps);
  auto op_time = [&](const BlockSpec& b, size_t op) { return estimate_op(b, static_cast<int>(op), rates); };
  CostModel c;
  for (size_t op = 0; op < spec.block.ops.size(); ++op) c.block.push_back(op_time(spec.block, op));
  auto stage_ms = [&](const BlockSpec& b) {
    double ms = 0;
    for (size_t op = 0; op < b.ops.size(); ++op) {
      const OpTime t = op_time(b, op);
      ms += t.forward_ms + t.backward_ms;
    }
    return ms;
  };
  // The engine's Adam: fp32 throughout.
  const int64_t f32 = dtype_size(DType::F32);
  c.other_ms =
      stage_ms(spec.head) + (spec.has_stem ? stage_ms(spec.stem) : 0.0) +
      static_cast<double>(spec.param_numel() * adam_bytes_per_param(f32, f32, 2 * f32, 0)) / (rates.memory_gbps * 1e6);
  c.matmul_gflops = rates.matmul_gflops;
  c.source = fmt::format("estimated: matmul FLOPs at {:.0f} GFLOP/s, bytes at {:.0f} GB/s", rates.matmul_gflops,
                         rates.memory_gbps);
  return c;
}

int64_t adam_bytes_per_param(int64_t grad, int64_t weight, int64_t moments, int64_t cast) {
  return grad + 2 * (weight + moments) + cast;
}

CostSource parse_cost_source(std::string_view text) {
  if (text == "auto") return CostSource::Auto;
  if (text == "measured") return CostSource::Measured;
  if (text == "estimated") return CostSource::Estimated;
  fail("unknown cost source '{}'; allowed: auto, measured, estimated", text);
}

CostModel choose_costs(const ModelConfig& cfg, CostSource source, const ThreadConfig& threads) {
  const ModelSpec spec = make_model(cfg);  // refuses an invalid config first
  // Measured where one layer runs here in seconds: what the engine's own check lets through.
  std::string refusal;
  try {
    check_engine(cfg);
  } catch (const Error& e) {
    refusal = e.what();
  }
  const bool runnable = refusal.empty();
  if (source == CostSource::Measured && !runnable)
    fail("measured costs need a config the engine runs here: {}; use estimated costs", refusal);
  apply_threads(threads);
  if (source != CostSource::Measured) {
    CostModel est = estimate_costs(spec, calibrated_rates(threads));
    est.threads = threads;
    const double layer_ms = est.none_step_ms(1) - est.other_ms;
    if (source == CostSource::Estimated || !runnable || layer_ms >= kLongestMeasuredLayerMs) return est;
  }
  return measure_costs(cfg, threads);
}

}  // namespace remat
