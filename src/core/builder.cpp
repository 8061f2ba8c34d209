#include "core/builder.h"

#include <set>

#include "remat/error.h"

namespace remat::detail {

Builder::Builder(const ModelConfig& cfg, std::string kind) : cfg_(cfg) {
  spec_.kind = std::move(kind);
  spec_.dtype = cfg.dtype;
}

int Builder::input(std::string name, std::vector<int64_t> shape, DType dtype, std::string doc) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.doc = std::move(doc);
  spec_.tensors.push_back(std::move(t));
  spec_.inputs.push_back(static_cast<int>(spec_.tensors.size()) - 1);
  return spec_.inputs.back();
}

std::vector<int> Builder::op(OpKind kind, std::string name, std::vector<int> in, std::vector<Out> outs,
                             std::vector<ParamSpec> params) {
  const OpDef& def = op_def(kind);
  if (static_cast<int>(in.size()) != def.n_in || static_cast<int>(outs.size()) != def.n_out ||
      static_cast<int>(params.size()) > def.max_params)
    REMAT_INTERNAL("op '{}' ({}) takes {} inputs, {} outputs, at most {} parameters; got {}, {}, {}", name, def.name,
                   def.n_in, def.n_out, def.max_params, in.size(), outs.size(), params.size());
  OpNode node;
  node.kind = kind;
  node.name = std::move(name);
  node.in = std::move(in);
  const int id = static_cast<int>(spec_.ops.size());
  for (Out& o : outs) {
    TensorSpec t;
    t.name = std::move(o.name);
    t.shape = std::move(o.shape);
    t.dtype = o.dtype;
    t.producer = id;
    t.tags = o.tags;
    t.doc = std::move(o.doc);
    spec_.tensors.push_back(std::move(t));
    node.out.push_back(static_cast<int>(spec_.tensors.size()) - 1);
  }
  for (ParamSpec& p : params) {
    spec_.params.push_back(std::move(p));
    node.params.push_back(static_cast<int>(spec_.params.size()) - 1);
  }
  spec_.ops.push_back(std::move(node));
  return spec_.ops.back().out;
}

BlockSpec Builder::finish(int output) {
  // Policies and plans name tensors: a name must mean one tensor.
  std::set<std::string> names;
  for (const TensorSpec& t : spec_.tensors)
    if (!names.insert(t.name).second) REMAT_INTERNAL("block '{}' has two tensors named '{}'", spec_.kind, t.name);
  spec_.output = output;
  for (size_t i = 0; i < spec_.ops.size(); ++i)
    for (int t : spec_.bwd_reads(static_cast<int>(i))) spec_.tensors[t].read_by_backward = true;
  for (OpNode& op : spec_.ops) op.eager = cfg_.eager_ops && op_def(op.kind).eager_saved != nullptr;
  return std::move(spec_);
}

}  // namespace remat::detail
