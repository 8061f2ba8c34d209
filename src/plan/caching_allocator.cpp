#include "plan/caching_allocator.h"

#include <algorithm>

namespace remat::detail {

namespace {

constexpr int64_t kMinBlock = 512;            // kMinBlockSize
constexpr int64_t kSmallSize = 1 << 20;       // kSmallSize: the largest small request
constexpr int64_t kSmallBuffer = 2 << 20;     // kSmallBuffer: a small pool's segment (and page)
constexpr int64_t kLargeBuffer = 20 << 20;    // kLargeBuffer: the segment of a request under 10 MiB
constexpr int64_t kMinLargeAlloc = 10 << 20;  // kMinLargeAlloc
constexpr int64_t kRoundLarge = 2 << 20;      // kRoundLarge

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace

int64_t CachingAllocatorModel::round(int64_t bytes) {
  return bytes < kMinBlock ? kMinBlock : round_up(bytes, kMinBlock);
}

CachingAllocatorModel::Pool& CachingAllocatorModel::pool(int stream, bool small) {
  Pool& p = pools_[{stream, small}];
  p.stream = stream, p.small = small;
  return p;
}

void CachingAllocatorModel::note() {
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_reserved_ = std::max(peak_reserved_, reserved_);
}

int CachingAllocatorModel::new_segment(Pool& p, int64_t size) {
  if (expandable_) {
    // One segment per pool that grows at its end: map pages to cover the request (a free block at
    // the end counts towards it).
    const int64_t page = p.small ? kSmallBuffer : kLargeBuffer;
    const bool tail_free = p.tail >= 0 && blocks_[p.tail].free;
    const int64_t have = tail_free ? blocks_[p.tail].size : 0;
    const int64_t grow = round_up(size - have, page);
    reserved_ += grow;
    p.mapped += grow;
    if (tail_free) {
      Block& t = blocks_[p.tail];
      p.free_blocks.erase({t.size, p.tail});
      t.size += grow;
      return p.tail;
    }
    Block b;
    b.size = grow;
    b.segment = p.tail >= 0 ? blocks_[p.tail].segment : static_cast<int>(segment_pool_.size());
    if (p.tail < 0) segment_pool_.push_back(&p);
    b.addr = p.tail >= 0 ? blocks_[p.tail].addr + blocks_[p.tail].size : next_addr_;
    if (p.tail < 0) next_addr_ += int64_t{1} << 40;  // the segment's address space
    b.prev = p.tail;
    blocks_.push_back(b);
    const int id = static_cast<int>(blocks_.size()) - 1;
    if (p.tail >= 0) blocks_[p.tail].next = id;
    p.tail = id;
    return id;
  }
  const int64_t bytes = size <= kSmallSize      ? kSmallBuffer
                        : size < kMinLargeAlloc ? kLargeBuffer
                                                : round_up(size, kRoundLarge);
  reserved_ += bytes;
  Block b;
  b.addr = next_addr_;
  next_addr_ += bytes;
  b.size = bytes;
  b.segment = static_cast<int>(segment_pool_.size());
  segment_pool_.push_back(&p);
  blocks_.push_back(b);
  return static_cast<int>(blocks_.size()) - 1;
}

int CachingAllocatorModel::take(Pool& p, int id, int64_t size) {
  const int64_t rest = blocks_[id].size - size;
  const bool split = p.small || expandable_ ? rest >= kMinBlock : rest > kSmallSize;
  if (split) {
    Block r;
    r.addr = blocks_[id].addr + size;
    r.size = rest;
    r.segment = blocks_[id].segment;
    r.prev = id;
    r.next = blocks_[id].next;
    blocks_.push_back(r);
    const int rid = static_cast<int>(blocks_.size()) - 1;
    if (blocks_[rid].next >= 0) blocks_[blocks_[rid].next].prev = rid;
    blocks_[id].next = rid;
    blocks_[id].size = size;
    if (p.tail == id) p.tail = rid;
    p.free_blocks.insert({rest, rid});
  }
  blocks_[id].free = false;
  allocated_ += blocks_[id].size;
  return id;
}

int CachingAllocatorModel::alloc(int64_t bytes, int stream) {
  if (bytes <= 0) {
    handle_block_.push_back(-1);  // PyTorch hands out no block for an empty tensor
    return static_cast<int>(handle_block_.size()) - 1;
  }
  const int64_t size = round(bytes);
  Pool& p = pool(stream, size <= kSmallSize);
  auto it = p.free_blocks.lower_bound({size, -1});
  int id;
  if (it != p.free_blocks.end()) {
    id = it->second;
    p.free_blocks.erase(it);
  } else {
    id = new_segment(p, size);
  }
  take(p, id, size);
  note();
  handle_block_.push_back(id);
  return static_cast<int>(handle_block_.size()) - 1;
}

void CachingAllocatorModel::free(int handle) {
  int id = handle_block_[handle];
  handle_block_[handle] = -1;
  if (id < 0) return;
  Pool& p = *segment_pool_[blocks_[id].segment];
  allocated_ -= blocks_[id].size;
  blocks_[id].free = true;
  auto merge = [&](int left, int right) {  // right into left; both free, left in the set or about to be
    Block &l = blocks_[left], &r = blocks_[right];
    p.free_blocks.erase({r.size, right});
    l.size += r.size;
    l.next = r.next;
    if (r.next >= 0) blocks_[r.next].prev = left;
    if (p.tail == right) p.tail = left;
    r.size = 0;
  };
  const int prev = blocks_[id].prev;
  if (prev >= 0 && blocks_[prev].free) {
    p.free_blocks.erase({blocks_[prev].size, prev});
    merge(prev, id);
    id = prev;
  }
  const int next = blocks_[id].next;
  if (next >= 0 && blocks_[next].free) merge(id, next);
  p.free_blocks.insert({blocks_[id].size, id});
}

}  // namespace remat::detail
