// What dispatch and combine share under expert parallelism (internal, planning): the all-to-all
// that carries the dispatched rows between the ranks of an expert-parallel group, the all-gather
// over the expert-tensor-parallel ranks after it, and their buffers.
// See block.h, Routing.
#pragma once

#include <cstdint>

#include "remat/block.h"
#include "remat/ops.h"

namespace remat::ops::ep {

// Bytes one rank sends for a dispatch buffer of `bytes` (the etp group's rows), forward and again
// for the gradients: the all-to-all over routing.ep ranks of its own rows (bytes / etp), the
// (ep - 1) / ep of them that are not its own, then the all-gather over the etp ranks (or, on the
// way back, the reduce-scatter) of the whole. Nothing at ep 1 and etp 1.
inline OpComm all_to_all(const Routing& r, int64_t bytes) {
  const double own = static_cast<double>(bytes) / static_cast<double>(r.etp);
  const double sent = static_cast<double>(r.ep - 1) / static_cast<double>(r.ep) * own +
                      static_cast<double>(r.etp - 1) / static_cast<double>(r.etp) * static_cast<double>(bytes);
  return {sent, sent};
}

// The exchange's buffers, alive around it: this rank's token copies in expert order (`copies`
// bytes) on one side, the rows of the buffer (`rows` bytes, the etp group's) on the other, and
// between them, with both ep and etp above 1, this rank's rows of it (the all-to-all's output and
// the all-gather's input; the reduce-scatter's output on the way back). Nothing at ep 1 and etp 1.
inline int64_t exchange_buffers(const Routing& r, int64_t copies, int64_t rows) {
  if (!r.exchanges()) return 0;
  return copies + rows + (r.ep > 1 && r.etp > 1 ? rows / r.etp : 0);
}

// The experts' outputs (input 0 of combine or unpermute, R x C) going back to their tokens' ranks:
// the all-to-all's bytes, and its buffers around it (input 1's elements are the token copies);
// with Routing::fp32_return, also the outputs' fp32 copy the way back starts from.
inline OpComm return_comm(const BlockSpec& b, const OpNode& n) {
  return all_to_all(n.routing, b.tensors[n.in[0]].bytes());
}
inline int64_t return_buffers(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const TensorSpec& ys = b.tensors[n.in[0]];
  const int64_t copies = b.tensors[n.in[1]].numel() * ys.shape.back() * dtype_size(ys.dtype);
  const int64_t fp32 = n.routing.fp32_return ? ys.numel() * dtype_size(DType::F32) : 0;
  return exchange_buffers(n.routing, copies, ys.bytes()) + fp32;
}

}  // namespace remat::ops::ep
