// FSDP2's unshard of one unit as PyTorch's caching allocator sees it (internal; docs/design.md,
// NOTE [FSDP2]): the memory model replays these requests.
#pragma once

#include <cstdint>
#include <vector>

namespace remat::detail {

struct UnshardRequest {
  int64_t bytes = 0;  // a block made on `stream`, or 0 when the step frees request `frees`
  int stream = 0;
  int frees = -1;  // the index of an earlier request this step frees
};

// The requests of a unit's unshard, in order, for its parameters' bytes in the compute dtype. Across
// `ranks` > 1: the flat all-gather buffer on `all_gather_stream` (request 0, left alive), then each
// parameter's unsharded tensor. On one rank nothing is gathered: each parameter is cast to the
// compute dtype (when `casts`: the shard's dtype differs) and copied into its tensor, each cast
// freed once the next is made (PyTorch 2.11, tools/gpu_memory.py --events). What is not freed is
// alive when the unit is unsharded.
std::vector<UnshardRequest> unshard_requests(const std::vector<int64_t>& params, int ranks, bool casts,
                                             int all_gather_stream);

}  // namespace remat::detail
