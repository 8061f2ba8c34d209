// moe: a mixture-of-experts decoder (Mixtral, Qwen3-MoE): LLaMA's attention (any decoder choice:
// blocks/decoder.h), then instead of one MLP a router sends each token to top_k of E SwiGLU experts
// (ModelConfig.experts, .top_k, .ffn each) and weights their outputs back together; an optional shared expert
// (.shared_ffn) every token passes too (DeepSeek, Qwen2-MoE). Routing is dropless, or capped at a capacity per expert
// (.capacity_factor: first come, first served, as Switch and Megatron-LM's "position" drop policy). Every size is known
// before the step, whatever the routing: the dispatch buffer has ModelConfig::dispatch_rows() rows (dropless: the
// rank's tokens x top_k, times the expert imbalance under expert parallelism; capped: the rank's experts x
// expert_capacity() x etp).
//   stem   x = drop(wte[tokens])
//   block  x2 = x + drop(proj(attn(rope(q(n1)), rope(k(n1)), v(n1)))), n1 = rms1(x), n2 = rms2(x2)
//          (weights, experts, router_probs) = route(router(n2))
//          (xs, slots, rows) = dispatch(n2, experts)
//          moe = combine(down(silu(gate(xs)) * up(xs)), weights, slots) [+ the shared expert's MLP of n2]
//          or, with ModelConfig.expert_weights activation (Megatron-LM's placement), the same sum as
//          moe = unpermute(down(weigh(silu(gate(xs)) * up(xs), weights, slots)), slots)
//          y = x2 + drop(moe)
//   head   cross_entropy(logits(rmsf(x)), targets)
// Tags: router (its logits, probabilities, weights), experts (every routed tensor), expert-act (the
// experts' SwiGLU product and its weighted copy, which mlp-act also means here), shared (the shared expert's), so the
// presets moe-act, moe and shared drop what Megatron-LM's recompute modules of those names do.
#include <algorithm>
#include <cmath>

#include "blocks/decoder.h"
#include "blocks/kinds.h"
#include "blocks/parts.h"
#include "remat/error.h"

namespace remat::blocks {
namespace {

const DecoderStyle kMoeStyle{/*rms_norm=*/true,  Positions::Rope, /*swiglu=*/true,    /*bias=*/false,
                             /*qkv_bias=*/false, /*tied=*/false,  /*fused_qkv=*/false};

DecoderStyle style(const ModelConfig& c) { return resolve_style(c, kMoeStyle); }
void choices(ModelConfig& c) { set_choices(c, kMoeStyle); }

// One expert linear over the dispatch buffer: `out` features from each row's expert.
int expert_linear(Builder& b, const std::string& name, int xs, int rows, int64_t out, uint32_t tags,
                  const std::string& doc, Init init = Init::Normal) {
  const ModelConfig& c = b.cfg();
  const int64_t in = b.tensor(xs).shape.back();
  ParamSpec w{name + ".weight", {c.rank_experts(), out, in}, init};
  w.expert = true;
  return b.op(OpKind::ExpertLinear, name, {xs, rows}, {{name, {c.dispatch_rows(), out}, c.dtype, tags, doc}}, {w})[0];
}

// The shared expert: an MLP of n2 with the experts' activation (SwiGLU, or GELU), split over the
// tensor-parallel ranks as the dense MLP is (Megatron-LM's SharedExpertMLP).
int shared_expert(Builder& b, const DecoderStyle& s, int n2) {
  const ModelConfig& c = b.cfg();
  constexpr uint32_t kTags = tag::kShared | tag::kMlpInner;
  const int act = decoder_mlp_activation(b, s, n2, "shared_", "shared expert", c.shared_ffn, kTags, 0);
  return linear(b, "shared_down", act, c.dim, kTags, "shared expert down projection", s.bias, Init::ResidualNormal,
                Split::Row);
}

// How the block's tokens are routed: Sinkhorn's weights are a sigmoid for one expert per token, a
// softmax for more, as they are, and one sigmoid weight is not divided by itself (Megatron-LM's
// router.py and topk_softmax_with_capacity).
Routing routing_of(const ModelConfig& c) {
  const bool sinkhorn = c.router == Router::Sinkhorn;
  const bool sigmoid = c.router == Router::Sigmoid || (sinkhorn && c.top_k == 1);
  const bool normalize = c.norm_topk && !sinkhorn && !(sigmoid && c.top_k == 1);
  Routing r{c.experts, c.top_k, c.expert_capacity(), sigmoid, normalize, c.aux_loss, c.ep, sinkhorn, c.deterministic};
  r.etp = c.etp;
  r.fp32_return = c.router_fp32 && c.dtype != DType::F32;
  r.allgather = c.allgather_dispatch;
  return r;
}

// The router's outputs and the dispatched rows, by tensor id.
struct Dispatched {
  int weights, xs, slots, row_expert;
};

// The router's logits (with ModelConfig::router_fp32, one GEMM with an fp32 output: Megatron-LM's
// router_gating_linear), each token's experts and weights, and the tokens dispatched to them.
Dispatched route(Builder& b, const Routing& routing, int n2) {
  const ModelConfig& c = b.cfg();
  const std::vector<int64_t> per_token = {c.batch, c.rank_seq(), c.top_k};
  const DType weights = c.router_fp32 ? DType::F32 : c.dtype;
  const int logits =
      b.op(OpKind::Linear, "router", {n2}, {{"router", b.res(c.experts), weights, tag::kRouter, "router logits"}},
           {{"router.weight", {c.experts, c.dim}, Init::Normal}})[0];
  const std::vector<int> routed =
      b.op(OpKind::Route, "route", {logits},
           {{"weights", per_token, weights, tag::kRouter, "routing weight of each token's experts"},
            {"experts", per_token, DType::I64, tag::kRouter, "each token's experts, highest score first"},
            {"router_probs", b.res(c.experts), DType::F32, tag::kRouter,
             routing.sigmoid ? "router scores (sigmoid)" : "router probabilities (softmax)"}});
  b.last().routing = routing;
  const std::vector<int> placed =
      b.op(OpKind::Dispatch, "xs", {n2, routed[1]},
           {{"xs", {c.dispatch_rows(), c.dim}, c.dtype, tag::kExperts, "tokens dispatched to their experts, by expert"},
            {"slots", per_token, DType::I64, tag::kExperts, "dispatch row of each token's copies"},
            {"rows", {c.dispatch_rows()}, DType::I64, tag::kExperts, "expert of each dispatch row"}});
  b.last().routing = routing;
  return {routed[0], placed[0], placed[1], placed[2]};
}

// The experts' MLPs on the dispatched rows: SwiGLU, or GELU (fc, gelu, down) under ModelConfig.mlp
// gelu (Megatron-LM's default); under ExpertWeights::Activation the routing weights multiply the
// activation, before the down projection (Megatron-LM). Returns the down projections' output.
int expert_mlps(Builder& b, const DecoderStyle& s, const Dispatched& d) {
  const ModelConfig& c = b.cfg();
  const int64_t rows = c.dispatch_rows(), f = c.rank_expert_hidden();
  constexpr uint32_t kInner = tag::kExperts | tag::kMlpInner;
  constexpr uint32_t kAct = kInner | tag::kExpertAct | tag::kMlpAct;
  int act = -1;
  if (s.swiglu) {
    const int gate = expert_linear(b, "gate", d.xs, d.row_expert, f, kInner, "experts' gate projections");
    const int up = expert_linear(b, "up", d.xs, d.row_expert, f, kInner, "experts' up projections");
    act = b.op(OpKind::Swiglu, "act", {gate, up},
               {{"act", {rows, f}, c.dtype, kAct, "experts' SwiGLU output silu(gate) * up"}})[0];
  } else {
    const int fc = expert_linear(b, "fc", d.xs, d.row_expert, f, kInner, "experts' first linears (GELU input)");
    act = unary(b, OpKind::Gelu, "act", fc, kAct, "experts' GELU output");
  }
  if (c.expert_weights == ExpertWeights::Activation)
    act = b.op(OpKind::Weigh, "weighed", {act, d.weights, d.slots},
               {{"weighed", {rows, f}, c.dtype, kAct, "experts' activation times each row's routing weight"}})[0];
  return expert_linear(b, "down", act, d.row_expert, c.dim, kInner, "experts' down projections", Init::ResidualNormal);
}

// Router, dispatch, the experts and the combine into token order; plus the shared expert.
int experts(Builder& b, const DecoderStyle& s, int n2) {
  const ModelConfig& c = b.cfg();
  const Routing routing = routing_of(c);
  const Dispatched d = route(b, routing, n2);
  const int down = expert_mlps(b, s, d);
  constexpr uint32_t kInner = tag::kExperts | tag::kMlpInner;
  int out = -1;
  if (c.expert_weights == ExpertWeights::Activation)
    out = b.op(OpKind::Unpermute, "combine", {down, d.slots},
               {{"combine", b.res(c.dim), c.dtype, kInner, "experts' outputs summed into token order"}})[0];
  else
    out = b.op(OpKind::Combine, "combine", {down, d.weights, d.slots},
               {{"combine", b.res(c.dim), c.dtype, kInner, "experts' outputs weighted into token order"}})[0];
  b.last().routing = routing;
  if (c.shared_ffn > 0) out = add(b, "moe", out, shared_expert(b, s, n2), "routed plus shared experts");
  return out;
}

BlockSpec stem(const ModelConfig& c) { return decoder_stem(c, style(c), "moe"); }

BlockSpec block(const ModelConfig& c) {
  const DecoderStyle s = style(c);
  Builder b(c, "moe");
  const int x = b.input("x", b.res(c.dim), c.dtype, "block input (residual stream)");
  const int x2 = decoder_attention(b, s, x);
  const int out =
      dropout(b, "mlp", experts(b, s, decoder_norm2(b, s, x, x2)), tag::kMlpInner, "mixture-of-experts output");
  return b.finish(add(b, "y", x2, out, "block output"));
}

BlockSpec head(const ModelConfig& c, bool loss) { return decoder_head(c, style(c), "moe", loss); }

void check(const ModelConfig& c) {
  check_decoder(c, style(c));
  if (c.experts < 1 || c.experts > 4096) fail("ModelConfig.experts must be in 1..4096, got {}", c.experts);
  if (c.top_k < 1 || c.top_k > c.experts)
    fail("ModelConfig.top_k must be in 1..experts ({}), got {}", c.experts, c.top_k);
  if (c.shared_ffn < 0 || c.shared_ffn > (int64_t{1} << 24))
    fail("ModelConfig.shared_ffn must be in 0..16777216 (0: no shared expert), got {}", c.shared_ffn);
  if (c.shared_ffn % c.tp != 0)
    fail(
        "ModelConfig.shared_ffn {} must be a multiple of tp {}: the shared expert's first linears are split by columns",
        c.shared_ffn, c.tp);
  if (!(c.capacity_factor >= 0 && c.capacity_factor <= 1024))
    fail("ModelConfig.capacity_factor must be 0 (dropless) or in (0, 1024], got {}", c.capacity_factor);
  if (!(c.aux_loss >= 0 && c.aux_loss <= 1e3)) fail("ModelConfig.aux_loss must be in [0, 1000], got {}", c.aux_loss);
  // Megatron-LM's routers balance one way each: sinkhorn by its choice, the others by the loss.
  if (c.router == Router::Sinkhorn && c.aux_loss != 0)
    fail(
        "ModelConfig.aux_loss {} with ModelConfig.router sinkhorn: Sinkhorn's choice balances the experts itself, "
        "with no load-balancing loss (Megatron-LM's); give ModelConfig.aux_loss 0",
        c.aux_loss);
  // Megatron-LM's MoELayer refuses to train with tensor parallelism but no sequence parallelism
  // (moe_layer.py): each rank routes its own seq / tp tokens.
  if (c.tp > 1 && !c.sp)
    fail("ModelConfig.tp {} without sp: a mixture of experts routes each rank's share of the sequence; turn on sp",
         c.tp);
  // validate() has tp dividing the experts' width, so etp does too.
  if (c.etp < 1 || c.tp % c.etp != 0)
    fail(
        "ModelConfig.etp {} must divide tp {}: an expert-tensor-parallel group is a part of the tensor-parallel "
        "group, each rank holding ffn / etp of every local expert's features",
        c.etp, c.tp);
  if (c.cp > 1) fail("ModelConfig.cp {}: the moe block is not modelled under context parallelism; give cp 1", c.cp);
  if (c.ep < 1 || c.experts % c.ep != 0)
    fail("ModelConfig.ep {} must divide the experts ({}): each expert-parallel rank holds whole experts", c.ep,
         c.experts);
  if (!(c.expert_imbalance >= 1 && c.expert_imbalance <= 1024))
    fail("ModelConfig.expert_imbalance must be in [1, 1024] (the busiest rank's rows over the mean), got {}",
         c.expert_imbalance);
  // The dispatch buffer's rows times the widest expert tensor (SwiGLU's gate and up side by side),
  // in doubles so that nothing wraps, under validate()'s 2^60 bytes: the copies are top_k x tokens
  // (or capacity x experts), more than validate() counts.
  const double tokens = static_cast<double>(c.batch) * static_cast<double>(c.seq);
  const double copies = c.capacity_factor > 0
                            ? std::max(1.0, std::ceil(c.capacity_factor * tokens * static_cast<double>(c.top_k) /
                                                      static_cast<double>(c.experts))) *
                                  static_cast<double>(c.experts)
                            : tokens * static_cast<double>(c.top_k) * c.expert_imbalance;
  const double widest = std::max(static_cast<double>(c.dim), 2.0 * static_cast<double>(c.hidden()));
  if (8 * copies * widest > std::ldexp(1.0, 60))
    fail(
        "ModelConfig.batch {} x ModelConfig.seq {} x ModelConfig.top_k {} makes {:.3g} expert rows of {} features, "
        "over 2^60 bytes: give a smaller batch, seq, top_k, dim or ffn",
        c.batch, c.seq, c.top_k, copies, widest);
}

}  // namespace

extern const BlockKind kMoe{"moe",
                            "mixture of experts: LLaMA's attention, top-k routing to SwiGLU experts (dropless or a "
                            "capacity), an optional shared expert",
                            stem,
                            block,
                            head,
                            check,
                            choices,
                            /*has_logits=*/true,
                            /*routes=*/true};

}  // namespace remat::blocks
