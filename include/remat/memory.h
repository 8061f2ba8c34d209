// Memory accounting: live and peak bytes of all tensor storage.
//
//   remat::MemoryTracker::install();             // once, first thing in main
//   remat::MemoryScope scope;                    // peak of a region
//   auto y = model.forward(x);
//   fmt::print("{} B kept, {} B peak\n", scope.delta(), scope.peak());
//
// CPU: exact to the byte. install() makes remat's allocator LibTorch's CPU allocator; every tensor
// storage allocated afterwards (at::empty, op outputs, oneDNN buffers) counts at its requested size.
// It cannot see memory that BLAS libraries (OpenBLAS, oneDNN) malloc for their own scratch, tensors
// made with from_blob, or storages allocated before install().
// The allocator keeps freed blocks in a cache keyed by exact size (up to a limit) and hands them
// out again: a training step that allocates the same shapes every step touches no fresh pages.
// Cached bytes are "reserved", not "live".
//
// CUDA (a CUDA build): live and peak are the caching allocator's allocated_bytes statistics.
#pragma once

#include <cstdint>
#include <string>

#include "remat/error.h"

namespace remat {

// An allocation the tracking allocator could not make: over MemoryTracker::set_limit(), or refused
// by the system. A runtime remat::Error; bench and train turn it into a report of the policy, the
// bytes the step needed and a plan that fits.
class OutOfMemory : public Error {
 public:
  OutOfMemory(int64_t requested, int64_t live, int64_t limit);
  int64_t requested() const { return requested_; }  // bytes of the failed allocation
  int64_t live() const { return live_; }            // bytes live when it failed
  int64_t limit() const { return limit_; }          // set_limit(), or 0 when the system refused
  // "8.0 MiB more were asked for with 143.7 MiB live (the limit is 150.0 MiB)": what() without
  // its "out of memory: ", for reports that say where it ran out.
  std::string detail() const { return describe(requested_, live_, limit_); }

 private:
  static std::string describe(int64_t requested, int64_t live, int64_t limit);
  int64_t requested_, live_, limit_;
};

enum class MemoryDevice : uint8_t { CPU, CUDA };

class MemoryTracker {
 public:
  // Installs the tracking allocator as LibTorch's CPU allocator. Idempotent. Tensors allocated
  // before the first call are invisible to it.
  static void install();
  // Whether install() has run in this process.
  static bool installed();

  // Bytes of live tensor storage now.
  static int64_t live(MemoryDevice device = MemoryDevice::CPU);
  // Highest live() since install() or the last reset_peak().
  static int64_t peak(MemoryDevice device = MemoryDevice::CPU);
  // Sets peak() to live().
  static void reset_peak(MemoryDevice device = MemoryDevice::CPU);

  // CPU: live bytes plus bytes held in the free-block cache.
  static int64_t reserved();
  // CPU: returns every cached free block to the system.
  static void release_cache();
  // CPU: most bytes the free-block cache may hold; beyond it freed blocks go back to the system.
  // Default 8 GiB; 0 disables the cache. Always 0 under AddressSanitizer (make sanitize), where a
  // reused block would hide a use-after-free. Throws remat::Error for a negative size.
  static void set_cache_limit(int64_t bytes);
  // CPU: the most bytes of tensor storage that may be live; an allocation beyond it throws
  // OutOfMemory, as a device's memory would (rehearse a GPU's limit on CPU). 0 (the default): no
  // limit but the system's. Throws remat::Error for a negative size.
  static void set_limit(int64_t bytes);
  // The limit set, or 0 for none.
  static int64_t limit();
  // CPU: number of storages allocated since install() (cache hits included).
  static int64_t allocations();
};

// Measures one region of code. Construction resets the peak; on the CPU the enclosing scope's
// peak is restored on destruction, so scopes nest. (A CUDA scope resets the caching allocator's
// peak statistics, which cannot be set back: CUDA scopes do not nest.)
class MemoryScope {
 public:
  explicit MemoryScope(MemoryDevice device = MemoryDevice::CPU);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

  int64_t start() const { return start_; }  // live bytes at construction
  int64_t delta() const;                    // live now minus start
  int64_t peak() const;                     // highest live since construction minus start

 private:
  MemoryDevice device_;
  int64_t start_;
  int64_t outer_peak_;
};

}  // namespace remat
