// PyTorch's CUDA caching allocator as a model (internal): which blocks and segments a sequence of
// allocations and frees gets, so that a plan predicts the two numbers frameworks report: the peak
// allocated bytes (blocks handed out, tails included) and the peak reserved bytes (segments).
//
// The rules, from c10/cuda/CUDACachingAllocator.cpp (docs/planner.md has the reading):
//   1. A request is rounded up to 512 bytes. Up to 1 MiB it goes to the small pool, else the large.
//   2. A free block of the pool on the same stream that fits is taken, the smallest first (best fit).
//   3. Else a segment is reserved: 2 MiB for a small request, 20 MiB for one under 10 MiB, the request
//      rounded up to 2 MiB otherwise; its block is taken.
//   4. A taken block is split when the rest is at least 512 bytes (small pool) or more than 1 MiB
//      (large pool); unsplit, the whole block counts as allocated.
//   5. A freed block merges with the free blocks beside it in its segment; segments are never
//      returned (no empty_cache, no out-of-memory retry in a plan).
// With expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), each (stream, pool)
// has one segment that maps pages of 2 MiB (small) or 20 MiB (large) as its end grows, and every
// block is split to the request.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace remat::detail {

class CachingAllocatorModel {
 public:
  explicit CachingAllocatorModel(bool expandable_segments = false) : expandable_(expandable_segments) {}

  // A request of `bytes` on `stream`; returns its handle.
  int alloc(int64_t bytes, int stream = 0);
  // Frees a handle alloc() returned.
  void free(int handle);

  int64_t allocated() const { return allocated_; }
  int64_t reserved() const { return reserved_; }
  int64_t peak_allocated() const { return peak_allocated_; }
  int64_t peak_reserved() const { return peak_reserved_; }
  void reset_peaks() { peak_allocated_ = allocated_, peak_reserved_ = reserved_; }

  // The rounded size of a request (rule 1).
  static int64_t round(int64_t bytes);

 private:
  struct Block {
    int64_t addr = 0, size = 0;
    int segment = -1;
    bool free = true;
    int prev = -1, next = -1;  // neighbours in the segment, by address
  };
  struct Pool {
    int stream = 0;
    bool small = false;
    std::set<std::pair<int64_t, int>> free_blocks;  // (size, block id), best fit first
    int tail = -1;                                  // expandable: the last block of the pool's one segment
    int64_t mapped = 0;                             // expandable: bytes mapped so far
  };

  Pool& pool(int stream, bool small);
  int take(Pool& p, int block, int64_t size);
  int new_segment(Pool& p, int64_t size);
  void note();

  bool expandable_ = false;
  std::vector<Block> blocks_;
  std::vector<int> handle_block_;  // by handle
  std::map<std::pair<int, bool>, Pool> pools_;
  std::vector<Pool*> segment_pool_;  // by segment: the pool it belongs to
  int64_t next_addr_ = 0;
  int64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
};

}  // namespace remat::detail
