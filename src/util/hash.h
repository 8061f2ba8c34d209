// FNV-1a, 64 bits (internal): the train state's checksum, the weights' digest and the corpus's id.
// Not cryptographic: it tells a changed file or tensor from an unchanged one, not a forged one.
#pragma once

#include <cstddef>
#include <cstdint>

namespace remat::detail {

// FNV-1a's 64-bit offset basis and prime (Fowler, Noll and Vo).
inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ULL, kFnv1aPrime = 0x100000001b3ULL;

// FNV-1a 64 of `n` bytes at `data`, continuing from `h` (the offset basis to start a hash).
inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnv1aOffset) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnv1aPrime;
  return h;
}

}  // namespace remat::detail
