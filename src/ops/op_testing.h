// What each op file gives the op tests (internal): a tiny example stage and the op's math written
// in differentiable ATen ops. OpsTest runs every registered op through the executor against its
// reference, forward and backward, in float64 and float32, so a new op is tested by being defined.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"

namespace remat::detail {

struct OpTestCase {
  // A stage of this one op whose inputs are the op's inputs, at small sizes (the tests fill it with
  // float64 or float32 data).
  BlockSpec (*example)() = nullptr;
  // The op's outputs from its inputs and parameters, with autograd-differentiable ATen ops. `in`
  // holds the example's stage inputs, which it creates first: op input i is in[node.in[i]]. Outputs
  // that are not float (masks) may be returned as the op computes them.
  std::vector<at::Tensor> (*reference)(const OpNode& node, const std::vector<at::Tensor>& in,
                                       const std::vector<at::Tensor>& params) = nullptr;
  int64_t index_range = 0;  // int64 inputs are drawn from [index_low, index_range)
  bool float64 = true;      // the op runs float64 too (the tests then hold it to 1e-12)
  // A second example, when the op takes its inputs in two forms (q and k in separate tensors or
  // in one fused projection; rope on all of its input or on a slice). May be null.
  BlockSpec (*example2)() = nullptr;
  int64_t index_low = 0;  // -1: a dropped copy or an empty row among the int64 inputs (their first element is it)
};

}  // namespace remat::detail
