// Op costs for the planner's time predictions: measured on this machine, or estimated from rates.
//
//   remat::CostModel c = remat::choose_costs(cfg, remat::CostSource::Auto, remat::default_threads());
//   c.step_ms(plan)   // predicted step time of a compiled CompiledStep
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "remat/block.h"
#include "remat/config.h"
#include "remat/runtime.h"
#include "remat/schedule.h"

namespace remat {

struct OpTime {
  double forward_ms = 0;  // also the cost of one recompute
  double backward_ms = 0;
};

struct CostModel {
  std::vector<OpTime> block;  // by op id of ModelSpec::block, one layer
  double other_ms = 0;        // per step: stem, head, optimizer, framework, less the input gradient
                              // a stemless model's first block does not compute (may be negative)
  std::string source;         // "measured ..." or "estimated ..."
  bool measured = false;      // timed on this machine (a LayerProbe), not estimated from rates
  ThreadConfig threads;       // the run these costs describe (sizes some scratch memory)
  // The 1024^3 float32 matmul rate (remat::matmul_gflops) when the costs were taken; 0: not known.
  // Shown beside a run's own rate. Scaling the times by the ratio of the two was tried and made
  // the seed's predictions worse (4 runs, 8 rows: +4..+13% in 7 rows, where the unscaled times
  // were off by -7..+3%): on a shared machine the two rates do not move together.
  double matmul_gflops = 0;

  // Step time with every activation kept.
  double none_step_ms(int64_t layers) const;
  // Time the ops a schedule reruns take, for one layer.
  double recompute_ms(const Schedule& schedule) const;
  // none_step_ms plus every block's recompute (op_ms(plan).recompute).
  double step_ms(const CompiledStep& plan) const;
  // What step_ms counts for each op of the block, summed over the plan's blocks (`remat bench
  // --profile` prints it beside the measured times).
  struct OpStepMs {
    std::vector<double> forward, recompute, backward;  // by op id of ModelSpec::block
  };
  OpStepMs op_ms(const CompiledStep& plan) const;
};

// Rates that turn FLOPs and bytes into time.
struct MachineRates {
  double matmul_gflops = 0;  // GEMM in the model's dtype
  double memory_gbps = 0;    // streaming read + write
  double link_gbps = 0;      // what one tensor-parallel rank sends per second (0: no tensor parallelism)
  double expert_gbps = 0;    // what one expert-parallel rank sends per second in an all-to-all (0: link_gbps)
  double ring_gbps = 0;      // what one context-parallel rank sends per second around its ring (0: link_gbps)

  // The rate op `op` of `b` sends at: its expert-parallel exchange's, or the tensor-parallel link's.
  double comm_gbps(const BlockSpec& b, int op) const;
};

// The bytes Adam moves per parameter it updates: it reads the gradient (`grad` bytes), the weight
// it updates (`weight`: the fp32 master copy under mixed precision) and both moments (`moments`
// bytes together), writes the weight and the moments back, and writes the model's copy of the
// weight (`cast` bytes; 0 where the updated weight is the one the model runs). fp32: 4, 4, 8, 0
// (28 bytes); Megatron's mixed precision with fp32 gradients: 4, 4, 8, 2 (30).
int64_t adam_bytes_per_param(int64_t grad, int64_t weight, int64_t moments, int64_t cast);

// One op's time as a roofline, max(matmul FLOPs / matmul rate, bytes moved / memory rate), plus
// op_comm_ms.
OpTime estimate_op(const BlockSpec& spec, int op, const MachineRates& rates);
// What an op's communication (BlockSpec::comm) adds to its roofline at comm_gbps: tensor- and
// expert-parallel collectives in full (not overlapped); a context-parallel ring's sends only where
// they outlast the attention they run beside (Transformer Engine's ring attention sends the next
// key/value chunk while it computes on the current one).
OpTime op_comm_ms(const BlockSpec& spec, int op, const MachineRates& rates);

// Every op as estimate_op, and Adam as a pass over the parameters. For configs too large to run
// here; a measured profile is better where the model fits.
CostModel estimate_costs(const ModelSpec& spec, const MachineRates& rates);

// Times a one-layer model of `cfg` (policy none, Adam step included), one step per call: what
// measure_costs does in one go, spread over a caller's own rounds. `remat bench` takes a step of
// it in every round of its rows, so that the predictions it prints beside each row come from the
// same minutes of the machine as the rows' times (on a shared VM the speed drifts by 20% and
// more between runs).
class LayerProbe {
 public:
  explicit LayerProbe(const ModelConfig& cfg);
  ~LayerProbe();
  LayerProbe(const LayerProbe&) = delete;
  LayerProbe& operator=(const LayerProbe&) = delete;

  // One step of the layer, and one Adam step over one block's parameters. The first is a warm-up.
  void step();
  // Timed steps so far (the warm-up not counted).
  int rounds() const;
  // Per-op medians over the timed steps, other_ms for cfg.layers. Throws remat::Error when no
  // timed step was taken.
  CostModel costs() const;
  // The rest of a one-layer step (stem, head, Adam, less the input gradient a stemless model's
  // first block does not compute), and Adam on one block: other_ms = first + (layers - 1) second.
  double other_one_layer_ms() const;
  double adam_block_ms() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Times a one-layer model of `cfg` (policy none, Adam step included): per-op forward and backward
// medians over `reps` steps after one warm-up, and the rest of a step scaled to cfg.layers. The
// result is cached as JSON in `cache_dir` (default $REMAT_CACHE, else $XDG_CACHE_HOME/remat, else
// ~/.cache/remat), keyed by the shapes, threads, BLAS and the executable's build; a cached profile
// is reused only by the same build.
CostModel measure_costs(const ModelConfig& cfg, const ThreadConfig& threads, int reps = 5,
                        const std::string& cache_dir = "");

// This machine's float32 GEMM rate (a 1024^3 product on the engine's GEMM for the linear dy W class,
// matmul_gflops) and streaming memory rate (a 64 MiB add).
MachineRates measure_rates();

// measure_rates() once per machine (CPU model, the engine's GEMM, OpenBLAS's kernel when that
// GEMM is OpenBLAS, threads), then as saved: the file rates-<hash>.json in the cache folder
// (measure_costs). One command gives one answer, whatever the load when it runs; delete the file,
// or set_remeasure (--remeasure), to calibrate again.
MachineRates calibrated_rates(const ThreadConfig& threads, const std::string& cache_dir = "");

enum class CostSource : uint8_t {
  Auto,       // measured when the engine runs the config here (check_engine) and one layer's estimated
              // step is under kLongestMeasuredLayerMs; estimated otherwise
  Measured,   // always measured; refused for configs the engine does not run here
  Estimated,  // from this machine's calibrated rates (calibrated_rates)
};
// Auto's limit on one layer's estimated step: measuring takes several steps of it (warm-ups
// included), and a plan should not wait minutes for its costs.
inline constexpr double kLongestMeasuredLayerMs = 5000;
// "auto", "measured", "estimated". Throws remat::Error listing them otherwise.
CostSource parse_cost_source(std::string_view text);

// The one place that picks how op costs are obtained. Throws remat::Error for Measured on a config
// the engine cannot run here.
CostModel choose_costs(const ModelConfig& cfg, CostSource source, const ThreadConfig& threads);

}  // namespace remat
