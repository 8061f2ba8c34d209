// ZeRO's split of parameter elements over ranks: the one rule the trainer, the gradient buckets and
// the memory model share.
#pragma once

#include <cstdint>

namespace remat {

// The first of `total` elements (laid end to end in model order) that rank `rank` of `world` owns:
// rank r owns [shard_first(total, r, world), shard_first(total, r + 1, world)); the last is the
// largest (the split rounds down).
inline int64_t shard_first(int64_t total, int rank, int world) { return total * rank / world; }

}  // namespace remat
