// Builds a BlockSpec op by op (internal). Each op() call adds one op node, its output tensors and
// its parameters; finish() marks what some backward reads, from the ops' definitions. Block kinds
// (src/blocks/) build with it, and so do the ops' test examples.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "remat/block.h"
#include "remat/config.h"

namespace remat::detail {

struct Out {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  uint32_t tags = 0;
  std::string doc;
};

class Builder {
 public:
  Builder(const ModelConfig& cfg, std::string kind);

  const ModelConfig& cfg() const { return cfg_; }
  const TensorSpec& tensor(int id) const { return spec_.tensors[id]; }
  // (B, T, c): the activation shape at width c (T the tokens this rank holds: seq / cp).
  std::vector<int64_t> btc(int64_t c) const { return {cfg_.batch, cfg_.local_seq(), c}; }
  // (B, T', c) of the residual stream, norms and dropouts: T' = T / tp under sequence parallelism.
  std::vector<int64_t> res(int64_t c) const { return {cfg_.batch, cfg_.rank_seq(), c}; }

  // A stage input (always kept).
  int input(std::string name, std::vector<int64_t> shape, DType dtype, std::string doc);
  // An op node; returns the ids of its outputs in order.
  std::vector<int> op(OpKind kind, std::string name, std::vector<int> in, std::vector<Out> outs,
                      std::vector<ParamSpec> params = {});
  // The node op() added last, for its attributes (p, eps, theta, attn).
  OpNode& last() { return spec_.ops.back(); }
  // Ends the stage with `output` as its output.
  BlockSpec finish(int output);

 private:
  const ModelConfig& cfg_;
  BlockSpec spec_;
};

}  // namespace remat::detail
