// What dispatch and combine share under expert parallelism (internal, planning): the exchange that
// carries the dispatched rows between the ranks of an expert-parallel group and its
// expert-tensor-parallel ranks, and its buffers, as Megatron-LM's two token dispatchers make them
// (Routing::allgather). See block.h, Routing.
#pragma once

#include <cstdint>

#include "remat/block.h"
#include "remat/ops.h"

namespace remat::ops::ep {

// Bytes one rank sends each way (forward, and again for the gradients) to move `bytes` of
// dispatched rows (the etp group's) between the ranks of the group: the all-to-all over routing.ep
// ranks of its own rows (bytes / etp), the (ep - 1) / ep of them that are not its own, then the
// all-gather over the etp ranks (or, on the way back, the reduce-scatter) of the whole; together
// (1 - 1 / (ep etp)) of the buffer. Nothing at ep 1 and etp 1. The allgather dispatcher moves
// every token instead: see gathered_comm.
inline OpComm all_to_all(const Routing& r, int64_t bytes) {
  const double group = static_cast<double>(r.ep * r.etp);
  const double sent = (1.0 - 1.0 / group) * static_cast<double>(bytes);
  return {sent, sent};
}

// The allgather dispatcher's ring over the etp x ep ranks, for `bytes` of this rank's tokens: each
// rank sends the other ranks' share of the gathered buffer, (ep etp - 1) x bytes.
inline OpComm gathered_comm(const Routing& r, int64_t bytes) {
  const double sent = static_cast<double>(r.ep * r.etp - 1) * static_cast<double>(bytes);
  return {sent, sent};
}

// This rank's token copies in expert order, as the alltoall dispatcher permutes them, for
// `tokens` bytes of tokens and a dispatch buffer of `rows` bytes: each token k times, or under a
// capacity every expert's rows padded to each rank's share of it (Megatron-LM's drop-and-pad
// permute: E x capacity / ep rows, the buffer's over the etp ranks that gather it).
inline int64_t copies_bytes(const Routing& r, int64_t tokens, int64_t rows) {
  return r.capacity > 0 ? rows / r.etp : tokens * r.top_k;
}

// The alltoall dispatcher's buffers for a dispatch buffer of `rows` bytes: this rank's token
// copies in expert order (`copies` bytes), what the all-to-all brings when the etp ranks then
// gather it (rows / etp, with both ep and etp above 1), and the rows before they are sorted by
// local expert (`rows`; a rank with one expert keeps them in the order they came: no sort, no
// copy). The way back has the same buffers in reverse.
inline int64_t alltoall_buffers(const Routing& r, int64_t copies, int64_t rows) {
  const bool sorted = r.experts / r.ep > 1;
  return copies + (sorted ? rows : 0) + (r.ep > 1 && r.etp > 1 ? rows / r.etp : 0);
}

// Dispatch's buffers around the exchange, forward: the alltoall dispatcher's (alltoall_buffers);
// the allgather dispatcher gathers the tokens into a buffer it keeps (a fixed allocation,
// plan/frameworks.cpp) and permutes them straight into the output: none.
inline int64_t exchange_buffers(const Routing& r, int64_t copies, int64_t rows) {
  if (!r.exchanges() || r.allgather) return 0;
  return alltoall_buffers(r, copies, rows);
}

// And backward, for `tokens` bytes of this rank's tokens: the allgather dispatcher's permutation
// backward makes the gradient of the gathered tokens (tokens x ep x etp) before its reduce-scatter
// returns this rank's share; the alltoall dispatcher's buffers as forward.
inline int64_t exchange_buffers_backward(const Routing& r, int64_t copies, int64_t rows, int64_t tokens) {
  if (r.exchanges() && r.allgather) return tokens * r.ep * r.etp;
  return exchange_buffers(r, copies, rows);
}

// The experts' outputs (input 0 of combine or unpermute, R x C) going back to their tokens' ranks.
// Input 1 has one element per token copy. With Routing::fp32_return the allgather dispatcher's
// reduce-scatter runs in fp32.
inline OpComm return_comm(const BlockSpec& b, const OpNode& n) {
  const Routing& r = n.routing;
  const TensorSpec& ys = b.tensors[n.in[0]];
  if (!r.allgather) return all_to_all(r, ys.bytes());
  const int64_t tokens = b.tensors[n.in[1]].numel() / r.top_k;
  return gathered_comm(r, tokens * ys.shape.back() * (r.fp32_return ? 4 : dtype_size(ys.dtype)));
}

// And its buffers. alltoall: alltoall_buffers on the way back; allgather: the outputs unpermuted
// into the gathered tokens' rows (this rank's tokens x ep x etp), then reduce-scattered. With
// Routing::fp32_return the reduce-scatter runs on an fp32 copy of its input, and returns fp32
// rows cast back (Megatron-LM casts to the probabilities' dtype before it: alltoall with etp above
// 1, allgather with any exchange).
inline int64_t return_buffers(const BlockSpec& b, const OpNode& n, const ThreadConfig&) {
  const Routing& r = n.routing;
  if (!r.exchanges()) return 0;
  const TensorSpec& ys = b.tensors[n.in[0]];
  const int64_t width = ys.shape.back(), tokens = b.tensors[n.in[1]].numel() / r.top_k;
  constexpr int64_t kFp32 = 4;
  if (r.allgather) {
    const int64_t gathered = tokens * r.ep * r.etp * width;
    return gathered * dtype_size(ys.dtype) + (r.fp32_return ? gathered * kFp32 + tokens * width * kFp32 : 0);
  }
  const int64_t copies = copies_bytes(r, tokens * width * dtype_size(ys.dtype), ys.bytes());
  return alltoall_buffers(r, copies, ys.bytes()) +
         (r.fp32_return && r.etp > 1 ? ys.numel() * kFp32 + ys.numel() / r.etp * kFp32 : 0);
}

}  // namespace remat::ops::ep
