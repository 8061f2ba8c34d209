// What dispatch and combine share under expert parallelism (internal, planning): the all-to-all
// that carries the dispatched rows between the ranks of an expert-parallel group, and its buffers.
// See block.h, Routing.
#pragma once

#include <cstdint>

#include "remat/block.h"
#include "remat/ops.h"

namespace remat::ops::ep {

// Bytes one rank sends in an all-to-all of `bytes` over routing.ep ranks, forward and again for the
// gradients: the (ep - 1) / ep of them that are not its own. Nothing at ep 1.
inline OpComm all_to_all(const Routing& r, int64_t bytes) {
  if (r.ep <= 1) return {};
  const double sent = static_cast<double>(r.ep - 1) / static_cast<double>(r.ep) * static_cast<double>(bytes);
  return {sent, sent};
}

// The exchange's buffers, alive around it: this rank's token copies in expert order (`copies`
// bytes) on one side, the rows of the buffer (`rows` bytes) on the other. Nothing at ep 1.
inline int64_t exchange_buffers(const Routing& r, int64_t copies, int64_t rows) {
  return r.ep <= 1 ? 0 : copies + rows;
}

// The experts' outputs (input 0 of combine or unpermute, R x C) going back to their tokens' ranks:
// the all-to-all's bytes, and its buffers around it (input 1's elements are the token copies).
inline OpComm return_comm(const BlockSpec& b, const OpNode& n) {
  return all_to_all(n.routing, b.tensors[n.in[0]].bytes());
}
inline int64_t return_buffers(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const TensorSpec& ys = b.tensors[n.in[0]];
  const int64_t copies = b.tensors[n.in[1]].numel() * ys.shape.back() * dtype_size(ys.dtype);
  return exchange_buffers(n.routing, copies, ys.bytes());
}

}  // namespace remat::ops::ep
