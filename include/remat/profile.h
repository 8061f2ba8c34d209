// Measured costs for the planner: every op of one block timed on this machine.
#pragma once

#include <string>

#include "remat/config.h"
#include "remat/planner.h"
#include "remat/runtime.h"

namespace remat {

// Times a one-layer model of `cfg` (policy none, Adam step included): per-op forward and backward
// medians over `reps` steps after one warm-up, and the rest of a step scaled to cfg.layers. The
// result is cached as JSON in `cache_dir` (default $REMAT_CACHE, else $XDG_CACHE_HOME/remat, else
// ~/.cache/remat), keyed by the shapes, threads, BLAS and the executable's build; a cached profile
// is reused only by the same build.
CostModel measure_costs(const ModelConfig& cfg, const ThreadConfig& threads, int reps = 5,
                        const std::string& cache_dir = "");

// This machine's float32 GEMM rate (1024^3 at::mm) and streaming memory rate (a 64 MiB add).
MachineRates measure_rates();

}  // namespace remat
