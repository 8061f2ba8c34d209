// Test helper for code that runs on the kernel pool (util/parallel.h): sets the pool's thread count
// for one scope and restores it after.
#pragma once

#include "util/parallel.h"

namespace remat::detail {

class KernelThreads {
 public:
  explicit KernelThreads(int n) : saved_(kernel_threads()) { set_kernel_threads(n); }
  ~KernelThreads() { set_kernel_threads(saved_); }
  KernelThreads(const KernelThreads&) = delete;
  KernelThreads& operator=(const KernelThreads&) = delete;

 private:
  int saved_;
};

}  // namespace remat::detail
