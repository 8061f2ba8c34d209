// The tensor table's methods. Sizes come from the table alone; what an op reads, its FLOPs and its
// scratch come from its definition (ops.h).
#include "remat/block.h"

#include <set>

#include "remat/error.h"

namespace remat {

int64_t AttentionLayout::offset(int64_t r) const {
  // Only the last block can be short: before it, block q has `block` rows of `seq` columns, or
  // (causal) of (q + 1) blocks of columns. Closed form, as flash attention asks per row.
  const int64_t whole = std::min(r, seq / block);
  int64_t n = causal ? block * block * (whole * (whole + 1) / 2) : whole * block * seq;
  for (int64_t q = whole; q < r; ++q) n += rows(q) * cols(q);
  return batch * heads * n;
}

std::vector<int64_t> AttentionLayout::shape() const {
  if (blocks() == 1) return {batch, heads, seq, seq};
  return {numel()};
}

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool BlockSpec::is_input(int tensor) const { return input_index(tensor) >= 0; }

int BlockSpec::input_index(int tensor) const {
  for (size_t k = 0; k < inputs.size(); ++k)
    if (inputs[k] == tensor) return static_cast<int>(k);
  return -1;
}

int BlockSpec::find(std::string_view name) const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == name) return static_cast<int>(i);
  return -1;
}

std::vector<int> BlockSpec::choosable() const {
  std::vector<int> ids;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].read_by_backward && !is_input(static_cast<int>(i))) ids.push_back(static_cast<int>(i));
  return ids;
}

std::string BlockSpec::choosable_names() const {
  std::string s;
  for (int t : choosable()) s += (s.empty() ? "" : ", ") + tensors[t].name;
  return s;
}

std::vector<int> BlockSpec::bwd_reads(int op) const {
  const OpNode& node = ops[op];
  const OpDef& def = op_def(node.kind);
  std::vector<int> ids;
  const unsigned reads_in = def.reads_in(node);
  for (size_t i = 0; i < node.in.size(); ++i)
    if ((reads_in & (1u << i)) && std::find(ids.begin(), ids.end(), node.in[i]) == ids.end()) ids.push_back(node.in[i]);
  for (size_t i = 0; i < node.out.size(); ++i)
    if (def.bwd_reads_out & (1u << i)) ids.push_back(node.out[i]);
  return ids;
}

OpFlops BlockSpec::flops(int op) const {
  const OpDef& def = op_def(ops[op].kind);
  return def.flops ? def.flops(*this, ops[op]) : OpFlops{};
}

OpFlops BlockSpec::flops() const {
  OpFlops total;
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpFlops f = flops(static_cast<int>(i));
    total.forward += f.forward;
    total.backward += f.backward;
  }
  return total;
}

int64_t BlockSpec::forward_scratch(int op, const ThreadConfig& ctx) const {
  const OpDef& def = op_def(ops[op].kind);
  return def.forward_scratch ? def.forward_scratch(*this, ops[op], ctx) : 0;
}

int64_t BlockSpec::backward_scratch(int op, const ThreadConfig& ctx) const {
  const OpDef& def = op_def(ops[op].kind);
  return def.backward_scratch ? def.backward_scratch(*this, ops[op], ctx) : 0;
}

int64_t BlockSpec::eager_saved(int op) const {
  const OpDef& def = op_def(ops[op].kind);
  return ops[op].eager && def.eager_saved ? def.eager_saved(*this, ops[op]) : 0;
}

OpComm BlockSpec::comm(int op) const {
  const OpDef& def = op_def(ops[op].kind);
  // Tensor-parallel ops, the expert-parallel exchanges of dispatch and combine, and the
  // context-parallel ring of attention.
  const OpNode& n = ops[op];
  return def.comm && (n.tp.active() || n.routing.exchanges() || n.attn.ring > 1) ? def.comm(*this, n) : OpComm{};
}

int64_t BlockSpec::param_bytes(int param) const { return params[param].numel() * dtype_size(dtype); }

int64_t BlockSpec::param_numel() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) n += p.numel();
  return n;
}

int64_t ModelSpec::step_flops() const {
  const OpFlops b = block.flops(), h = head.flops();
  int64_t f = layers * (b.forward + b.backward) + h.forward + h.backward;
  if (has_stem) {
    f += stem.flops().forward + stem.flops().backward;
  } else if (layers > 0) {
    // The first block reads the data, which needs no gradient: its ops on the block input skip it.
    for (size_t op = 0; op < block.ops.size(); ++op)
      if (!block.ops[op].in.empty() && block.is_input(block.ops[op].in[0]))
        f -= block.flops(static_cast<int>(op)).input_grad;
  }
  return f;
}

int64_t ModelSpec::param_numel() const {
  int64_t n = layers * block.param_numel();
  for (const BlockSpec* s : {&stem, &head}) {
    if (s == &stem && !has_stem) continue;
    for (const ParamSpec& p : s->params)
      if (p.tied_to.empty()) n += p.numel();
  }
  return n;
}

}  // namespace remat
