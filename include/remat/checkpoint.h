// remat::checkpoint: reentrant activation checkpointing for any LibTorch callable.
//
//   // y = block(x), keeping only x for the backward; block's weights still get gradients.
//   at::Tensor y = remat::checkpoint([&](const at::Tensor& in) { return block->forward(in); },
//                                    x, block->parameters());
//
// Forward runs fn without grad and keeps only its inputs (and the RNG state). Backward reruns fn
// with grad from the saved inputs and returns gradients to the inputs and to `params`. On CPU the
// gradients are bitwise equal to those of the plain run fn(inputs), dropout included.
//
// Unlike PyTorch's reentrant torch.utils.checkpoint, the parameters are inputs of the autograd
// node, so a first block fed data that does not require grad still gets parameter gradients
// (PyTorch silently leaves them None). See docs/design.md, NOTE [Reentrant checkpoint].
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace remat {

struct CheckpointOptions {
  // Save the CPU generator state (and the current CUDA device's when an input or a parameter is on
  // CUDA) before the forward and restore it around the recompute, so random ops (dropout) draw the
  // same values. The outer RNG stream is left where the plain run would leave it. Costs ~5 KiB per
  // call on CPU.
  bool preserve_rng_state = true;
};

// A checkpointed function: the outputs of its inputs (and of the parameters it reads).
using CheckpointFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) under checkpointing. `params`: every tensor fn reads that needs a gradient but
// is not in `inputs` (module parameters); one listed twice counts once. REQUIRES: fn is
// deterministic given the RNG state; fn does not return its inputs unchanged. Throws remat::Error
// when fn changes an input or a parameter in place (its recompute would start from the changed
// values), and on double backward (create_graph).
std::vector<at::Tensor> checkpoint(const CheckpointFn& fn, at::TensorList inputs, at::TensorList params,
                                   const CheckpointOptions& options = {});

// One input, one output.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                      at::TensorList params, const CheckpointOptions& options = {});

// One element of a sequential stack: a function of one tensor and the parameters it reads.
struct Layer {
  std::function<at::Tensor(const at::Tensor&)> fn;  // the layer's forward; never empty
  std::vector<at::Tensor> params;                   // every tensor fn reads that needs a gradient
};

// Like torch.utils.checkpoint.checkpoint_sequential: splits `layers` into `segments` runs of
// layers.size() / segments layers (the last run takes the remainder); every run but the last is
// checkpointed at its input, the last runs plainly (its activations are needed at once).
// Throws remat::Error unless 1 <= segments <= layers.size().
at::Tensor checkpoint_sequential(const std::vector<Layer>& layers, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options = {});

}  // namespace remat
