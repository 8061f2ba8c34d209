#include "remat/block.h"

#include <algorithm>
#include <iterator>

#include <fmt/format.h>

#include "remat/error.h"

namespace remat {

namespace {

// One row per OpKind, in enum order. Bits: which inputs / outputs the backward reads.
constexpr GradKind F = GradKind::Fresh, A = GradKind::Alias, S = GradKind::Slot, N = GradKind::None,
                   D = GradKind::OverDy, I = GradKind::OverInput;
constexpr OpInfo kOpInfo[] = {
    //  name           in out params  reads_in reads_out  gradients of the inputs
    {"linear",          1, 1, 2,      0b01,    0b000,     {F, N}},  // dx = dy W, dW = dy^T x
    {"layer_norm",      1, 3, 2,      0b01,    0b110,     {F, N}},  // reads x, mean, rstd
    {"gelu",            1, 1, 0,      0b01,    0b000,     {D, N}},  // reads x
    {"relu",            1, 1, 0,      0b00,    0b001,     {D, N}},  // reads y (y > 0 is the mask)
    {"dropout_mask",    0, 1, 0,      0b00,    0b000,     {N, N}},  // no inputs: a pure function of its seed
    {"dropout",         2, 1, 0,      0b10,    0b000,     {D, N}},  // reads mask
    {"scores",          1, 1, 0,      0b01,    0b000,     {S, N}},  // reads q, k (inside qkv)
    {"softmax",         1, 1, 0,      0b00,    0b001,     {D, N}},  // reads probs
    {"attn_values",     2, 1, 0,      0b11,    0b000,     {I, S}},  // reads probs, v (inside qkv)
    {"add",             2, 1, 0,      0b00,    0b000,     {A, A}},  // reads nothing
    {"embedding",       1, 1, 2,      0b01,    0b000,     {N, N}},  // reads tokens
    {"cross_entropy",   2, 2, 0,      0b10,    0b010,     {F, N}},  // reads targets, logp
    {"mse_loss",        2, 1, 0,      0b11,    0b000,     {F, N}},  // reads y, target
    {"flash_attention", 1, 2, 0,      0b01,    0b011,     {F, N}},  // reads qkv, atty, lse
};
static_assert(std::size(kOpInfo) == static_cast<size_t>(OpKind::Count),
              "kOpInfo needs one row per OpKind");

struct Out {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  std::string doc;
};

class Builder {
 public:
  Builder(const ModelConfig& cfg, std::string kind) : cfg_(cfg) {
    spec_.kind = std::move(kind);
    spec_.dtype = cfg.dtype;
  }

  int input(std::string name, std::string doc) {
    return input(std::move(name), btc(cfg_.dim), cfg_.dtype, std::move(doc));
  }

  int input(std::string name, std::vector<int64_t> shape, DType dtype, std::string doc) {
    spec_.tensors.push_back({std::move(name), std::move(shape), dtype, -1, false, std::move(doc)});
    spec_.inputs.push_back(static_cast<int>(spec_.tensors.size()) - 1);
    return spec_.inputs.back();
  }

  std::vector<int> op(OpKind kind, std::string name, std::vector<int> in, std::vector<Out> outs,
                      std::vector<ParamSpec> params = {}) {
    OpNode node;
    node.kind = kind;
    node.name = std::move(name);
    node.in = std::move(in);
    const int id = static_cast<int>(spec_.ops.size());
    for (Out& o : outs) {
      spec_.tensors.push_back({std::move(o.name), std::move(o.shape), o.dtype, id, false, std::move(o.doc)});
      node.out.push_back(static_cast<int>(spec_.tensors.size()) - 1);
    }
    for (ParamSpec& p : params) {
      spec_.params.push_back(std::move(p));
      node.params.push_back(static_cast<int>(spec_.params.size()) - 1);
    }
    spec_.ops.push_back(std::move(node));
    return spec_.ops.back().out;
  }

  int linear(const std::string& name, int x, int64_t out_features, std::string doc, bool bias = true) {
    const int64_t in_features = spec_.tensors[x].shape.back();
    std::vector<ParamSpec> params = {{name + ".weight", {out_features, in_features}}};
    if (bias) params.push_back({name + ".bias", {out_features}});
    return op(OpKind::Linear, name, {x}, {{name, btc(out_features), cfg_.dtype, std::move(doc)}},
              std::move(params))[0];
  }

  // A linear whose weight is another stage's parameter (the LM head tied to wte).
  int tied_linear(const std::string& name, int x, const std::string& weight, int64_t out_features,
                  std::string doc) {
    const int64_t in_features = spec_.tensors[x].shape.back();
    return op(OpKind::Linear, name, {x}, {{name, btc(out_features), cfg_.dtype, std::move(doc)}},
              {{weight, {out_features, in_features}}})[0];
  }

  int layer_norm(const std::string& name, int x, std::string doc) {
    const std::vector<int64_t> stat = {cfg_.batch, cfg_.seq, 1};
    return op(OpKind::LayerNorm, name, {x},
              {{name, btc(cfg_.dim), cfg_.dtype, std::move(doc)},
               {name + "_mean", stat, DType::F32, "LayerNorm mean per token"},
               {name + "_rstd", stat, DType::F32, "LayerNorm 1/std per token"}},
              {{name + ".weight", {cfg_.dim}}, {name + ".bias", {cfg_.dim}}})[0];
  }

  int unary(OpKind kind, const std::string& name, int x, std::string doc) {
    return op(kind, name, {x}, {{name, spec_.tensors[x].shape, cfg_.dtype, std::move(doc)}})[0];
  }

  // Returns x unchanged when dropout is off, else the dropped tensor "<name>_drop".
  int dropout(const std::string& name, int x, const std::string& what) {
    if (cfg_.dropout <= 0.0) return x;
    const std::vector<int64_t> shape = spec_.tensors[x].shape;
    const int mask = op(OpKind::DropoutMask, name + "_mask", {},
                        {{name + "_mask", shape, DType::Bool, "dropout keep-mask of " + what}})[0];
    spec_.ops.back().p = cfg_.dropout;
    const int y = op(OpKind::Dropout, name + "_drop", {x, mask},
                     {{name + "_drop", shape, cfg_.dtype, what + " after dropout"}})[0];
    spec_.ops.back().p = cfg_.dropout;
    return y;
  }

  int add(const std::string& name, int a, int b, std::string doc) {
    return op(OpKind::Add, name, {a, b}, {{name, btc(cfg_.dim), cfg_.dtype, std::move(doc)}})[0];
  }

  // Core attention: scores, softmax, optional dropout, probs x V. Returns atty (B, T, C).
  int attention(int qkv, bool causal) {
    if (cfg_.attention == AttentionImpl::Flash) {
      // One fused op: no T x T tensor is ever stored; the backward reruns the scores from q, k and
      // the per-row log-sum-exp. Attention dropout happens inside, replayed from a seed: no mask.
      AttentionLayout full = attention_layout(cfg_, causal);
      full.block = cfg_.seq;  // flops: the causal half of T x T, unpacked
      const int atty = op(OpKind::FlashAttention, "atty", {qkv},
                          {{"atty", btc(cfg_.dim), cfg_.dtype, "attention output, heads merged"},
                           {"lse", {cfg_.batch, cfg_.heads, cfg_.seq}, DType::F32, "softmax log-sum-exp per row"}})[0];
      spec_.ops.back().attn = full;
      spec_.ops.back().p = cfg_.dropout;
      return atty;
    }
    const AttentionLayout layout = attention_layout(cfg_, causal);
    const int scores = op(OpKind::Scores, "scores", {qkv},
                          {{"scores", layout.shape(), cfg_.dtype, "attention scores q k^T / sqrt(D)"}})[0];
    spec_.ops.back().attn = layout;
    int probs = unary(OpKind::Softmax, "probs", scores, "attention probabilities");
    spec_.ops.back().attn = layout;
    probs = dropout("probs", probs, "attention probabilities");
    const int atty = op(OpKind::AttnValues, "atty", {probs, qkv},
                        {{"atty", btc(cfg_.dim), cfg_.dtype, "attention output, heads merged"}})[0];
    spec_.ops.back().attn = layout;
    return atty;
  }

  BlockSpec finish(int output) {
    spec_.output = output;
    for (size_t i = 0; i < spec_.ops.size(); ++i)
      for (int t : spec_.bwd_reads(static_cast<int>(i))) spec_.tensors[t].read_by_backward = true;
    return std::move(spec_);
  }

 private:
  std::vector<int64_t> btc(int64_t c) const { return {cfg_.batch, cfg_.seq, c}; }

  const ModelConfig& cfg_;
  BlockSpec spec_;
};

// gpt2 stem: x = drop(wte[tokens] + wpe[0:T]).
BlockSpec gpt2_stem(const ModelConfig& cfg) {
  Builder b(cfg, "gpt2.stem");
  const int tokens = b.input("tokens", {cfg.batch, cfg.seq}, DType::I64, "token ids");
  const int x = b.op(OpKind::Embedding, "emb", {tokens},
                     {{"emb", {cfg.batch, cfg.seq, cfg.dim}, cfg.dtype, "token + position embedding"}},
                     {{"wte", {cfg.vocab, cfg.dim}}, {"wpe", {cfg.seq, cfg.dim}}})[0];
  return b.finish(b.dropout("emb", x, "embedding"));
}

// gpt2 head: loss = cross_entropy(lnf(x) wte^T, targets).
BlockSpec gpt2_head(const ModelConfig& cfg) {
  Builder b(cfg, "gpt2.head");
  const int x = b.input("x", "last block output");
  const int targets = b.input("targets", {cfg.batch, cfg.seq}, DType::I64, "next-token ids");
  const int lnf = b.layer_norm("lnf", x, "final LayerNorm output");
  const int logits = b.tied_linear("logits", lnf, "wte", cfg.vocab, "LM head output");
  const std::vector<int64_t> btv = {cfg.batch, cfg.seq, cfg.vocab};
  const int loss = b.op(OpKind::CrossEntropy, "loss", {logits, targets},
                        {{"loss", {}, DType::F32, "mean cross-entropy"},
                         {"logp", btv, cfg.dtype, "log-probabilities"}})[0];
  return b.finish(loss);
}

// seed head: loss = mse(y, target), as the seed note's training function.
BlockSpec seed_head(const ModelConfig& cfg) {
  Builder b(cfg, "seed.head");
  const int y = b.input("y", "last block output");
  const int target = b.input("target", "regression target");
  return b.finish(b.op(OpKind::MseLoss, "loss", {y, target}, {{"loss", {}, DType::F32, "mean squared error"}})[0]);
}

// The seed note's block: x + attn(x), then + ffn(.); ReLU FFN; no norm, no mask, no dropout.
BlockSpec seed_block(const ModelConfig& cfg) {
  Builder b(cfg, "seed");
  const int x = b.input("x", "block input (residual stream)");
  const int qkv = b.linear("qkv", x, 3 * cfg.dim, "q, k, v projections");
  const int atty = b.attention(qkv, /*causal=*/false);
  const int proj = b.linear("proj", atty, cfg.dim, "attention output projection");
  const int x2 = b.add("x2", x, proj, "residual stream after attention");
  const int fc = b.linear("fc", x2, cfg.hidden(), "FFN first linear");
  const int act = b.unary(OpKind::Relu, "act", fc, "FFN activation (ReLU)");
  const int mlp = b.linear("mlp", act, cfg.dim, "FFN second linear");
  return b.finish(b.add("y", x2, mlp, "block output"));
}

// GPT-2: x + drop(proj(attn(ln1(x)))), then + drop(mlp(gelu(fc(ln2(.))))). Causal.
BlockSpec gpt2_block(const ModelConfig& cfg) {
  Builder b(cfg, "gpt2");
  const int x = b.input("x", "block input (residual stream)");
  const int ln1 = b.layer_norm("ln1", x, "LayerNorm 1 output");
  const int qkv = b.linear("qkv", ln1, 3 * cfg.dim, "q, k, v projections");
  const int atty = b.attention(qkv, /*causal=*/true);
  int proj = b.linear("proj", atty, cfg.dim, "attention output projection");
  proj = b.dropout("proj", proj, "attention projection");
  const int x2 = b.add("x2", x, proj, "residual stream after attention");
  const int ln2 = b.layer_norm("ln2", x2, "LayerNorm 2 output");
  const int fc = b.linear("fc", ln2, cfg.hidden(), "MLP first linear (GELU input)");
  const int act = b.unary(OpKind::Gelu, "act", fc, "MLP activation (GELU output)");
  int mlp = b.linear("mlp", act, cfg.dim, "MLP second linear");
  mlp = b.dropout("mlp", mlp, "MLP output");
  return b.finish(b.add("y", x2, mlp, "block output"));
}

}  // namespace

const OpInfo& op_info(OpKind kind) { return kOpInfo[static_cast<size_t>(kind)]; }

int64_t AttentionLayout::offset(int64_t r) const {
  int64_t n = 0;
  for (int64_t q = 0; q < r; ++q) n += rows(q) * cols(q);
  return batch * heads * n;
}

std::vector<int64_t> AttentionLayout::shape() const {
  if (blocks() == 1) return {batch, heads, seq, seq};
  return {numel()};
}

AttentionLayout attention_layout(const ModelConfig& cfg, bool causal) {
  AttentionLayout l;
  l.batch = cfg.batch;
  l.heads = cfg.heads;
  l.seq = cfg.seq;
  l.causal = causal;
  l.block = causal ? std::min(cfg.attn_block, cfg.seq) : cfg.seq;
  return l;
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorSpec::bytes() const { return numel() * dtype_size(dtype); }

bool BlockSpec::is_input(int tensor) const {
  return std::find(inputs.begin(), inputs.end(), tensor) != inputs.end();
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
  const OpInfo& info = op_info(node.kind);
  std::vector<int> ids;
  for (size_t i = 0; i < node.in.size(); ++i)
    if (info.bwd_reads_in & (1u << i)) ids.push_back(node.in[i]);
  for (size_t i = 0; i < node.out.size(); ++i)
    if (info.bwd_reads_out & (1u << i)) ids.push_back(node.out[i]);
  return ids;
}

OpFlops BlockSpec::flops(int op) const {
  const OpNode& node = ops[op];
  switch (node.kind) {
    case OpKind::Linear: {
      const TensorSpec& x = tensors[node.in[0]];
      const int64_t k = x.shape.back();
      const int64_t m = x.numel() / k;
      const int64_t n = tensors[node.out[0]].shape.back();
      return {2 * m * n * k, 4 * m * n * k};  // backward: dx and dW
    }
    case OpKind::FlashAttention: {
      // Two matmuls forward (q k^T, p v) over the causal half; the backward reruns q k^T and does
      // four more: 2.5 times the forward.
      const AttentionLayout& l = node.attn;
      const int64_t head_dim = tensors[node.in[0]].shape.back() / 3 / l.heads;
      const int64_t scores = l.causal ? l.batch * l.heads * l.seq * (l.seq + 1) / 2 : l.batch * l.heads * l.seq * l.seq;
      const int64_t f = 2 * 2 * scores * head_dim;
      return {f, f * 5 / 2};
    }
    case OpKind::Scores:
    case OpKind::AttnValues: {
      // One multiply-add per stored score per head dimension: 2 B H T T D for a full layout,
      // about half for a causal one; backward two such matmuls.
      const int64_t head_dim = tensors[node.in.back()].shape.back() / 3 / node.attn.heads;
      const int64_t f = 2 * node.attn.numel() * head_dim;
      return {f, 2 * f};
    }
    default:
      return {};
  }
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

int64_t BlockSpec::forward_scratch(int op) const {
  const OpNode& node = ops[op];
  switch (node.kind) {
    case OpKind::MseLoss: return tensors[node.in[0]].numel() * 4;  // the unreduced loss
    case OpKind::CrossEntropy: return 4;                           // nll_loss's total_weight
    default: return 0;
  }
}

int64_t BlockSpec::backward_scratch(int op, int aten_threads) const {
  const OpNode& node = ops[op];
  switch (node.kind) {
    case OpKind::LayerNorm:  // partial dgamma and dbeta per thread
      return 2 * static_cast<int64_t>(aten_threads) * tensors[node.in[0]].shape.back() * dtype_size(dtype);
    case OpKind::CrossEntropy: {  // a (tokens, 1) column of -1 and the scaled scalar
      const TensorSpec& logp = tensors[node.out[1]];
      return logp.numel() / logp.shape.back() * 4 + 4;
    }
    case OpKind::Embedding: {  // the batch sum of dx for the position embedding
      const TensorSpec& x = tensors[node.out[0]];
      return x.numel() / x.shape[0] * dtype_size(x.dtype);
    }
    default: return 0;
  }
}

int64_t BlockSpec::param_bytes(int param) const {
  int64_t n = 1;
  for (int64_t d : params[param].shape) n *= d;
  return n * dtype_size(dtype);
}

int64_t BlockSpec::param_numel() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) {
    int64_t k = 1;
    for (int64_t d : p.shape) k *= d;
    n += k;
  }
  return n;
}

ModelSpec make_model(const ModelConfig& cfg) {
  ModelSpec m;
  m.layers = cfg.layers;
  m.block = make_block(cfg);
  if (cfg.arch == Arch::Gpt2) {
    m.has_stem = true;
    m.stem = gpt2_stem(cfg);
    m.head = gpt2_head(cfg);
  } else {
    m.head = seed_head(cfg);
  }
  return m;
}

int64_t ModelSpec::step_flops() const {
  const OpFlops b = block.flops(), h = head.flops();
  return layers * (b.forward + b.backward) + h.forward + h.backward;
}

BlockSpec make_block(const ModelConfig& cfg) {
  switch (cfg.arch) {
    case Arch::Seed: return seed_block(cfg);
    case Arch::Gpt2: return gpt2_block(cfg);
  }
  fail("unknown arch");
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

std::string bytes_str(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = b < 0 ? -b : b;
  if (a < 1024) return fmt::format("{} B", bytes);
  if (a < 1024.0 * 1024) return fmt::format("{:.1f} KiB", b / 1024);
  if (a < 1024.0 * 1024 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (a < 1024.0 * 1024 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  return fmt::format("{:.2f} TiB", b / (1024.0 * 1024 * 1024 * 1024));
}

}  // namespace remat
