// The mixture-of-experts block: its table, its routing's determinism and its load-balancing loss.
// (Every policy's bitwise gradients and exact bytes are the engine tests', which run every kind.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "core/builder.h"
#include "remat/block.h"
#include "remat/error.h"
#include "remat/executor.h"
#include "remat/memory.h"
#include "remat/model.h"
#include "remat/policy.h"
#include "remat/schedule.h"
#include "test_util.h"

namespace remat {
namespace {

using testing::tiny;

TEST(Moe, TheDispatchBufferHasItsSizeBeforeTheStep) {
  ModelConfig c = tiny("moe");  // 2 x 8 tokens, top 2 of 8 experts
  const BlockSpec dropless = make_block(c);
  EXPECT_EQ(dropless.tensors[dropless.find("xs")].shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(dropless.tensors[dropless.find("act")].shape, (std::vector<int64_t>{32, 64}));
  c.capacity_factor = 1.25;  // ceil(1.25 x 32 / 8) = 5 rows per expert
  const BlockSpec capped = make_block(c);
  EXPECT_EQ(capped.tensors[capped.find("xs")].shape, (std::vector<int64_t>{40, 16}));
  EXPECT_EQ(capped.param_numel(), dropless.param_numel());
}

// The first op of `kind` in b.
int op_of(const BlockSpec& b, OpKind kind) {
  for (size_t i = 0; i < b.ops.size(); ++i)
    if (b.ops[i].kind == kind) return static_cast<int>(i);
  return -1;
}

// Expert tensor parallelism (planning): on tp 2 + sp each rank routes its 4 of a sequence's 8
// tokens, 2 x 4 x 2 = 16 copies; with etp 2 the dispatch buffer holds the group's 32 rows at half
// the experts' width, with etp 1 its own 16 rows at the whole width. The alltoall dispatcher keeps,
// around the exchange, the 16 copies (1024 bytes), the buffer, and with ep 4 and etp 2 this rank's
// half of it between the all-to-all and the all-gather; it sends (1 - 1 / (ep etp)) of the buffer.
// The allgather dispatcher's gathered tokens are a fixed allocation, and it sends the group's other
// 7 ranks' shares of them (7 x 8 tokens x 64 bytes); its dispatch backward makes the gradient of
// the 8 x ep x etp gathered rows, and its way back unpermutes into them.
TEST(Moe, ExpertTensorParallelismGathersTheRowsOfItsRanks) {
  ModelConfig c = tiny("moe");
  c.tp = 2, c.sp = true, c.etp = 2;
  const BlockSpec split = make_block(c);
  const int dispatch = op_of(split, OpKind::Dispatch), combine = op_of(split, OpKind::Combine);
  EXPECT_EQ(split.tensors[split.find("xs")].shape, (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(split.tensors[split.find("act")].shape, (std::vector<int64_t>{32, 32}));
  const int64_t copies = 16 * 16 * 4, rows = 32 * 16 * 4;
  EXPECT_EQ(split.forward_scratch(dispatch, {}), copies + rows);
  EXPECT_DOUBLE_EQ(split.comm(dispatch).forward, rows / 2);
  c.ep = 4;
  const BlockSpec both = make_block(c);
  EXPECT_EQ(both.forward_scratch(dispatch, {}), copies + rows + rows / 2);
  EXPECT_DOUBLE_EQ(both.comm(dispatch).forward, rows * 7 / 8);
  c.allgather_dispatch = true;
  const BlockSpec gathered = make_block(c);
  EXPECT_EQ(gathered.forward_scratch(dispatch, {}), 0);
  EXPECT_EQ(gathered.backward_scratch(dispatch, {}), 8 * 4 * 2 * 16 * 4);
  EXPECT_DOUBLE_EQ(gathered.comm(dispatch).forward, 7 * 8 * 16 * 4);
  EXPECT_EQ(gathered.forward_scratch(combine, {}), 8 * 4 * 2 * 16 * 4);
  c.allgather_dispatch = false, c.etp = 1, c.ep = 2, c.shared_ffn = 8;  // a shared expert splits as a dense MLP
  const BlockSpec whole = make_block(c);
  EXPECT_EQ(whole.tensors[whole.find("shared_act")].shape, (std::vector<int64_t>{2, 8, 4}));
  EXPECT_EQ(whole.tensors[whole.find("xs")].shape, (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(whole.tensors[whole.find("act")].shape, (std::vector<int64_t>{16, 64}));
  c.etp = 4;  // more than the tensor-parallel group
  EXPECT_THROW(make_block(c), Error);
  c.etp = 2, c.sp = false;  // Megatron-LM's MoE layer refuses tp without sp
  EXPECT_THROW(make_block(c), Error);
}

// Under a capacity the alltoall dispatcher permutes every expert's rows padded to it (Megatron-LM's
// drop-and-pad): its copies are E x each rank's capacity rows, not tokens x k. tp 2 + sp, ep 2, etp 1: the
// rank's 8 tokens make 16 copies; capacity factor 2 gives each expert 4 rows of each rank, so 8 x 4
// = 32 padded copies, and a buffer of the rank's 4 experts x 2 ranks x 4 = 32 rows.
TEST(Moe, UnderACapacityTheExchangedCopiesArePaddedToIt) {
  ModelConfig c = tiny("moe");  // 8 experts, top 2, 16 wide
  c.tp = 2, c.sp = true, c.etp = 1, c.ep = 2, c.capacity_factor = 2.0;
  const BlockSpec b = make_block(c);
  const int dispatch = op_of(b, OpKind::Dispatch), combine = op_of(b, OpKind::Combine);
  const int64_t rows = b.tensors[b.find("xs")].bytes();
  ASSERT_EQ(rows, 32 * 16 * 4);
  EXPECT_EQ(b.forward_scratch(dispatch, {}), rows + rows);  // the padded copies, and the rows before the sort
  EXPECT_EQ(b.forward_scratch(combine, {}), rows + rows);
}

// A rank that holds one expert (8 experts over ep 8) takes the all-to-all's rows in its expert's
// order already: the alltoall dispatcher sorts nothing, and keeps only the copies it sent and, with
// etp 2, its rows before the all-gather (the gathered buffer is the experts' input itself).
TEST(Moe, ARankWithOneExpertSortsNothing) {
  ModelConfig c = tiny("moe");  // 8 experts
  c.tp = 2, c.sp = true, c.etp = 2, c.ep = 4;
  const int64_t copies = 16 * 16 * 4, rows = 32 * 16 * 4;
  const BlockSpec two = make_block(c);
  EXPECT_EQ(two.forward_scratch(op_of(two, OpKind::Dispatch), {}), copies + rows + rows / 2);
  EXPECT_EQ(two.forward_scratch(op_of(two, OpKind::Combine), {}), copies + rows + rows / 2);
  c.ep = 8;
  const BlockSpec one = make_block(c);
  EXPECT_EQ(one.forward_scratch(op_of(one, OpKind::Dispatch), {}), copies + rows / 2);
  EXPECT_EQ(one.forward_scratch(op_of(one, OpKind::Combine), {}), copies + rows / 2);
}

// Megatron-LM's --moe-router-dtype fp32 on a bf16 model: the logits and weights are fp32 tensors.
// Weighing GELU's 32 rows of 64 features makes an fp32 product (8192 bytes) in each pass; a
// SwiGLU's is weighted inside its fused kernel. The way back runs on an fp32 copy of the experts'
// outputs only where a collective carries them (tp 2 + sp, etp 2: the 32 x 16 rows, 2048 bytes,
// beside the copies and the outputs, and the reduce-scatter's fp32 half of them). A GELU model's
// shared expert is GELU too.
TEST(Moe, AnFp32RouterWeighsAndCombinesInFp32) {
  ModelConfig c = tiny("moe");
  c.dtype = DType::BF16, c.expert_weights = ExpertWeights::Activation, c.router_fp32 = true, c.mlp = Mlp::Gelu;
  c.shared_ffn = 8;
  const BlockSpec fp32 = make_block(c);
  const int weigh = op_of(fp32, OpKind::Weigh), unpermute = op_of(fp32, OpKind::Unpermute);
  EXPECT_EQ(fp32.tensors[fp32.find("router")].dtype, DType::F32);
  EXPECT_EQ(fp32.tensors[fp32.find("weights")].dtype, DType::F32);
  EXPECT_EQ(fp32.forward_scratch(weigh, {}), 32 * 64 * 4);
  EXPECT_EQ(fp32.backward_scratch(weigh, {}), 32 * 64 * 4);
  EXPECT_EQ(fp32.forward_scratch(unpermute, {}), 0);
  EXPECT_GE(fp32.find("shared_fc"), 0);
  EXPECT_EQ(fp32.find("shared_gate"), -1);
  c.tp = 2, c.sp = true, c.etp = 2;
  const BlockSpec split = make_block(c);
  EXPECT_EQ(split.forward_scratch(op_of(split, OpKind::Unpermute), {}),
            16 * 16 * 2 + 32 * 16 * 2 + 32 * 16 * 4 + 16 * 16 * 4);
  c.tp = 1, c.sp = false, c.etp = 1, c.mlp = Mlp::Swiglu;
  const BlockSpec fused = make_block(c);
  EXPECT_EQ(fused.forward_scratch(op_of(fused, OpKind::Weigh), {}), 0);
  c.router_fp32 = false;
  const BlockSpec model = make_block(c);
  EXPECT_EQ(model.tensors[model.find("weights")].dtype, DType::BF16);
}

TEST(Moe, PresetsDropWhatTheirMegatronModulesRecompute) {
  ModelConfig c = tiny("moe");
  c.shared_ffn = 8;
  const BlockSpec b = make_block(c);
  auto dropped = [&](const char* preset) {
    std::vector<std::string> names;
    const LayerPolicy l = Policy::parse(preset).resolve(b, 1).layers[0];
    for (int t : b.choosable())
      if (!l.saves(t)) names.push_back(b.tensors[t].name);
    return names;
  };
  EXPECT_EQ(dropped("moe-act"), (std::vector<std::string>{"act"}));
  EXPECT_EQ(dropped("mlp-act"), (std::vector<std::string>{"act"}));
  EXPECT_EQ(dropped("shared"), (std::vector<std::string>{"shared_gate", "shared_up", "shared_act"}));
  EXPECT_EQ(dropped("moe"), (std::vector<std::string>{"weights", "experts", "router_probs", "xs", "slots", "rows",
                                                      "gate", "up", "act", "down"}));
  EXPECT_THROW(Policy::parse("moe").resolve(make_block(tiny("llama")), 1), Error);
}

// Megatron-LM's placement keeps the activation and its weighted copy (rows x ffn each) where the
// combine keeps the experts' outputs (rows x dim); moe-act drops both copies.
TEST(Moe, WeightsOnTheActivationKeepItsWeightedCopyInsteadOfTheOutputs) {
  ModelConfig c = tiny("moe");  // 32 dispatch rows, ffn 64, dim 16, fp32
  auto saved = [](const BlockSpec& b) {
    return compile_schedule(b, Policy::parse("none").resolve(b, 1).layers[0]).saved_bytes(b);
  };
  const int64_t on_outputs = saved(make_block(c));
  c.expert_weights = ExpertWeights::Activation;
  const BlockSpec b = make_block(c);
  EXPECT_EQ(saved(b) - on_outputs, 32 * (64 - 16) * 4);
  EXPECT_EQ(b.tensors[b.find("weighed")].shape, (std::vector<int64_t>{32, 64}));
  std::vector<std::string> dropped;
  const LayerPolicy act = Policy::parse("moe-act").resolve(b, 1).layers[0];
  for (int t : b.choosable())
    if (!act.saves(t)) dropped.push_back(b.tensors[t].name);
  EXPECT_EQ(dropped, (std::vector<std::string>{"act", "weighed"}));
}

// Under PyTorch's deterministic algorithms (Megatron-LM's --deterministic-mode) the unpermute is an
// index_add, whose backward keeps the experts' outputs (32 rows x dim 16, fp32) beside its indices;
// the engine, deterministic already, refuses to plan it.
TEST(Moe, DeterministicUnpermuteKeepsTheExpertsOutputs) {
  ModelConfig c = tiny("moe");
  c.expert_weights = ExpertWeights::Activation;
  auto saved = [](const BlockSpec& b) {
    return compile_schedule(b, Policy::parse("none").resolve(b, 1).layers[0]).saved_bytes(b);
  };
  const int64_t scatter = saved(make_block(c));
  c.deterministic = true;
  EXPECT_EQ(saved(make_block(c)) - scatter, 32 * 16 * 4);
  EXPECT_THROW(GPT(c, Policy::parse("none")), Error);
}

// Ties are broken by a fixed rule (TiedScoresPickTheLowestExperts), so a recompute of the same
// logits routes the same way: with a zero router every token's scores tie, and every policy still
// gives none's bits.
TEST(Moe, TiedScoresRouteTheSameInARecompute) {
  const ModelConfig c = tiny("moe", 0.1);
  auto grads = [&](const std::string& policy) {
    at::manual_seed(1);
    GPT model(c, Policy::parse(policy));
    for (auto& item : model->named_parameters())
      if (item.key().find("router") != std::string::npos) item.value().data().zero_();
    at::manual_seed(2);
    auto [x, y] = random_batch(c);
    at::manual_seed(3);
    model->forward(x, y).backward();
    std::vector<at::Tensor> g;
    for (const at::Tensor& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const std::vector<at::Tensor> none = grads("none");
  for (const char* p : {"full", "moe", "every:2"}) {
    const std::vector<at::Tensor> again = grads(p);
    ASSERT_EQ(again.size(), none.size());
    for (size_t i = 0; i < none.size(); ++i) EXPECT_TRUE(testing::bitwise_equal(again[i], none[i])) << p << " " << i;
  }
}

// The route op alone: a stage of one op, run by the executor.
struct RouteRun {
  at::Tensor weights, experts, dlogits;
};

BlockSpec route_stage(const at::Tensor& logits, const Routing& routing) {
  ModelConfig cfg;
  detail::Builder b(cfg, "test.route");
  const int z = b.input("logits", logits.sizes().vec(), DType::F32, "router logits");
  std::vector<int64_t> per_token = logits.sizes().vec();
  per_token.back() = routing.top_k;
  b.op(OpKind::Route, "route", {z},
       {{"weights", per_token}, {"experts", per_token, DType::I64}, {"probs", logits.sizes().vec()}});
  b.last().routing = routing;
  return b.finish(b.last().out[0]);
}

RouteRun run_route(const at::Tensor& logits, const Routing& routing, const at::Tensor& dweights) {
  const BlockSpec spec = route_stage(logits, routing);
  BlockExecutor exec(spec, keep_everything(spec));
  BlockContext ctx;
  RouteRun r;
  r.weights = exec.forward({logits}, {}, ctx, 0);
  r.experts = ctx.tensors[spec.find("experts")].clone();
  r.dlogits = exec.backward(dweights, {}, ctx, {true}, 0).inputs[0];
  return r;
}

RouteRun run_route(const at::Tensor& logits, int64_t k, double aux, const at::Tensor& dweights) {
  return run_route(logits, Routing{logits.size(-1), k, 0, false, true, aux}, dweights);
}

TEST(Moe, TiedScoresPickTheLowestExperts) {
  const at::Tensor logits = at::zeros({3, 6}, at::kDouble);
  logits[1][4] = 1.0;  // one clear winner, then ties
  const RouteRun r = run_route(logits, 3, 0.0, at::ones({3, 3}, at::kDouble));
  EXPECT_TRUE(at::equal(r.experts, at::tensor({0, 1, 2, 4, 0, 1, 0, 1, 2}, at::kLong).reshape({3, 3}))) << r.experts;
}

// The load-balancing loss c E sum_e f_e P_e: with no gradient from the weights, the router's
// gradient is the loss's, as autograd finds it with f_e held constant (it counts choices).
TEST(Moe, TheRouterBackwardAddsTheLoadBalancingLossGradient) {
  at::manual_seed(4);
  const int64_t tokens = 10, experts = 5, k = 2;
  const double coef = 0.3;
  const at::Tensor logits = at::randn({tokens, experts}, at::kDouble);
  const RouteRun r = run_route(logits, k, coef, at::zeros({tokens, k}, at::kDouble));
  const at::Tensor f = at::one_hot(r.experts.reshape({-1}), experts).sum(0).to(at::kDouble) / (tokens * k);
  const at::Tensor z = logits.clone().requires_grad_();
  const at::Tensor P = at::softmax(z, -1).mean(0);
  const at::Tensor loss = coef * experts * (f * P).sum();
  const at::Tensor want = torch::autograd::grad({loss}, {z})[0];
  EXPECT_TRUE(testing::close(r.dlogits, want, 1e-12));
  EXPECT_GT(want.abs().max().item<double>(), 1e-3);
}

// With sigmoid scores the loss's P_e is the mean of each token's scores divided by their sum
// (Megatron-LM's compute_routing_scores_for_aux_loss), so lowering every logit does not lower it.
TEST(Moe, TheSigmoidRoutersBalancingGradientIsOfScoresDividedByTheirSum) {
  at::manual_seed(6);
  const int64_t tokens = 10, experts = 5, k = 2;
  const double coef = 0.3;
  const at::Tensor logits = at::randn({tokens, experts}, at::kDouble);
  const RouteRun r =
      run_route(logits, Routing{experts, k, 0, /*sigmoid=*/true, true, coef}, at::zeros({tokens, k}, at::kDouble));
  const at::Tensor f = at::one_hot(r.experts.reshape({-1}), experts).sum(0).to(at::kDouble) / (tokens * k);
  const at::Tensor z = logits.clone().requires_grad_();
  const at::Tensor s = at::sigmoid(z);
  const at::Tensor P = (s / (s.sum(-1, true) + 1e-20)).mean(0);
  const at::Tensor want = torch::autograd::grad({coef * experts * (f * P).sum()}, {z})[0];
  EXPECT_TRUE(testing::close(r.dlogits, want, 1e-12));
  // Scaling a token's scores together leaves P unchanged: sum_e p_e dL/dp_e = 0, dL/dp = dz / (p (1 - p)).
  const at::Tensor p = s.detach();
  EXPECT_LT((r.dlogits / (1 - p)).sum(-1).abs().max().item<double>(), 1e-12);
}

// One expert per token under the sigmoid router keeps its score as its weight (Megatron-LM): a
// weight divided by itself is 1, and the main loss would never reach the router.
TEST(Moe, OneSigmoidWeightIsItsScore) {
  ModelConfig c = tiny("moe");
  c.router = Router::Sigmoid, c.top_k = 1;
  const BlockSpec spec = make_block(c);
  const auto route =
      std::find_if(spec.ops.begin(), spec.ops.end(), [](const OpNode& o) { return o.kind == OpKind::Route; });
  ASSERT_NE(route, spec.ops.end());
  EXPECT_FALSE(route->routing.normalize);
  c.top_k = 2;
  const BlockSpec two = make_block(c);
  EXPECT_TRUE(std::find_if(two.ops.begin(), two.ops.end(), [](const OpNode& o) {
                return o.kind == OpKind::Route;
              })->routing.normalize);
}

// Megatron-LM's sinkhorn router, one expert per token, sigmoid weights: the routing of tokens that
// all prefer expert 0.
RouteRun sinkhorn_top1(const at::Tensor& logits) {
  Routing r{logits.size(-1), 1, 0, /*sigmoid=*/true, /*normalize=*/false};
  r.sinkhorn = true;
  return run_route(logits, r, at::ones({logits.size(0), 1}, at::kDouble));
}

at::Tensor prefer_expert_0(int64_t tokens, int64_t experts) {
  at::manual_seed(5);
  at::Tensor z = 0.3 * at::randn({tokens, experts}, at::kDouble);
  z.select(1, 0).add_(3.0);
  return z;
}

// Megatron-LM's routers balance one way each: a load-balancing loss beside the sinkhorn router is
// refused, not added to a router that already balances.
TEST(Moe, SinkhornRefusesALoadBalancingLoss) {
  ModelConfig c = tiny("moe");
  c.router = Router::Sinkhorn, c.top_k = 1, c.aux_loss = 0.01;
  EXPECT_NE(testing::error_of([&] { validate(c); }).find("ModelConfig.aux_loss 0.01 with ModelConfig.router sinkhorn"),
            std::string::npos);
  c.aux_loss = 0;
  EXPECT_EQ(testing::error_of([&] { validate(c); }), "");
}

// Sinkhorn balances the choice: where every token's top probability is expert 0's, the balanced
// scores send each expert close to its share of the tokens.
TEST(Moe, SinkhornSpreadsTokensThatAllPreferOneExpert) {
  const int64_t tokens = 64, experts = 4;
  const at::Tensor z = prefer_expert_0(tokens, experts);
  ASSERT_TRUE(at::equal(std::get<1>(z.max(-1)), at::zeros({tokens}, at::kLong)));
  const at::Tensor counts = at::bincount(sinkhorn_top1(z).experts.reshape({-1}), {}, experts);
  EXPECT_LE(counts.max().item<int64_t>(), tokens / experts * 3 / 2) << counts;
  EXPECT_GE(counts.min().item<int64_t>(), tokens / experts / 2) << counts;
}

// Sinkhorn's working memory (a double per token and expert, and per token) is the router's
// declared forward scratch: the tracker's peak over the forward is the outputs and it, exactly.
TEST(Moe, SinkhornsWorkingMemoryIsTheRoutersForwardScratch) {
  const at::Tensor logits = prefer_expert_0(64, 4).to(at::kFloat);
  Routing r{4, 1, 0, /*sigmoid=*/true, /*normalize=*/false};
  r.sinkhorn = true;
  const BlockSpec spec = route_stage(logits, r);
  BlockExecutor exec(spec, keep_everything(spec));
  BlockContext ctx;
  const int64_t before = MemoryTracker::live();
  MemoryTracker::reset_peak();
  const at::Tensor weights = exec.forward({logits}, {}, ctx, 0);
  const int64_t outputs = MemoryTracker::live() - before, scratch = spec.forward_scratch(0, {});
  EXPECT_GE(scratch, 64 * 4 * 8);
  EXPECT_EQ(MemoryTracker::peak() - before, outputs + scratch);
}

// Outside training Sinkhorn does not choose (Megatron-LM routes by each token's own scores there):
// a sequence's logits do not depend on the other sequences of its batch.
TEST(Moe, SinkhornRoutesByEachTokensOwnScoresInEvaluation) {
  ModelConfig c = tiny("moe");
  c.router = Router::Sinkhorn, c.top_k = 1, c.aux_loss = 0;
  at::manual_seed(8);
  GPT model(c, Policy::parse("none"));
  model->eval();
  auto [input, target] = random_batch(c);
  const at::Tensor others = input.clone();
  others.narrow(0, 1, c.batch - 1).random_(0, c.vocab);
  EXPECT_TRUE(testing::close(model->logits(input)[0], model->logits(others)[0], 1e-5));
}

// The choice is the top of the balanced scores as Sinkhorn-Knopp finds them, written here with
// ATen in Megatron-LM's form (exp of the logits, rows then columns rescaled until the column scales
// move less than 1e-4); the weight is the sigmoid of the chosen logit.
TEST(Moe, SinkhornChoosesTheTopOfTheBalancedScores) {
  const int64_t tokens = 40, experts = 5;
  const at::Tensor z = prefer_expert_0(tokens, experts);
  const at::Tensor cost = z.exp();
  at::Tensor row = at::ones({tokens}, at::kDouble), col = at::ones({experts}, at::kDouble);
  for (double moved = 1; moved > 1e-4;) {
    row = 1.0 / (tokens * (cost * col).sum(1));
    const at::Tensor next = 1.0 / (experts * (cost * row.unsqueeze(1)).sum(0));
    moved = (next - col).abs().mean().item<double>();
    col = next;
  }
  const at::Tensor want = std::get<1>((cost * col * row.unsqueeze(1)).max(-1, true));
  const RouteRun r = sinkhorn_top1(z);
  EXPECT_TRUE(at::equal(r.experts, want)) << r.experts.reshape({-1}) << want.reshape({-1});
  EXPECT_TRUE(testing::close(r.weights, at::sigmoid(z).gather(1, want), 1e-12));
  EXPECT_FALSE(at::equal(want, std::get<1>(z.max(-1, true))));  // the balance changed some choices
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

// Expert parallelism is planned, not run: the engine refuses a rank's share of the experts.
TEST(Moe, TheEngineRefusesExpertParallelism) {
  ModelConfig c = testing::tiny("moe");
  c.ep = 2;
  EXPECT_NO_THROW(make_model(c));  // a planning rank's stages
  EXPECT_NE(testing::error_of([&] { GPT(c, Policy::parse("none")); }).find("ModelConfig.ep 2"), std::string::npos);
}

}  // namespace
}  // namespace remat
