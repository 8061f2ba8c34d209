// The op registry: what each kind of op reads, writes, keeps for its backward and costs.
//
// Every op is one file under src/ops/ holding its definition (an OpDef: name, inputs and outputs,
// which of them its backward reads, how it produces each input's gradient, its matmul FLOPs and
// scratch bytes) and its forward/backward pair. The executor runs ops only through these
// definitions; the memory model and the planner read only them. The list of kinds is op_list.h.
//
//   const remat::OpDef& d = remat::op_def(remat::OpKind::Gelu);
//   d.bwd_reads_in & 1       // the GELU backward reads its input x
//   d.grad_in[0]             // GradKind::OverDy: dx may be written over dy
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace remat {

enum class OpKind : uint8_t {
#define REMAT_OP(kind, name) kind,
#include "remat/op_list.h"
#undef REMAT_OP
  Count,
};

// How an op's backward can produce the gradient of one input. The schedule compiler decides, per
// step, which of these a run uses (schedule.h, GradSource); the executor carries it out and the
// memory model replays it.
enum class GradKind : uint8_t {
  None,   // no gradient: masks, token ids, targets
  Fresh,  // a new tensor the size of the input
  Alias,  // the output's gradient itself, passed through (residual add): no new memory
  Slot,   // added in place into the input's gradient; the first writer allocates it zeroed
  // Written over the output's gradient dy when dy is this op's alone (its slot was made for it and
  // nothing shares it); otherwise Fresh. Pointwise ops: gelu, relu, dropout, softmax, rope.
  OverDy,
  // Written over the input itself when this backward is the input's last reader; otherwise Fresh.
  // attn_values over probs.
  OverInput,
};

// Matmul FLOPs of one op call (2 per multiply-add); other work counts 0.
struct OpFlops {
  int64_t forward = 0;
  int64_t backward = 0;
  // Of backward, the gradient of the op's first input (a linear's dx), which a step skips when that
  // input needs none: the first block of a model without a stem reads the data. 0 for ops whose
  // first input is never a block's input.
  int64_t input_grad = 0;
};

// Bytes one tensor-parallel rank sends per op call, forward and backward, as ring collectives do: an
// all-reduce of n bytes over t ranks sends 2 (t - 1) / t n, an all-gather or a reduce-scatter whose
// whole is n sends (t - 1) / t n.
struct OpComm {
  double forward = 0;
  double backward = 0;
};

struct BlockSpec;
struct OpNode;
struct ThreadConfig;
namespace detail {
class OpEnv;        // the executor's view of one stage run (src/ops/op_env.h)
struct OpTestCase;  // a reference and a tiny example for the op tests (src/ops/op_testing.h)
}  // namespace detail

constexpr int kMaxOpInputs = 3;

struct OpDef {
  const char* name = "";
  int n_in = 0, n_out = 0;
  int max_params = 0;         // parameters it takes at most (a bias-free linear takes one)
  unsigned bwd_reads_in = 0;  // bit i set: the backward reads input i
  // Where what the backward reads depends on the node: its bits, in place of bwd_reads_in (unpermute
  // planned as PyTorch's deterministic index_add keeps its input). Null: bwd_reads_in.
  unsigned (*bwd_reads_in_of)(const OpNode& node) = nullptr;
  // The inputs a node's backward reads (bit i: input i), by bwd_reads_in_of or bwd_reads_in.
  unsigned reads_in(const OpNode& node) const { return bwd_reads_in_of ? bwd_reads_in_of(node) : bwd_reads_in; }
  unsigned bwd_reads_out = 0;           // bit i set: the backward reads output i
  GradKind grad_in[kMaxOpInputs] = {};  // GradKind::None each
  // The kind of a node whose kind depends on the node (rope on a column slice of its input adds into
  // that input's gradient slot; on the whole input it writes over dy); null: grad_in.
  GradKind (*grad_kind)(const OpNode& node, int input) = nullptr;
  // Matmul FLOPs of a node; null: none.
  OpFlops (*flops)(const BlockSpec& spec, const OpNode& node) = nullptr;
  // Bytes allocated and freed inside one forward (beyond the outputs) or one backward (beyond the
  // input and parameter gradients); null: none. Checked against the tracker by the memory tests.
  int64_t (*forward_scratch)(const BlockSpec& spec, const OpNode& node, const ThreadConfig& ctx) = nullptr;
  int64_t (*backward_scratch)(const BlockSpec& spec, const OpNode& node, const ThreadConfig& ctx) = nullptr;
  // Planning, PyTorch's caching allocator: the separate tensors the forward's (backward's) scratch
  // is, in the order they are made; a negative entry frees the earliest one of its size still
  // alive, the rest are freed as the op ends. In a backward they are made before the op's gradients
  // (which otherwise come first) and freed after them. The largest running sum is the scratch.
  // Null: one tensor.
  std::vector<int64_t> (*scratch_tensors)(const BlockSpec& spec, const OpNode& node, bool backward) = nullptr;
  // Planning (OpNode::eager): the bytes eager PyTorch's autograd keeps for this op's backward beyond
  // what the op saves here, when the op runs unfused (an RMSNorm's fp32 copy of its input, GQA's
  // repeated keys and values, SiLU's output), alive as long as the op's first output (or its input
  // eager_input, when the extras are copies of it); null: none.
  int64_t (*eager_saved)(const BlockSpec& spec, const OpNode& node) = nullptr;
  int eager_input = -1;
  // The tensors eager_saved's bytes are, of equal size (GQA's repeated keys and values: 2): what
  // PyTorch's caching allocator sees as separate blocks.
  int eager_tensors = 1;
  // Tensor-parallel communication of a node (OpNode::tp); null: none.
  OpComm (*comm)(const BlockSpec& spec, const OpNode& node) = nullptr;
  void (*forward)(detail::OpEnv& env, const OpNode& node) = nullptr;
  void (*backward)(detail::OpEnv& env, const OpNode& node) = nullptr;
  // For the op tests: a one-op example stage and the op's math in differentiable ATen ops.
  const detail::OpTestCase* test = nullptr;
};

// How `node` produces input `input`'s gradient: def.grad_kind's answer, or def.grad_in.
inline GradKind grad_kind(const OpDef& def, const OpNode& node, int input) {
  return def.grad_kind != nullptr ? def.grad_kind(node, input) : def.grad_in[input];
}

// The definition of `kind`. REQUIRES: kind < OpKind::Count.
const OpDef& op_def(OpKind kind);
// The name the registry gives `kind` ("layer_norm").
std::string_view op_name(OpKind kind);

}  // namespace remat
