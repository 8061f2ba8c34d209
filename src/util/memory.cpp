#include "remat/memory.h"

#include "remat/units.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

// Under AddressSanitizer the free-block cache is off (a block handed out again hides a
// use-after-free) and block headers are poisoned (a write before a tensor's data is reported).
#if defined(__SANITIZE_ADDRESS__)
#define REMAT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define REMAT_ASAN 1
#endif
#endif
#ifdef REMAT_ASAN
#include <sanitizer/asan_interface.h>
#define REMAT_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define REMAT_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define REMAT_POISON(p, n) ((void)(p), (void)(n))
#define REMAT_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

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
#ifdef REMAT_ASAN
constexpr int64_t kDefaultCacheLimit = 0;
#else
constexpr int64_t kDefaultCacheLimit = int64_t{8} << 30;
#endif

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_limit{0};

struct Cache {
  std::mutex mu;
  std::unordered_map<size_t, std::vector<void*>> free;  // block size -> free blocks
  int64_t bytes = 0;
  int64_t limit = kDefaultCacheLimit;
};
Cache& cache() {
  static Cache* c = new Cache();  // never destroyed: storages may be freed during exit
  return *c;
}

void raise_peak(int64_t live) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (live > peak && !g_peak.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {}
}

void release(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  size_t n;
  REMAT_UNPOISON(block, kHeader);
  std::memcpy(&n, block, sizeof n);
  g_live.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.bytes + static_cast<int64_t>(n) <= c.limit) {
      REMAT_POISON(block, kHeader);
      c.free[n].push_back(block);
      c.bytes += static_cast<int64_t>(n);
      return;
    }
  }
  std::free(block);
}

void* acquire(size_t n) {
  const int64_t limit = g_limit.load(std::memory_order_relaxed);
  if (limit > 0 && g_live.load(std::memory_order_relaxed) + static_cast<int64_t>(n) > limit)
    throw OutOfMemory(static_cast<int64_t>(n), g_live.load(std::memory_order_relaxed), limit);
  Cache& c = cache();
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free.find(n);
    if (it != c.free.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      REMAT_UNPOISON(block, kHeader);
      c.bytes -= static_cast<int64_t>(n);
    }
  }
  if (block == nullptr) {
    if (n > (size_t{1} << 62) || posix_memalign(&block, kAlign, n + kHeader) != 0)
      throw OutOfMemory(static_cast<int64_t>(std::min<size_t>(n, size_t{1} << 62)),
                        g_live.load(std::memory_order_relaxed), 0);
    std::memcpy(block, &n, sizeof n);
  }
  REMAT_POISON(block, kHeader);
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

OutOfMemory::OutOfMemory(int64_t requested, int64_t live, int64_t limit)
    : Error("out of memory: " + describe(requested, live, limit), Kind::Runtime),
      requested_(requested),
      live_(live),
      limit_(limit) {}

std::string OutOfMemory::describe(int64_t requested, int64_t live, int64_t limit) {
  return fmt::format("{} more were asked for with {} live ({})", bytes_str(requested), bytes_str(live),
                     limit > 0 ? "the limit is " + bytes_str(limit) : std::string("the system refused"));
}

void MemoryTracker::set_limit(int64_t bytes) {
  if (bytes < 0) fail("MemoryTracker::set_limit: bytes must be >= 0 (0: no limit), got {}", bytes);
  g_limit.store(bytes, std::memory_order_relaxed);
}

int64_t MemoryTracker::limit() { return g_limit.load(std::memory_order_relaxed); }

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
    return getDeviceStats(c10::cuda::current_device())
        .allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)]
        .current;
  }
#else
  if (device == MemoryDevice::CUDA) fail("MemoryTracker::live(CUDA): this build has no CUDA; ask for the CPU");
#endif
  return g_live.load(std::memory_order_relaxed);
}

int64_t MemoryTracker::peak(MemoryDevice device) {
#ifdef REMAT_CUDA
  if (device == MemoryDevice::CUDA) {
    using namespace c10::cuda::CUDACachingAllocator;
    return getDeviceStats(c10::cuda::current_device()).allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  }
#else
  if (device == MemoryDevice::CUDA) fail("MemoryTracker::peak(CUDA): this build has no CUDA; ask for the CPU");
#endif
  return g_peak.load(std::memory_order_relaxed);
}

void MemoryTracker::reset_peak(MemoryDevice device) {
#ifdef REMAT_CUDA
  if (device == MemoryDevice::CUDA) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    return;
  }
#else
  if (device == MemoryDevice::CUDA) fail("MemoryTracker::reset_peak(CUDA): this build has no CUDA; ask for the CPU");
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
    for (void* b : blocks) REMAT_UNPOISON(b, kHeader), std::free(b);
  c.free.clear();
  c.bytes = 0;
}

void MemoryTracker::set_cache_limit(int64_t bytes) {
  if (bytes < 0) fail("MemoryTracker::set_cache_limit: bytes must be >= 0 (0: no cache), got {}", bytes);
  {
    std::lock_guard<std::mutex> lock(cache().mu);
#ifdef REMAT_ASAN
    bytes = 0;  // see REMAT_ASAN above
#endif
    cache().limit = bytes;
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
