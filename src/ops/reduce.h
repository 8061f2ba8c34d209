// Reductions the ops share, spread over remat's kernel threads with the bits of ATen's own (internal).
#pragma once

#include <ATen/core/Tensor.h>

namespace remat::ops {

// x.sum(0) of a 2-D tensor (a linear's bias gradient), with its bits: for a contiguous floating
// CPU tensor outside autograd and inference mode, with one ATen thread, the columns in fixed chunks
// of 256 over the kernel threads (ATen sums each column down the rows in one order whatever
// columns it is given); otherwise x.sum(0) itself.
at::Tensor column_sums(const at::Tensor& x);

}  // namespace remat::ops
