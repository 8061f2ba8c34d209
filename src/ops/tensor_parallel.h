// What the tensor-parallel ops share (internal): the bytes of ring collectives, and the whole
// tensor behind a sequence-parallel shard. See block.h, Split.
#pragma once

#include <cstdint>

#include "remat/block.h"

namespace remat::ops::tp {

// Bytes one of `ranks` sends in a ring all-reduce of `bytes`.
inline double all_reduce(int64_t bytes, int64_t ranks) {
  return 2.0 * static_cast<double>(ranks - 1) / static_cast<double>(ranks) * static_cast<double>(bytes);
}
// Bytes one of `ranks` sends in a ring all-gather (or reduce-scatter) whose whole is `bytes`.
inline double gather(int64_t bytes, int64_t ranks) {
  return static_cast<double>(ranks - 1) / static_cast<double>(ranks) * static_cast<double>(bytes);
}
// Bytes of tensor t gathered along the sequence from every rank's shard (sequence parallelism).
inline int64_t gathered(const BlockSpec& b, int t, const TensorParallel& p) { return b.tensors[t].bytes() * p.ranks; }

}  // namespace remat::ops::tp
