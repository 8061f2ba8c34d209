#include "ops/reduce.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include "util/parallel.h"

namespace remat::ops {

at::Tensor column_sums(const at::Tensor& x) {
  // The kernel threads hold none of the caller's autograd or inference-mode state: a tensor that
  // takes part in either, like an integer one (summed as int64), is summed by ATen on this thread.
  if (!x.device().is_cpu() || x.dim() != 2 || !x.is_contiguous() || at::get_num_threads() != 1 ||
      !at::isFloatingType(x.scalar_type()) || x.requires_grad() || c10::InferenceMode::is_enabled())
    return x.sum(0);
  constexpr int64_t kChunk = 256;
  const int64_t cols = x.size(1);
  at::Tensor out = at::empty({cols}, x.options());
  detail::parallel_chunks((cols + kChunk - 1) / kChunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t first = c * kChunk, width = std::min(kChunk, cols - first);
      at::Tensor part = out.narrow(0, first, width);
      at::sum_out(part, x.narrow(1, first, width), {0});
    }
  });
  return out;
}

}  // namespace remat::ops
