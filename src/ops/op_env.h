// How op adapters see one stage run (internal to the executor).
//
// Each op kind has an adapter pair (OpImpl) in its own file under src/ops/, next to its ATen pair.
// Adapters reach tensors only through OpEnv, which checks every access against the op's row in
// OpInfo: a backward that reads a tensor its OpInfo does not list fails loudly instead of quietly
// keeping something alive that the memory accounting does not know about.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/block.h"
#include "remat/executor.h"

namespace remat::detail {

class OpEnv {
 public:
  OpEnv(const BlockSpec& spec, BlockContext& ctx, at::TensorList params, int64_t layer, bool verify);

  // --- forward (and recompute) ---
  const at::Tensor& in(const OpNode& op, int i) const;
  bool has_out(const OpNode& op, int i) const;
  const at::Tensor& out(const OpNode& op, int i) const;
  // Stores output i after checking its shape against the table. During a recompute an output that
  // is still held keeps its forward value (in verify mode the new one must equal it bitwise).
  void set_out(const OpNode& op, int i, at::Tensor t);
  // Shape of output i from the table, and the device the stage runs on (ops with no inputs).
  std::vector<int64_t> out_shape(const OpNode& op, int i) const { return spec_.tensors[op.out[i]].shape; }
  at::Device device() const;
  bool has_param(const OpNode& op, int i) const { return i < static_cast<int>(op.params.size()); }
  const at::Tensor& param(const OpNode& op, int i) const;
  // The op's random seed: drawn from the default generator in the forward, replayed in a recompute.
  uint64_t seed(const OpNode& op);
  void set_recomputing(bool on) { recomputing_ = on; }
  bool recomputing() const { return recomputing_; }

  // --- backward ---
  const at::Tensor& saved_in(const OpNode& op, int i) const;   // only inputs OpInfo lists
  const at::Tensor& saved_out(const OpNode& op, int i) const;  // only outputs OpInfo lists
  const at::Tensor& grad_out(const OpNode& op, int i) const;   // may be undefined
  bool needs_grad(const OpNode& op, int i) const;              // does input i need a gradient?
  // Adds g to input i's gradient. owned=false: g is shared (a pass-through), never add into it.
  void add_grad(const OpNode& op, int i, at::Tensor g, bool owned = true);
  // The gradient of input i, for ops that fill parts of it themselves (attention on qkv).
  at::Tensor& grad_slot(const OpNode& op, int i);
  // GradKind::OverDy: dy itself, handed over to become input 0's gradient, when this op holds its
  // only reference; otherwise undefined (write a fresh tensor). Only for ops whose OpInfo says so.
  at::Tensor take_grad_out(const OpNode& op);
  // GradKind::OverInput: input i itself, handed over (its Free step then drops nothing) when this
  // backward is its last reader; otherwise undefined. Read it before overwriting it.
  at::Tensor take_in(const OpNode& op, int i);
  void add_param_grad(const OpNode& op, int i, at::Tensor g);

  // Executor state.
  std::vector<at::Tensor> grads;        // by tensor id
  std::vector<bool> grad_owned;         // by tensor id
  std::vector<at::Tensor> param_grads;  // by parameter id
  std::vector<bool> need_input_grad;    // by position in spec.inputs
  uint8_t last_read = 0;                // the running backward step's Step::last_read

 private:
  const BlockSpec& spec_;
  BlockContext& ctx_;
  at::TensorList params_;
  int64_t layer_;
  bool verify_;
  bool recomputing_ = false;
};

struct OpImpl {
  void (*forward)(OpEnv&, const OpNode&);
  void (*backward)(OpEnv&, const OpNode&);
};

// The adapter pair of each kind (src/ops/op_table.cpp).
const OpImpl& op_impl(OpKind kind);

}  // namespace remat::detail
