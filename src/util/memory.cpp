#include "remat/memory.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#ifdef REMAT_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace remat {

namespace {

// Each block: a 64-byte header holding the requested size, then the data (64-byte aligned, as
// c10's own allocator). The DataPtr's context is the data pointer itself, so raw_deleter works.
constexpr size_t kHeader = 64;
constexpr size_t kAlign = 64;

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};

struct Cache {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free;  // block size -> free blocks
  int64_t bytes = 0;
  int64_t limit = int64_t{8} << 30;
};
Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: storages may be freed during exit
  return *c;
}

void raise_peak(int64_t live) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
}

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  size_t n;
  std::memcpy(&n, block, sizeof n);
  g_live.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.bytes + static_cast<int64_t>(n) <= c.limit) {
      c.free[n].push_back(block);
      c.bytes += static_cast<int64_t>(n);
      return;
    }
  }
  std::free(block);
}

void* acquire(size_t n) {
  Cache& c = cache();
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free.find(n);
    if (it != c.free.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      c.bytes -= static_cast<int64_t>(n);
    }
  }
  if (block == nullptr) {
    if (posix_memalign(&block, kAlign, n + kHeader) != 0) throw std::bad_alloc();
    std::memcpy(block, &n, sizeof n);
  }
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  raise_peak(g_live.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n));
  return static_cast<char*>(block) + kHeader;
}

// LibTorch 1.13 declares `allocate` const; 2.3+ declares it non-const and adds a pure `copy_data`.
// Declaring every variant without `override` fits both.
struct TrackingAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) const {
    void* data = acquire(n);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DataPtr allocate(size_t n) { return static_cast<const TrackingAllocator*>(this)->allocate(n); }
  c10::DeleterFnPtr raw_deleter() const { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
};

std::once_flag g_install;
std::atomic<bool> g_installed{false};

}  // namespace

void MemoryTracker::install() {
  std::call_once(g_install, [] {
    static TrackingAllocator* alloc = new TrackingAllocator();  // never deleted (storages point at it)
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_installed = true;
  });
}

bool MemoryTracker::installed() { return g_installed; }

int64_t MemoryTracker::live(MemoryDevice device) {
#ifdef REMAT_CUDA
  if (device == MemoryDevice::CUDA) {
    using namespace c10::cuda::CUDACachingAllocator;
    return getDeviceStats(c10::cuda::current_device()).allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].current;
  }
#endif
  return g_live.load(std::memory_order_relaxed);
}

int64_t MemoryTracker::peak(MemoryDevice device) {
#ifdef REMAT_CUDA
  if (device == MemoryDevice::CUDA) {
    using namespace c10::cuda::CUDACachingAllocator;
    return getDeviceStats(c10::cuda::current_device()).allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  }
#endif
  return g_peak.load(std::memory_order_relaxed);
}

void MemoryTracker::reset_peak(MemoryDevice device) {
#ifdef REMAT_CUDA
  if (device == MemoryDevice::CUDA) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    return;
  }
#endif
  g_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

int64_t MemoryTracker::reserved() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return g_live.load(std::memory_order_relaxed) + c.bytes;
}

void MemoryTracker::release_cache() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [size, blocks] : c.free)
    for (void* b : blocks) std::free(b);
  c.free.clear();
  c.bytes = 0;
}

void MemoryTracker::set_cache_limit(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    cache().limit = bytes < 0 ? 0 : bytes;
  }
  if (reserved() - live() > bytes) release_cache();
}

int64_t MemoryTracker::allocations() { return g_allocations.load(std::memory_order_relaxed); }

MemoryScope::MemoryScope(MemoryDevice device)
    : device_(device), start_(MemoryTracker::live(device)), outer_peak_(MemoryTracker::peak(device)) {
  MemoryTracker::reset_peak(device);
}

MemoryScope::~MemoryScope() {
  if (device_ == MemoryDevice::CPU) raise_peak(outer_peak_);
}

int64_t MemoryScope::delta() const { return MemoryTracker::live(device_) - start_; }

int64_t MemoryScope::peak() const { return MemoryTracker::peak(device_) - start_; }

}  // namespace remat
