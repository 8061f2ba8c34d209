// What dispatch and combine share under expert parallelism (internal, planning): the exchange that
// carries the dispatched rows between the ranks of an expert-parallel group and its
// expert-tensor-parallel ranks, and its buffers, as Megatron-LM's two token dispatchers make them
// (Routing::allgather). See block.h, Routing.
#pragma once

#include <cstdint>

#include "remat/block.h"
#include "remat/ops.h"

namespace remat::ops::ep {

// Bytes one rank sends for a dispatch buffer of `bytes` (the etp group's rows), forward and again
// for the gradients: the all-to-all over routing.ep ranks of its own rows (bytes / etp), the
// (ep - 1) / ep of them that are not its own, then the all-gather over the etp ranks (or, on the
// way back, the reduce-scatter) of the whole; together (1 - 1 / (ep etp)) of the buffer. Nothing
// at ep 1 and etp 1.
inline OpComm all_to_all(const Routing& r, int64_t bytes) {
  const double group = static_cast<double>(r.ep * r.etp);
  const double sent = (1.0 - 1.0 / group) * static_cast<double>(bytes);
  return {sent, sent};
}

// Dispatch's buffers around the exchange: with the alltoall dispatcher this rank's token copies in
// expert order (`copies` bytes), what the all-to-all brings (this rank's rows, rows / etp bytes,
// with both ep and etp above 1) and the all-gather's output before the sort by expert (`rows`
// bytes, the buffer's size). The allgather dispatcher gathers the tokens into a buffer it keeps
// (a fixed allocation, plan/frameworks.cpp) and permutes them straight into the output: none.
inline int64_t exchange_buffers(const Routing& r, int64_t copies, int64_t rows) {
  if (!r.exchanges() || r.allgather) return 0;
  return copies + rows + (r.ep > 1 && r.etp > 1 ? rows / r.etp : 0);
}

// The experts' outputs (input 0 of combine or unpermute, R x C) going back to their tokens' ranks:
// the exchange's bytes.
inline OpComm return_comm(const BlockSpec& b, const OpNode& n) {
  return all_to_all(n.routing, b.tensors[n.in[0]].bytes());
}

// And its buffers. alltoall: the outputs unsorted (R x C), reduce-scattered over etp (R / etp
// rows, with both ep and etp above 1), all-to-all'd back to this rank's token copies; allgather:
// the outputs unpermuted into the gathered tokens' rows (this rank's tokens x ep x etp), then
// reduce-scattered. With Routing::fp32_return the collective runs on an fp32 copy of its input
// (Megatron-LM casts to the probabilities' dtype before it: alltoall with etp above 1, allgather
// with any exchange). Input 1 has one element per token copy.
inline int64_t return_buffers(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const Routing& r = n.routing;
  if (!r.exchanges()) return 0;
  const TensorSpec& ys = b.tensors[n.in[0]];
  const int64_t width = ys.shape.back(), tokens = b.tensors[n.in[1]].numel() / r.top_k;
  constexpr int64_t kFp32 = 4;
  if (r.allgather) {
    const int64_t gathered = tokens * r.ep * r.etp * width;
    return gathered * dtype_size(ys.dtype) + (r.fp32_return ? gathered * kFp32 : 0);
  }
  const int64_t copies = tokens * r.top_k * width * dtype_size(ys.dtype);
  return copies + ys.bytes() + (r.ep > 1 && r.etp > 1 ? ys.bytes() / r.etp : 0) +
         (r.fp32_return && r.etp > 1 ? ys.numel() * kFp32 : 0);
}

}  // namespace remat::ops::ep
