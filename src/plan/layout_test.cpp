// Parallel layouts against published formulas: Korthikanti et al. 2022 (activations per layer under
// tensor and sequence parallelism and selective recompute), Megatron's and the ZeRO paper's bytes
// per parameter, and the 1F1B schedule's micro-batches in flight.
#include <cctype>
#include <set>

#include <gtest/gtest.h>

#include "core/shard.h"
#include "remat/block.h"
#include "remat/error.h"
#include "remat/layout.h"
#include "remat/memory_model.h"
#include "remat/policy.h"
#include "remat/schedule.h"
#include "test_util.h"

namespace remat {
namespace {

// A GPT block as Korthikanti et al. count it: fp16, dropout on, attention scores stored dense.
ModelConfig paper_block(int64_t t, bool sp) {
  ModelConfig c;
  c.arch = "gpt2";
  c.layers = 4;
  c.dim = 256;  // h
  c.heads = 8;  // a
  c.seq = 128;  // s
  c.batch = 2;  // b
  c.vocab = 512;
  c.dtype = DType::F16;
  c.dropout = 0.1;
  c.attn_block = c.seq;  // one block: the dense (B, H, T, T) layout
  c.tp = t;
  c.sp = sp;
  return c;
}

// What one layer keeps for its backward: its saved tensors and its input (the LayerNorm input the
// paper counts as 2sbh).
int64_t layer_bytes(const ModelConfig& c, const char* policy) {
  const BlockSpec b = make_block(c);
  const Schedule s = compile_schedule(b, Policy::parse(policy).resolve(b, c.layers).layers[0]);
  return s.saved_bytes(b) + b.tensors[b.inputs[0]].bytes();
}

// remat also keeps each LayerNorm's mean and 1/std per token in fp32, which the paper's count
// leaves out: 2 norms x 2 x 4 bytes per token, per rank's tokens.
int64_t norm_stats(const ModelConfig& c) { return 16 * c.batch * c.rank_seq(); }

struct Row {
  const char* name;
  int64_t t;
  bool sp;
  const char* policy;
  // Bytes per layer as Table 2 writes them, with s b h a t of the config.
  double (*formula)(double s, double b, double h, double a, double t);
  bool stats;  // the row keeps the norm statistics
};

const Row kTable2[] = {
    {"no parallelism", 1, false, "none",
     [](double s, double b, double h, double a, double) { return s * b * h * (34 + 5 * a * s / h); }, true},
    {"tensor parallel (baseline)", 4, false, "none",
     [](double s, double b, double h, double a, double t) { return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)); },
     true},
    {"tensor + sequence parallel", 4, true, "none",
     [](double s, double b, double h, double a, double t) { return s * b * h / t * (34 + 5 * a * s / h); }, true},
    {"tensor parallel + selective recompute", 4, false, "attn",
     [](double s, double b, double h, double, double t) { return s * b * h * (10 + 24 / t); }, true},
    {"tensor + sequence parallel + selective recompute", 4, true, "attn",
     [](double s, double b, double h, double, double t) { return s * b * h / t * 34; }, true},
    {"full activation recompute", 4, false, "full",
     [](double s, double b, double h, double, double) { return 2 * s * b * h; }, false},
    {"full activation recompute with sequence parallel", 4, true, "full",
     [](double s, double b, double h, double, double t) { return 2 * s * b * h / t; }, false},
};

class Table2 : public ::testing::TestWithParam<Row> {};

TEST_P(Table2, ActivationsPerLayerMatchTheFormulaToTheByte) {
  const Row& row = GetParam();
  for (int64_t t : {row.t, row.t == 1 ? int64_t{1} : int64_t{2}, row.t == 1 ? int64_t{1} : int64_t{8}}) {
    const ModelConfig c = paper_block(t, row.sp);
    const double want = row.formula(static_cast<double>(c.seq), static_cast<double>(c.batch),
                                    static_cast<double>(c.dim), static_cast<double>(c.heads), static_cast<double>(t));
    const int64_t got = layer_bytes(c, row.policy) - (row.stats ? norm_stats(c) : 0);
    EXPECT_EQ(got, static_cast<int64_t>(want)) << row.name << " at t = " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Korthikanti2022, Table2, ::testing::ValuesIn(kTable2), [](const auto& info) {
  std::string n = info.param.name;
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// The check above sees what a formula leaves out: the same block under `none`, held against the
// selective-recompute formula, is over it by exactly the scores, softmax and dropout mask (5 a s^2 b).
TEST(Table2Check, SeesTheAttentionTensorsAFormulaLeavesOut) {
  const ModelConfig c = paper_block(1, false);
  const int64_t sbh = c.seq * c.batch * c.dim;
  const int64_t none = layer_bytes(c, "none") - norm_stats(c);
  EXPECT_EQ(none - sbh * 34, 5 * c.heads * c.seq * c.seq * c.batch);
}

// Weights, gradients and optimizer state of one rank, per parameter.
struct ParamBytes {
  int64_t numel = 0;
  int64_t weights = 0, grads = 0, optimizer = 0;
};

ParamBytes param_bytes(const ModelConfig& c, int zero, int world, int grad_bytes) {
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  ResolvedPolicy none;
  none.layers.assign(c.layers, keep_everything(spec->block));
  StepShape shape;
  shape.world = world;
  shape.rank = world - 1;  // the last shard is the largest (shard_first rounds down)
  shape.zero = zero;
  shape.grad_buffers = true;
  shape.grad_bytes = grad_bytes;
  const StepMemory m = simulate_memory(compile_step(spec, none), {1, 1}, nullptr, shape);
  return {spec->param_numel(), m.params, m.grads, m.optimizer};
}

ModelConfig mixed_model() {
  ModelConfig c = paper_block(1, false);
  c.dtype = DType::BF16;
  return c;
}

// Megatron's accounting (Korthikanti et al., Narayanan et al.): bf16 weights, fp32 gradients, fp32
// master weights and Adam moments: 18 bytes per parameter; 6 + 12 / d with the distributed
// optimizer (ZeRO-1).
TEST(MegatronBytes, EighteenPerParameterAndSixPlusTwelveOverD) {
  const ModelConfig c = mixed_model();
  const ParamBytes b = param_bytes(c, 0, 1, 4);
  EXPECT_EQ(b.weights + b.grads + b.optimizer, 18 * b.numel);
  for (int d : {2, 4, 8}) {
    const ParamBytes z = param_bytes(c, 1, d, 4);
    const int64_t shard = b.numel - shard_first(b.numel, d - 1, d);  // the largest share
    EXPECT_EQ(z.weights + z.grads, 6 * b.numel) << "d = " << d;
    EXPECT_EQ(z.optimizer, 12 * shard) << "d = " << d;
    EXPECT_LE(12 * shard - 12 * b.numel / d, 12) << "a shard is psi / d, rounded";
  }
}

// Megatron-LM's --num-distributed-optimizer-instances: dp 4 in 2 instances keeps the weights and
// gradient buffers of dp 4 and the optimizer state of a dp-2 shard; its data-parallel time moves
// each rank's gradients within its instance's ring (a reduce-scatter of 1/2, then the gather of
// the weights), and its shard's gradients across the 2 instances in an all-reduce.
TEST(MegatronBytes, OptimizerInstancesShardTheStateWithinAnInstance) {
  const ModelConfig c = mixed_model();
  const Device d = parse_device("h100-80gb");
  auto plan = [&](int64_t dp, int64_t instances) {
    Layout l;
    l.dp = dp, l.zero = 1, l.optimizer_instances = instances, l.micro_batch = 2, l.global_batch = 8;
    return plan_layout(c, l, d, "none");
  };
  const LayoutPlan split = plan(4, 2), whole = plan(4, 1), pair = plan(2, 1);
  const StepMemory &m = split.rank().memory, &one = whole.rank().memory;
  EXPECT_EQ(m.params, one.params);
  EXPECT_EQ(m.grads, one.grads);
  EXPECT_EQ(m.optimizer, pair.rank().memory.optimizer);
  EXPECT_GT(m.optimizer, one.optimizer);
  const double rate = d.intra_gbps * d.link_efficiency * 1e9, elements = static_cast<double>(m.params) / 2;
  const double ring = 0.5 * elements * (4 + 2), across = 2 * 0.5 * elements / 2 * 4;  // fp32 gradients, bf16 weights
  EXPECT_NEAR(split.time.dp_comm_s, (ring + across) / rate, 1e-12);
  EXPECT_NEAR(whole.time.dp_comm_s, 0.75 * elements * (4 + 2) / rate, 1e-12);  // one instance: the plain ring
}

// dp 16 on 8-GPU nodes in 2 instances: each instance is one node, so its ring runs at NVLink's
// rate; only the all-reduce across the instances crosses the network.
TEST(MegatronBytes, AnInstanceInOneNodeRingsAtTheNodesRate) {
  const ModelConfig c = mixed_model();
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.dp = 16, l.zero = 1, l.optimizer_instances = 2, l.micro_batch = 1, l.global_batch = 16;
  const LayoutPlan p = plan_layout(c, l, d, "none");
  const double elements = static_cast<double>(p.rank().memory.params) / 2;
  const double ring = 7.0 / 8 * elements * (4 + 2), across = 2 * 0.5 * elements / 8 * 4;
  const double intra = d.intra_gbps * d.link_efficiency * 1e9, inter = d.inter_gbps * d.link_efficiency * 1e9;
  EXPECT_NEAR(p.time.dp_comm_s, ring / intra + across / inter, 1e-12);
}

// The ZeRO paper (Rajbhandari et al. 2020), fp16 gradients, K = 12: stage 0 (2 + 2 + K) psi,
// stage 1 2psi + 2psi + K psi / N, stage 2 2psi + (2 + K) psi / N, stage 3 (2 + 2 + K) psi / N.
TEST(ZeroBytes, StagesZeroToThreeAsThePaperDefinesThem) {
  const ModelConfig c = mixed_model();
  const int n = 8;
  const int64_t psi = param_bytes(c, 0, 1, 2).numel;
  const int64_t share = psi - shard_first(psi, n - 1, n);
  auto total = [&](int zero) {
    const ParamBytes b = param_bytes(c, zero, n, 2);
    return b.weights + b.grads + b.optimizer;
  };
  EXPECT_EQ(total(0), (2 + 2 + 12) * psi);
  EXPECT_EQ(total(1), 2 * psi + 2 * psi + 12 * share);
  EXPECT_EQ(total(2), 2 * psi + (2 + 12) * share);
  EXPECT_EQ(total(3), (2 + 2 + 12) * share);
}

// How many of a stage's micro-batches (chunk forwards) are alive at once under an order.
int most_in_flight(const std::vector<PipelineStep>& order) {
  int live = 0, most = 0;
  for (const PipelineStep& s : order) {
    live += s.forward ? 1 : -1;
    most = std::max(most, live);
  }
  return most;
}

// 1F1B: stage r holds p - r micro-batches at most (the first stage p), fewer when there are fewer.
TEST(Pipeline, FirstStageHoldsPMicroBatchesFewerWhenThereAreFewer) {
  for (int p : {1, 2, 4, 8})
    for (int m : {1, 3, 8, 16})
      for (int r = 0; r < p; ++r) {
        const std::vector<PipelineStep> order = pipeline_order(p, r, 1, m);
        EXPECT_EQ(most_in_flight(order), std::min(p - r, m)) << "p " << p << " m " << m << " stage " << r;
        EXPECT_EQ(static_cast<int>(order.size()), 2 * m);
      }
}

// Interleaved 1F1B with v chunks: the first stage holds v p + p - 1 chunk micro-batches of L / (p v)
// layers each, L (1 + (p - 1) / (p v)) layers' worth: Korthikanti et al.'s factor.
TEST(Pipeline, InterleavedFirstStageHoldsTheFactorMore) {
  for (int p : {2, 4})
    for (int v : {2, 3}) {
      const std::vector<PipelineStep> order = pipeline_order(p, 0, v, 4 * p);
      EXPECT_EQ(most_in_flight(order), v * p + p - 1) << "p " << p << " v " << v;
      // Every (micro-batch, chunk) runs forward once, then backward once.
      std::vector<int> state(4 * p * v, 0);
      for (const PipelineStep& s : order) {
        int& st = state[s.micro * v + s.chunk];
        EXPECT_EQ(st, s.forward ? 0 : 1);
        st = s.forward ? 1 : 2;
      }
      for (int st : state) EXPECT_EQ(st, 2);
    }
}

// The memory model folds the pipeline order over each chunk's passes: the same peak as replaying
// every op of every micro-batch.
TEST(Pipeline, FoldingChunkPassesEqualsReplayingEveryOp) {
  ModelConfig c = mixed_model();
  c.layers = 8;
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  const ResolvedPolicy none = Policy::parse("attn").resolve(spec->block, c.layers);
  for (int p : {2, 4})
    for (int v : {1, 2})
      for (int m : {p, 3 * p, 8 * p})
        for (int r = 0; r < p; ++r) {
          std::vector<LayerRange> chunks;
          const int64_t per = c.layers / (p * v);
          for (int k = 0; k < v; ++k) chunks.push_back({(k * p + r) * per, (k * p + r + 1) * per});
          const CompiledStep plan = compile_step(spec, none, chunks);
          StepShape s;
          s.micro = m;
          s.scaled_loss = true;
          s.stages = p;
          s.stage = r;
          s.chunks = v;
          const StepMemory folded = simulate_memory(plan, {1, 1}, nullptr, s);
          s.op_by_op = true;
          const StepMemory all = simulate_memory(plan, {1, 1}, nullptr, s);
          EXPECT_EQ(folded.total_peak(), all.total_peak()) << "p " << p << " v " << v << " m " << m << " stage " << r;
          EXPECT_EQ(folded.peak_at, all.peak_at);
        }
}

// A pipeline stage's activations grow with the micro-batches in flight: p of them on the first.
TEST(Pipeline, FirstStagePeakCountsPMicroBatches) {
  ModelConfig c = mixed_model();
  c.layers = 8;
  auto spec = std::make_shared<const ModelSpec>(make_model(c));
  const ResolvedPolicy full = Policy::parse("full").resolve(spec->block, c.layers);
  const int p = 4;
  const CompiledStep plan = compile_step(spec, full, {{2, 4}});  // stage 1 of 4: no stem, no head
  auto peak = [&](int m) {
    StepShape s;
    s.micro = m, s.scaled_loss = true, s.stages = p, s.stage = 1;
    return simulate_memory(plan, {1, 1}, nullptr, s).total_peak();
  };
  // Under full recompute a micro-batch in flight keeps the inputs of the stage's two layers.
  const int64_t x = spec->block.tensors[spec->block.inputs[0]].bytes();
  EXPECT_EQ(peak(2) - peak(1), 2 * x);
  EXPECT_EQ(peak(3) - peak(2), 2 * x);
  EXPECT_EQ(peak(8), peak(3));  // stage 1 of 4 holds p - 1 = 3
}

// A rank of a tensor-parallel group holds 1 / t of every split parameter and all of the others.
TEST(TensorParallel, RanksHoldTheirShareOfTheParameters) {
  ModelConfig c;
  c.arch = "llama";
  c.layers = 2, c.dim = 128, c.heads = 8, c.kv_heads = 4, c.ffn = 344, c.vocab = 512, c.seq = 16, c.batch = 1;
  c.dtype = DType::BF16;
  const int64_t whole = make_model(c).param_numel();
  int64_t replicated = 0;
  const ModelSpec one = make_model(c);
  for (const BlockSpec* b : {&one.block})
    for (const ParamSpec& p : b->params)
      if (p.name.find("rms") == 0) replicated += p.numel() * c.layers;
  for (const ParamSpec& p : one.head.params)
    if (p.name.find("rms") == 0) replicated += p.numel();
  for (int64_t t : {2, 4}) {
    c.tp = t;
    const int64_t rank = make_model(c).param_numel();
    EXPECT_EQ(rank * t, whole + (t - 1) * replicated) << "t = " << t;
  }
}

// A layout that fits is found, and its most-loaded stage is the one reported.
TEST(Layouts, TheMostLoadedStageIsReported) {
  ModelConfig c = mixed_model();
  c.layers = 8;
  Device d = parse_device("a100-80gb");
  Layout l;
  l.tp = 2, l.sp = true, l.pp = 4, l.dp = 2, l.zero = 1, l.micro_batch = 2, l.global_batch = 32;
  const LayoutPlan all = plan_layout(c, l, d, "attn");
  ASSERT_EQ(all.ranks.size(), 4u);
  for (const RankPlan& r : all.ranks) EXPECT_LE(r.memory.total_peak(), all.peak());
  PlanOptions quick;
  quick.all_stages = false;  // the search's shortcut: stages 0, 1 and the last
  EXPECT_EQ(plan_layout(c, l, d, "attn", quick).peak(), all.peak());
  EXPECT_TRUE(all.fits);
}

// "auto" gives each stage the fastest choice that fits: never slower than a preset that fits,
// never over the budget.
TEST(Layouts, AutoFitsAndBeatsTheFittingPreset) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512, c.batch = 1;
  const Device d = parse_device("a100-80gb");
  Layout l;
  l.pp = 4, l.micro_batch = 4, l.global_batch = 16;
  const int64_t none = plan_layout(c, l, d, "none").peak();
  PlanOptions o;
  o.budget = none * 3 / 4;  // none does not fit
  const LayoutPlan full = plan_layout(c, l, d, "full", o), automatic = plan_layout(c, l, d, "auto", o);
  ASSERT_TRUE(full.fits);
  EXPECT_TRUE(automatic.fits);
  EXPECT_LE(automatic.peak(), o.budget);
  EXPECT_LT(automatic.time.step_s, full.time.step_s);
  EXPECT_FALSE(plan_layout(c, l, d, "none", o).fits);
}

// The search prunes by a time bound and stops replaying a layout at its first stage over the
// budget; with fixed policies its list must equal planning every layout in full and sorting.
TEST(Layouts, SearchEqualsPlanningEveryLayout) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512;
  Device d = parse_device("a100-80gb");
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16;
  space.policies = {"none", "attn", "full"};
  space.zero = {0, 1, 2, 3};  // every stage, as the loops below
  Layout probe;
  probe.dp = 8, probe.zero = 3, probe.micro_batch = 1, probe.global_batch = 16;
  PlanOptions o;
  o.budget = plan_layout(c, probe, d, "attn").peak();  // the fastest bounds do not fit
  const int top = 12;
  const SearchResult found = search_layouts(c, space, d, top, o);
  std::vector<std::pair<double, std::string>> all;  // (step, layout and policy) of every fitting pair
  int64_t candidates = 0;
  for (int64_t tp : {1, 2, 4, 8})
    for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp)
      for (int64_t pp : {1, 2, 4, 8})
        for (int64_t vpp = 1; vpp <= (pp > 1 ? 4 : 1); ++vpp)
          for (int64_t mb : {1, 2, 4, 8})
            for (int zero = 0; zero <= 3; ++zero) {
              if (tp * pp > 8) continue;
              Layout l;
              l.tp = tp, l.sp = sp != 0, l.pp = pp, l.vpp = vpp, l.dp = 8 / (tp * pp), l.zero = zero;
              l.micro_batch = mb, l.global_batch = 16;
              if (zero > 0 && l.dp == 1) continue;
              try {
                validate(l, c, d);
              } catch (const Error&) {
                continue;
              }
              ++candidates;
              std::pair<double, std::string> best{1e300, ""};
              for (const std::string& policy : space.policies) {
                const LayoutPlan p = plan_layout(c, l, d, policy, o);
                if (p.fits && p.time.step_s < best.first) best = {p.time.step_s, to_string(l) + " " + policy};
              }
              if (!best.second.empty()) all.push_back(best);
            }
  EXPECT_EQ(found.candidates, candidates);
  std::stable_sort(all.begin(), all.end());
  ASSERT_GE(all.size(), static_cast<size_t>(top));
  ASSERT_EQ(found.best.size(), static_cast<size_t>(top));
  for (int i = 0; i < top; ++i) {
    EXPECT_EQ(found.best[i].time.step_s, all[i].first) << i;
    EXPECT_EQ(to_string(found.best[i].layout) + " " + found.best[i].policy, all[i].second) << i;
  }
  EXPECT_LT(all.size(), static_cast<size_t>(candidates));  // the budget refused some
}

// Layouts that cannot be run are refused, naming the field.
TEST(Layouts, RefusesLayoutsThatDoNotFitTheModel) {
  const ModelConfig c = mixed_model();  // 8 heads, 4 layers
  const Device d = parse_device("h100-80gb");
  auto message = [&](Layout l) {
    try {
      validate(l, c, d);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  Layout l;
  l.tp = 3;
  EXPECT_NE(message(l).find("Layout.tp 3"), std::string::npos);
  l = {};
  l.pp = 3;
  EXPECT_NE(message(l).find("Layout.pp 3"), std::string::npos);
  l = {};
  l.tp = 16;
  EXPECT_NE(message(l).find("spans nodes"), std::string::npos);
  l = {};
  l.dp = 2, l.global_batch = 3;
  EXPECT_NE(message(l).find("Layout.global_batch 3"), std::string::npos);
  l = {};
  l.pp = 2, l.zero = 2, l.dp = 2;
  EXPECT_NE(message(l).find("Layout.zero 2"), std::string::npos);
  l = {};
  l.pp = 2, l.vpp = 2, l.global_batch = 3;
  EXPECT_NE(message(l).find("vpp"), std::string::npos);
  l = {};
  l.dp = 4, l.optimizer_instances = 2;  // instances of the distributed optimizer: zero 1 only
  EXPECT_NE(message(l).find("Layout.zero must be 1"), std::string::npos);
  l.zero = 1, l.optimizer_instances = 3;
  EXPECT_NE(message(l).find("Layout.optimizer_instances 3 must divide"), std::string::npos);
  l.optimizer_instances = 0;
  EXPECT_NE(message(l).find("Layout.optimizer_instances must be a positive integer"), std::string::npos);
  l.optimizer_instances = 2;
  EXPECT_EQ(message(l), "");
  EXPECT_EQ(message(Layout{}), "");
}

// An uneven pipeline: the first and last stages as given, the middle ones sharing the rest.
TEST(Pipeline, UnevenStagesHoldTheLayersGiven) {
  Layout l;
  l.pp = 4, l.first_layers = 1, l.last_layers = 3;
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 1}, {1, 4}, {4, 7}, {7, 10}};
  for (int64_t s = 0; s < 4; ++s) {
    const std::vector<LayerRange> c = stage_layers(10, l, s);
    ASSERT_EQ(c.size(), 1u);
    EXPECT_EQ(c[0].first, want[s].first) << s;
    EXPECT_EQ(c[0].end, want[s].second) << s;
  }
  ModelConfig c = mixed_model();
  c.layers = 10;
  const Device d = parse_device("h100-80gb");
  EXPECT_NO_THROW(validate(l, c, d));
  l.first_layers = 2;  // leaves 5 for 2 middle stages
  EXPECT_THROW(validate(l, c, d), Error);
  l.first_layers = 1, l.vpp = 2;
  EXPECT_THROW(validate(l, c, d), Error);
}

// Stages that do not divide the layers are searched too: the middle ones at ceil(layers / pp), the
// first and last sharing the rest (10 layers over 4 stages: 2 | 3 | 3 | 2).
TEST(Layouts, SearchSplitsLayersThePipelineDoesNotDivide) {
  ModelConfig c = mixed_model();
  c.layers = 10;
  SearchSpace space;
  space.gpus = 4, space.pp = 4, space.global_batch = 8;
  space.policies = {"full"};
  const SearchResult found = search_layouts(c, space, parse_device("h100-80gb"), 1);
  ASSERT_EQ(found.best.size(), 1u);
  const LayoutPlan& p = found.best[0];
  EXPECT_EQ(p.layout.first_layers, 2);
  EXPECT_EQ(p.layout.last_layers, 2);
  ASSERT_EQ(p.ranks.size(), 4u);
  EXPECT_EQ(p.ranks[1].chunks[0].first, 2);
  EXPECT_EQ(p.ranks[1].chunks[0].end, 5);
}

// uniform:N is searched on the layouts whose memory the model replays for it (one pipeline stage,
// whole weights), costs one more forward of every layer than none, and is refused with a reason
// where no such layout is left.
TEST(Layouts, UniformSegmentsArePlannedOnOneStageWithWholeWeights) {
  ModelConfig c = mixed_model();
  c.layers = 8;
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16;
  space.policies = {"uniform:2"};
  const Device d = parse_device("h100-80gb");
  const SearchResult found = search_layouts(c, space, d, 50);
  ASSERT_FALSE(found.best.empty());
  for (const LayoutPlan& p : found.best) {
    EXPECT_EQ(p.layout.pp, 1) << to_string(p.layout);
    EXPECT_LT(p.layout.zero, 3) << to_string(p.layout);
  }
  const Layout& l = found.best[0].layout;
  const LayoutPlan none = plan_layout(c, l, d, "none"), full = plan_layout(c, l, d, "full");
  EXPECT_GT(found.best[0].time.step_s, full.time.step_s);  // full reruns less than the whole forward
  EXPECT_LT(found.best[0].peak(), none.peak());
  space.pp = 2;
  try {
    search_layouts(c, space, d, 50);
    FAIL() << "uniform:2 on two pipeline stages was planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("policy 'uniform:2' runs uniform:N segments"), std::string::npos) << e.what();
  }
}

// uniform:N keeps every tensor of a layer, as none does, and only its segments differ: a search
// over both must not take none's replayed peak for uniform:2's. Under a budget between the two,
// it finds uniform:2 at its own peak.
TEST(Layouts, SearchTellsUniformSegmentsFromNone) {
  ModelConfig c = mixed_model();
  c.layers = 8;
  SearchSpace space;
  space.gpus = 1, space.global_batch = 4, space.tp = 1, space.pp = 1, space.micro_batch = 1, space.zero = {0};
  space.policies = {"none", "uniform:2"};
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.micro_batch = 1, l.global_batch = 4;
  const int64_t none = plan_layout(c, l, d, "none").peak(), uniform = plan_layout(c, l, d, "uniform:2").peak();
  ASSERT_LT(uniform, none);
  PlanOptions o;
  o.budget = static_cast<int64_t>(static_cast<double>(none + uniform) / 2 * (1 + kAllocatedUncertainty));
  const SearchResult found = search_layouts(c, space, d, 5, o);
  ASSERT_EQ(found.best.size(), 1u);
  EXPECT_EQ(found.best[0].policy, "uniform:2");
  EXPECT_EQ(found.best[0].peak(), uniform);
}

// A deep model's uniform:2 keeps less than full (half the layers' inputs, against all of them):
// where only it fits, the search finds it rather than giving up because full does not fit.
TEST(Layouts, UniformFitsWhereFullDoesNot) {
  ModelConfig c = mixed_model();
  c.layers = 48, c.seq = 4096, c.attention = AttentionImpl::Flash, c.attn_block = 128;  // activations dominate
  SearchSpace space;
  space.gpus = 8, space.global_batch = 8, space.tp = 1, space.pp = 1, space.micro_batch = 1, space.zero = {1};
  space.policies = {"full", "uniform:2"};
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.dp = 8, l.zero = 1, l.micro_batch = 1, l.global_batch = 8;
  const int64_t full = plan_layout(c, l, d, "full").peak(), uniform = plan_layout(c, l, d, "uniform:2").peak();
  ASSERT_LT(uniform, full);
  PlanOptions o;  // between the two, with the plan's margin on top
  o.budget = static_cast<int64_t>(static_cast<double>(full + uniform) / 2 * (1 + kAllocatedUncertainty));
  const SearchResult found = search_layouts(c, space, d, 5, o);
  ASSERT_EQ(found.best.size(), 1u);
  EXPECT_EQ(found.best[0].policy, "uniform:2");
}

// Megatron's fixed allocations, by hand: PyTorch's cuBLAS workspaces (8 x 4 MiB on Hopper, 2 x 4 MiB
// + 8 x 16 KiB before; two, the forward thread's and autograd's), Transformer Engine's (32 MiB on
// Hopper, 4 MiB before), and the micro-batch: tokens and positions on the first stage, labels and
// the loss mask on the last, the bool mask on both.
TEST(Frameworks, MegatronFixedAllocationsByHand) {
  ModelConfig c = mixed_model();
  c.seq = 128;
  Layout l;
  l.pp = 2, l.micro_batch = 2, l.global_batch = 4;
  const int64_t MiB = int64_t{1} << 20, tokens = 2 * 128, mask = 2 * 128 * 128;
  auto bytes = [&](const char* device, int stage, const PlanOptions& o) {
    std::vector<int64_t> out;
    for (const Allocation& a : fixed_allocations(o, parse_device(device), c, l, stage)) out.push_back(a.bytes);
    return out;
  };
  EXPECT_EQ(bytes("h100-80gb", 0, {}), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, 16 * tokens + mask}));
  EXPECT_EQ(bytes("h100-80gb", 1, {}), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, 12 * tokens + mask}));
  EXPECT_EQ(bytes("a100-80gb", 0, {}), (std::vector<int64_t>{2 * (8 * MiB + 128 * 1024), 4 * MiB, 16 * tokens + mask}));
  PlanOptions o;
  o.batch_mask = false, o.cublas_workspace = 1 * MiB;
  EXPECT_EQ(bytes("h100-80gb", 0, o), (std::vector<int64_t>{2 * MiB, 32 * MiB, 16 * tokens}));
  o.framework = Framework::Torchtitan;
  EXPECT_EQ(bytes("h100-80gb", 1, o), (std::vector<int64_t>{2 * MiB, 8 * tokens}));
}

// A framework's batch is its "micro-batch" allocation: the step's data is not counted beside it
// (the input ids and labels are the same tensors), under Megatron and torchtitan alike.
TEST(Frameworks, TheBatchIsCountedOnce) {
  const ModelConfig c = mixed_model();
  Layout l;
  l.pp = 2, l.micro_batch = 2, l.global_batch = 4;
  for (Framework f : {Framework::Megatron, Framework::Torchtitan}) {
    PlanOptions o;
    o.framework = f;
    const LayoutPlan p = plan_layout(c, l, parse_device("h100-80gb"), "full", o);
    for (const RankPlan& r : p.ranks) {
      EXPECT_EQ(r.memory.data, 0) << r.stage;
      EXPECT_TRUE(
          std::any_of(r.fixed.begin(), r.fixed.end(), [](const Allocation& a) { return a.name == "micro-batch"; }));
    }
  }
}

// A mixture of experts under Megatron adds Transformer Engine's grouped-GEMM workspaces (4 streams
// x (32 MiB + 1 KiB) on Hopper; none with one GEMM per expert) and, under expert parallelism, the
// allgather dispatcher's kept buffer: the group's tokens, etp x ep x micro-batch x seq / tp (with
// sp) rows of dim, bf16 (none with the alltoall dispatcher).
TEST(Frameworks, MegatronMixtureOfExpertsAllocationsByHand) {
  ModelConfig c;
  c.arch = "moe", c.layers = 2, c.dim = 64, c.heads = 4, c.seq = 128, c.dtype = DType::BF16;
  Layout l;
  l.micro_batch = 2, l.global_batch = 4, l.dp = 2, l.ep = 2;
  const int64_t MiB = int64_t{1} << 20, tokens = 2 * 128, mask = 2 * 128 * 128;
  auto bytes = [&](const PlanOptions& o) {
    std::vector<int64_t> out;
    for (const Allocation& a : fixed_allocations(o, parse_device("h100-80gb"), c, l, 0)) out.push_back(a.bytes);
    return out;
  };
  const int64_t gathered = 2 * tokens * 64 * 2, batch = 16 * tokens + 12 * tokens + mask;
  EXPECT_EQ(bytes({}), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, 4 * (32 * MiB + 1024), gathered, batch}));
  PlanOptions o;
  o.grouped_gemm = false;
  EXPECT_EQ(bytes(o), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, gathered, batch}));
  o.allgather_dispatch = false;  // alltoall: nothing kept between layers
  EXPECT_EQ(bytes(o), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, batch}));
  o.allgather_dispatch = true;
  l.ep = 1;
  EXPECT_EQ(bytes(o), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, batch}));
  // tp 2 + sp: each rank's half of the tokens, gathered from the etp x ep ranks of the
  // expert-tensor- and expert-parallel group.
  l.tp = 2, l.sp = true, l.etp = 1, l.ep = 2;
  EXPECT_EQ(bytes(o), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, tokens / 2 * 2 * 64 * 2, batch}));
  l.etp = 2, l.ep = 1;
  EXPECT_EQ(bytes(o), (std::vector<int64_t>{2 * 32 * MiB, 32 * MiB, tokens / 2 * 2 * 64 * 2, batch}));
}

// Megatron-LM's expert grid regroups a stage's tp x cp x dp ranks as etp x ep x edp: on tp 2 and
// dp 4, ep 2 with etp 2 leaves edp 2, and so does ep 4 with etp 1; etp must divide tp, and ep the
// ranks over etp.
TEST(Layouts, TheExpertGridRegroupsTheStagesRanks) {
  ModelConfig c;
  c.arch = "moe", c.layers = 2, c.dim = 64, c.heads = 4, c.seq = 128, c.dtype = DType::BF16;
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.tp = 2, l.sp = true, l.dp = 4, l.micro_batch = 1, l.global_batch = 4, l.ep = 2, l.etp = 2;
  EXPECT_EQ(l.expert_shards(), 2);
  EXPECT_NO_THROW(validate(l, c, d));
  l.ep = 4, l.etp = 1;
  EXPECT_EQ(l.expert_shards(), 2);
  EXPECT_NO_THROW(validate(l, c, d));
  l.ep = 4, l.etp = 2;  // the 8 ranks over etp 2 hold ep 4, edp 1
  EXPECT_EQ(l.expert_shards(), 1);
  EXPECT_NO_THROW(validate(l, c, d));
  l.ep = 8;
  EXPECT_THROW(validate(l, c, d), Error);
  l.dp = 2, l.global_batch = 2, l.ep = 4, l.etp = 1;  // ep over the tensor-parallel ranks too
  EXPECT_NO_THROW(validate(l, c, d));
  l.etp = 2;  // the 4 ranks over etp 2 cannot hold ep 4
  try {
    validate(l, c, d);
    ADD_FAILURE() << "ep 4 over 4 / 2 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks over etp"), std::string::npos) << e.what();
  }
}

// torchtitan's Llama keeps its RoPE table, freqs_cis, as a buffer: complex64 (8 bytes) for each of
// seq positions and head_dim / 2 pairs, on every stage; a model without rotary embeddings has none.
TEST(Frameworks, TorchtitanRopeTableByHand) {
  ModelConfig c;
  c.arch = "llama", c.layers = 2, c.dim = 64, c.heads = 4, c.seq = 128, c.dtype = DType::BF16;
  Layout l;
  l.micro_batch = 2, l.global_batch = 2;
  PlanOptions o;
  o.framework = Framework::Torchtitan;
  const std::vector<Allocation> fixed = fixed_allocations(o, parse_device("h100-80gb"), c, l, 0);
  ASSERT_EQ(fixed.size(), 3u);
  EXPECT_EQ(fixed[2].name, "RoPE table");
  EXPECT_EQ(fixed[2].bytes, 128 * (c.dim / c.heads / 2) * 8);
  c.positions = Positions::Learned;
  EXPECT_EQ(fixed_allocations(o, parse_device("h100-80gb"), c, l, 0).size(), 2u);
}

// Outside the allocator: the CUDA context, one NCCL ring per communicator with more than one rank
// (24 channels of a 10 MiB receiving and a 2 MiB sending connection), and the pipeline's
// neighbours (32 such channels each inside a node, 2 across nodes); the data-parallel group spans
// dp x cp.
TEST(Frameworks, OutsideTheAllocatorCountsEachCommunicator) {
  const Device d = parse_device("h100-80gb");  // 8 per node
  const int64_t MiB = int64_t{1} << 20, ring = 24 * 12 * MiB, node = 32 * 12 * MiB, net = 2 * 12 * MiB;
  auto total = [&](const Layout& l) {
    int64_t sum = 0;
    for (const Allocation& a : outside_allocator({}, d, ModelConfig{}, l)) sum += a.bytes;
    return sum;
  };
  Layout l;
  const int64_t context = total(l);  // one GPU: the context alone
  l.tp = 2;
  EXPECT_EQ(total(l), context + ring);
  l.dp = 2, l.pp = 2;  // 8 GPUs: one node; two stages, one neighbour
  EXPECT_EQ(total(l), context + 2 * ring + node);
  l.dp = 1, l.cp = 2;  // its own ring, and the dp x cp group's
  EXPECT_EQ(total(l), context + 3 * ring + node);
  l.dp = 2;  // 16 GPUs: the other stage in another node
  EXPECT_EQ(total(l), context + 3 * ring + net);
  EXPECT_TRUE(outside_allocator({}, parse_device("cpu"), ModelConfig{}, l).empty());
  l = {};
  l.dp = 4, l.zero = 1;
  const int64_t one_instance = total(l);
  l.optimizer_instances = 2;  // the ring within an instance, and the one across the instances
  EXPECT_EQ(total(l), one_instance + 2 * ring);
  l.optimizer_instances = 4;  // an instance of one rank reduces nothing within it
  EXPECT_EQ(total(l), one_instance + ring);
}

// A word embedding tied to the head across pipeline stages has its own communicator (Megatron-LM's
// embedding group): a ring more for gpt2 under pp 2, none for llama's untied head or one stage.
TEST(Frameworks, ATiedEmbeddingAcrossStagesHasItsOwnRing) {
  const Device d = parse_device("h100-80gb");
  auto has_group = [&](const char* arch, int64_t pp) {
    ModelConfig c;
    c.arch = arch;
    Layout l;
    l.pp = pp;
    for (const Allocation& a : outside_allocator({}, d, c, l))
      if (a.name == "NCCL buffers (tied embedding group)") return a.bytes == nccl_ring_bytes();
    return false;
  };
  EXPECT_TRUE(has_group("gpt2", 2));
  EXPECT_FALSE(has_group("llama", 2));
  EXPECT_FALSE(has_group("gpt2", 1));
}

// A pipeline stage's two neighbours, by how far apart the stages are on 8-GPU nodes: 1 or 3 GPUs
// (the stage 1 holds and both neighbours fit in a node), 4 or 5 (one neighbour in the node, one
// across), 8 (both across).
TEST(Frameworks, PipelineNeighboursInTheNodeOrAcross) {
  const Device d = parse_device("h100-80gb");  // 8 per node
  const int64_t MiB = int64_t{1} << 20, node = 32 * 12 * MiB, net = 2 * 12 * MiB;
  auto neighbours = [&](int64_t tp) {
    Layout l;
    l.tp = tp, l.pp = 16;
    for (const Allocation& a : outside_allocator({}, d, ModelConfig{}, l))
      if (a.name == "NCCL buffers (pipeline neighbours)") return a.bytes;
    return int64_t{0};
  };
  EXPECT_EQ(neighbours(1), 2 * node);
  EXPECT_EQ(neighbours(3), 2 * node);  // GPUs 0, 3 and 6
  EXPECT_EQ(neighbours(4), node + net);
  EXPECT_EQ(neighbours(5), node + net);  // GPUs 0 and 5, then 10
  EXPECT_EQ(neighbours(8), 2 * net);
}

// A mixture of experts' communicators, by token dispatcher, on tp 2 and dp 4 (tp and dp rings
// first): the etp x ep gather ring, the alltoall dispatcher's all-to-all (a peer per other ep
// rank) and expert-tensor-parallel ring, and the expert-data-parallel ring when the experts are
// sharded unlike the dense parameters (ep > 1 or etp other than tp).
TEST(Frameworks, OutsideTheAllocatorCountsTheExpertsCommunicators) {
  const Device d = parse_device("h100-80gb");
  const int64_t MiB = int64_t{1} << 20, ring = 24 * 12 * MiB, peer = 32 * 12 * MiB;  // 8 GPUs: one node
  ModelConfig c;
  c.arch = "moe";
  PlanOptions allgather, alltoall;
  alltoall.allgather_dispatch = false;
  auto total = [&](const PlanOptions& o, const Layout& l) {
    int64_t sum = 0;
    for (const Allocation& a : outside_allocator(o, d, c, l)) sum += a.bytes;
    return sum;
  };
  const int64_t context = total(allgather, Layout{});  // one GPU: the context alone
  Layout l;
  l.tp = 2, l.dp = 4, l.ep = 2, l.etp = 2;  // edp 2
  const int64_t base = context + 2 * ring;
  EXPECT_EQ(total(allgather, l), base + ring + ring);
  EXPECT_EQ(total(alltoall, l), base + ring + peer + ring + ring);
  l.ep = 1;  // the experts sharded as the dense parameters: no ring of their own
  EXPECT_EQ(total(allgather, l), base + ring);
  EXPECT_EQ(total(alltoall, l), base + ring + ring);
  l.etp = 1;  // whole experts on each tensor-parallel rank: reduced over all 8 ranks
  EXPECT_EQ(total(allgather, l), base + ring);
  EXPECT_EQ(total(alltoall, l), base + ring);
  c.arch = "llama";  // a dense model: none of them
  EXPECT_EQ(total(alltoall, l), base);
  c.arch = "moe";  // ep 16 on 8-GPU nodes: 7 of the 15 peers in the node, 8 across
  l.tp = 1, l.dp = 16, l.ep = 16, l.etp = 1;
  EXPECT_EQ(total(alltoall, l) - total(allgather, l), 7 * peer + 8 * 2 * 12 * MiB);
}

// A plan fits when its peak with the margin is within the budget, and the budget is the device less
// what lies outside the allocator.
TEST(Layouts, FitsKeepsTheMarginFree) {
  ModelConfig c = mixed_model();
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.tp = 2;
  const LayoutPlan p = plan_layout(c, l, d, "none");
  int64_t outside = 0;
  for (const Allocation& a : outside_allocator({}, d, c, l)) outside += a.bytes;
  EXPECT_EQ(p.budget, d.memory - outside);
  EXPECT_EQ(p.margin, kAllocatedUncertainty);
  PlanOptions o;
  o.budget = static_cast<int64_t>(static_cast<double>(p.peak()) * (1 + kAllocatedUncertainty)) + 1;
  EXPECT_TRUE(plan_layout(c, l, d, "none", o).fits);
  o.budget = p.peak();  // the peak itself, but not its margin
  EXPECT_FALSE(plan_layout(c, l, d, "none", o).fits);
  o.margin = 0;
  EXPECT_TRUE(plan_layout(c, l, d, "none", o).fits);
}

TEST(Devices, PresetsCustomAndRefusals) {
  const Device h = parse_device("h100-80gb");
  EXPECT_EQ(h.memory, int64_t{81559} << 20);
  EXPECT_EQ(h.bf16_tflops, 989);
  const Device c = parse_device("custom:96GiB,700,3000,400,50,4");
  EXPECT_EQ(c.memory, int64_t{96} << 30);
  EXPECT_EQ(c.gpus_per_node, 4);
  EXPECT_THROW(parse_device("custom:96GiB,700"), Error);
  EXPECT_THROW(parse_device("custom:lots,700,3000"), Error);
  EXPECT_THROW(parse_device("custom:96GiB,-1,3000"), Error);
  EXPECT_THROW(parse_device("/nonexistent/device.json"), Error);
}

}  // namespace
}  // namespace remat

namespace remat {
namespace {

ModelConfig small_moe() {
  ModelConfig c;
  c.arch = "moe", c.layers = 4, c.dim = 256, c.heads = 4, c.seq = 256, c.vocab = 1024, c.ffn = 512;
  c.experts = 8, c.top_k = 2, c.dtype = DType::BF16, c.batch = 1;
  return c;
}

// Expert parallelism: each rank holds experts / ep of the experts, whose optimizer state is sharded
// over dp / ep ranks only, and the dispatched rows cross the group in all-to-alls.
TEST(Layouts, ExpertParallelismSplitsTheExpertsAndTimesTheirExchange) {
  const ModelConfig c = small_moe();
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.dp = 4, l.zero = 1, l.micro_batch = 2, l.global_batch = 8;
  const LayoutPlan one = plan_layout(c, l, d, "none");
  l.ep = 4;
  const LayoutPlan four = plan_layout(c, l, d, "none");
  const BlockSpec b = make_block(c);
  int64_t expert = 0;
  for (const ParamSpec& p : b.params) expert += p.expert ? p.numel() : 0;
  const int64_t wbytes = 2;
  // Weights: a quarter of the experts on each rank.
  EXPECT_EQ(one.rank().memory.params - four.rank().memory.params, c.layers * expert * 3 / 4 * wbytes);
  // Optimizer (fp32 master, m, v): the experts' sharded over dp / ep = 1 rank instead of 4 — the
  // same bytes per rank, since a quarter of the experts is held by a quarter as many ranks.
  EXPECT_NEAR(static_cast<double>(four.rank().memory.optimizer), static_cast<double>(one.rank().memory.optimizer),
              16.0 * static_cast<double>(make_model(c).param_numel()) / 4 / 100);
  EXPECT_EQ(one.time.tp_comm_s, 0.0);
  EXPECT_GT(four.time.tp_comm_s, 0.0);
  // The search finds layouts with experts split, and a dense model gets none.
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16, space.policies = {"none"};
  bool split = false;
  for (const LayoutPlan& p : search_layouts(c, space, d, 50).best) split = split || p.layout.ep > 1;
  EXPECT_TRUE(split);
  ModelConfig dense = c;
  dense.arch = "llama";
  for (const LayoutPlan& p : search_layouts(dense, space, d, 50).best) EXPECT_EQ(p.layout.ep, 1);
}

// Data parallelism's gradient traffic: each rank's ring moves (n - 1) / n of what it reduces, the
// dense gradients over the dp ranks and the experts' over the expert-data-parallel ones (dp / ep);
// with ep = dp each expert lives on one rank and its gradients are not reduced at all.
TEST(Layouts, ExpertGradientsAreReducedOverTheirOwnRanks) {
  const ModelConfig c = small_moe();
  const Device d = parse_device("h100-80gb");
  const double rate = d.intra_gbps * d.link_efficiency * 1e9;  // 4 ranks inside one node
  Layout l;
  l.dp = 4, l.micro_batch = 2, l.global_batch = 8;
  for (const int64_t ep : {1, 2, 4}) {
    l.ep = ep;
    const LayoutPlan p = plan_layout(c, l, d, "none");
    const StepMemory& m = p.rank().memory;
    ASSERT_GT(m.expert_params, 0);
    const double dense = static_cast<double>(m.params - m.expert_params) / 2, experts = m.expert_params / 2.0;
    const double edp = 4.0 / static_cast<double>(ep);
    const double moved = 0.75 * dense + (edp - 1) / edp * experts;  // elements, bf16 weights
    EXPECT_NEAR(p.time.dp_comm_s, 2 * moved * l.grad_bytes / rate, 1e-12) << "ep " << ep;
  }
}

// Adam's time is the memory model's count of the bytes it moves on the rank, at the device's memory
// rate: under ZeRO-1 a quarter of the step's on 4 ranks, within a shard's rounding.
TEST(Layouts, AdamTakesItsTrafficAtTheMemoryRate) {
  const ModelConfig c = small_moe();
  const Device d = parse_device("h100-80gb");
  const double rate = d.hbm_gbps * d.memory_efficiency * 1e9;
  Layout l;
  l.dp = 4, l.micro_batch = 2, l.global_batch = 8;
  const LayoutPlan whole = plan_layout(c, l, d, "none");
  EXPECT_DOUBLE_EQ(whole.time.optimizer_s, static_cast<double>(whole.rank().memory.optimizer_traffic) / rate);
  l.zero = 1;
  const LayoutPlan sharded = plan_layout(c, l, d, "none");
  EXPECT_DOUBLE_EQ(sharded.time.optimizer_s, static_cast<double>(sharded.rank().memory.optimizer_traffic) / rate);
  EXPECT_NEAR(sharded.time.optimizer_s * 4, whole.time.optimizer_s, whole.time.optimizer_s * 1e-3);
  // bf16 weights and moments, no master copy to count them by, gradients in the layout's fp32
  // buffers: 4 + 2 x (2 + 4) = 16 bytes a parameter against mixed precision's 30.
  PlanOptions pure;
  pure.pure_dtype = true;
  l.zero = 0;
  const LayoutPlan bf16 = plan_layout(c, l, d, "none", pure);
  EXPECT_DOUBLE_EQ(bf16.time.optimizer_s, static_cast<double>(bf16.rank().memory.optimizer_traffic) / rate);
  EXPECT_NEAR(bf16.time.optimizer_s * 30, whole.time.optimizer_s * 16, whole.time.optimizer_s * 1e-3);
}

// torchtitan as modelled (9dec370) has no mixture of experts: the planner refuses one, whatever
// the layout, rather than plan Megatron-LM's expert buffers under torchtitan's name.
TEST(Frameworks, TorchtitanPlansNoMixtureOfExperts) {
  PlanOptions o;
  o.framework = Framework::Torchtitan;
  Layout l;
  l.fsdp = true, l.dp = 2, l.micro_batch = 1, l.global_batch = 2;
  const ModelConfig c = small_moe();
  try {
    plan_layout(c, l, parse_device("h100-80gb"), "none", o);
    ADD_FAILURE() << "torchtitan planned a mixture of experts";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no mixture of experts"), std::string::npos) << e.what();
  }
  o.framework = Framework::Megatron;
  EXPECT_NO_THROW(plan_layout(c, l, parse_device("h100-80gb"), "none", o));
}

// A tied word embedding's gradient crosses from the last stage to the first: over NVLink while the
// whole grid fits in one node, over the network once it does not.
TEST(Layouts, ATiedEmbeddingsAllReduceCrossesNodesOnlyWhenTheStagesDo) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512;
  const Device d = parse_device("h100-80gb");  // 8 per node
  auto tied_s = [&](int64_t dp) {
    Layout l;
    l.pp = 2, l.dp = dp, l.micro_batch = 1, l.global_batch = 4 * dp;
    ModelConfig tied = c, untied = c;
    tied.tied = Switch::On, untied.tied = Switch::Off;
    return plan_layout(tied, l, d, "none").time.p2p_s - plan_layout(untied, l, d, "none").time.p2p_s;
  };
  const double bytes = static_cast<double>(c.vocab * c.dim * 4);                    // fp32 gradient buffers
  EXPECT_NEAR(tied_s(4), bytes / (d.intra_gbps * d.link_efficiency * 1e9), 1e-12);  // 8 ranks: one node
  EXPECT_NEAR(tied_s(8), bytes / (d.inter_gbps * d.link_efficiency * 1e9), 1e-12);  // 16 ranks: two
}

// A search tries the ZeRO stages that measured runs check (0 and 1) unless told otherwise.
TEST(Layouts, ASearchTriesZeroStagesTwoAndThreeOnlyWhenAsked) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512;
  const Device d = parse_device("a100-80gb");
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16, space.policies = {"none"}, space.tp = 1, space.pp = 1;
  auto stages = [&] {
    std::set<int> seen;
    for (const LayoutPlan& p : search_layouts(c, space, d, 100).best) seen.insert(p.layout.zero);
    return seen;
  };
  EXPECT_EQ(stages(), (std::set<int>{0, 1}));
  space.zero_fixed = 3;
  EXPECT_EQ(stages(), (std::set<int>{3}));
  space.zero_fixed = -1, space.zero = {0, 1, 2, 3};
  EXPECT_EQ(stages(), (std::set<int>{0, 1, 2, 3}));
}

// torchtitan's tensor parallelism is always sequence-parallel: with sp_with_tp no layout has tp
// above 1 without sp, and some have tp above 1.
TEST(Layouts, ASearchKeepsSequenceParallelismWithTensorParallelismWhenAsked) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512;
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16, space.policies = {"none"}, space.pp = 1, space.sp_with_tp = true;
  bool split = false;
  for (const LayoutPlan& p : search_layouts(c, space, parse_device("a100-80gb"), 100).best) {
    EXPECT_TRUE(p.layout.tp == 1 || p.layout.sp) << to_string(p.layout);
    split = split || p.layout.tp > 1;
  }
  EXPECT_TRUE(split);
}

// ZeRO-3 gathers the weights and reduce-scatters the gradients every micro-batch, as the memory
// model replays it: 8 times the micro-batches, 8 times the traffic; ZeRO-1 moves them once a step.
TEST(Layouts, ZeroThreeMovesTheWeightsEveryMicroBatch) {
  const ModelConfig c = mixed_model();
  const Device d = parse_device("h100-80gb");
  auto comm = [&](int zero, int64_t global_batch) {
    Layout l;
    l.dp = 8, l.zero = zero, l.micro_batch = 1, l.global_batch = global_batch;
    return plan_layout(c, l, d, "full").time.dp_comm_s;
  };
  EXPECT_NEAR(comm(3, 64) / comm(3, 8), 8.0, 1e-9);
  EXPECT_EQ(comm(1, 64), comm(1, 8));
  EXPECT_GT(comm(2, 64), comm(2, 8));  // the gradients every micro-batch, the weights once
}

// A context-parallel ring's sends run beside the attention they feed: at 16384 tokens on NVLink
// they hide behind it, on a 1 GB/s link they outlast it and the step shows the rest.
TEST(Layouts, AContextParallelRingShowsWhereItOutlastsTheAttention) {
  ModelConfig c = mixed_model();
  c.attention = AttentionImpl::Flash, c.seq = 16384, c.attn_block = 16384;
  auto comm = [&](const char* device, int64_t cp) {
    Layout l;
    l.cp = cp, l.micro_batch = 1, l.global_batch = 1;
    return plan_layout(c, l, parse_device(device), "none").time.tp_comm_s;
  };
  EXPECT_EQ(comm("custom:80GiB,989,3350,1,1,8", 1), 0.0);
  EXPECT_GT(comm("custom:80GiB,989,3350,1,1,8", 2), 0.0);
  EXPECT_EQ(comm("h100-80gb", 2), 0.0);
}

// A value the caller fixed that no layout can take is what a search that finds none names (not a
// refusal of some value it searched).
TEST(Layouts, ASearchNamesTheFixedValueNoLayoutTakes) {
  const ModelConfig c = mixed_model();  // 8 heads, 4 layers
  auto refusal = [&](void (*set)(SearchSpace&)) {
    SearchSpace space;
    space.gpus = 8, space.global_batch = 16, space.policies = {"none"};
    set(space);
    const SearchResult r = search_layouts(c, space, parse_device("h100-80gb"), 1);
    EXPECT_EQ(r.candidates, 0);
    return r.refused;
  };
  EXPECT_EQ(refusal([](SearchSpace& s) { s.tp = 3; }), "tp 3 does not divide the 8 heads");
  EXPECT_EQ(refusal([](SearchSpace& s) { s.tp = 1, s.sp_fixed = 1; }),
            "sp with tp 1: sequence parallelism splits the tensor-parallel ranks' tokens");
  EXPECT_EQ(refusal([](SearchSpace& s) { s.pp = 8; }), "pp 8 is more than the 4 layers");
  EXPECT_EQ(refusal([](SearchSpace& s) { s.dp = 3; }), "8 GPUs do not split into the tp x cp x pp x dp given, 3");
  EXPECT_EQ(refusal([](SearchSpace& s) { s.tp = 2, s.pp = 2, s.dp = 1; }),
            "tp 2 x cp 1 x pp 2 x dp 1 is 4 GPUs, not 8");
}

// ZeRO shards over the dp x cp ranks: with dp 1 and cp 2 a search still tries it.
TEST(Layouts, ASearchTriesZeroOverContextParallelRanks) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512, c.attention = AttentionImpl::Flash;
  SearchSpace space;
  space.gpus = 2, space.global_batch = 4, space.policies = {"none"}, space.tp = 1, space.pp = 1, space.cp = 2;
  std::set<int> seen;
  for (const LayoutPlan& p : search_layouts(c, space, parse_device("a100-80gb"), 100).best) {
    EXPECT_EQ(p.layout.dp, 1);
    seen.insert(p.layout.zero);
  }
  EXPECT_EQ(seen, (std::set<int>{0, 1}));
}

// Optimizer instances make a search try ZeRO-1 alone, over dp x cp ranks (dp 1 with cp 2 too), and
// a count that divides no layout's ranks is named; a space that cannot try ZeRO-1 is refused.
TEST(Layouts, ASearchWithOptimizerInstancesTriesZeroOneOverTheirRanks) {
  ModelConfig c = mixed_model();
  c.layers = 8, c.seq = 512, c.attention = AttentionImpl::Flash;
  const Device d = parse_device("a100-80gb");
  SearchSpace space;
  space.gpus = 8, space.global_batch = 16, space.policies = {"none"}, space.tp = 1, space.pp = 1;
  space.optimizer_instances = 2;
  const SearchResult r = search_layouts(c, space, d, 100);
  ASSERT_FALSE(r.best.empty());
  for (const LayoutPlan& p : r.best) {
    EXPECT_EQ(p.layout.zero, 1);
    EXPECT_EQ(p.layout.optimizer_instances, 2);
  }
  space.gpus = 2, space.global_batch = 2, space.cp = 2;  // dp 1 x cp 2: one instance per rank
  EXPECT_FALSE(search_layouts(c, space, d, 100).best.empty());
  space.cp = 1, space.optimizer_instances = 4;  // dp 2
  const SearchResult none = search_layouts(c, space, d, 100);
  EXPECT_EQ(none.candidates, 0);
  EXPECT_NE(none.refused.find("optimizer_instances 4 must divide"), std::string::npos) << none.refused;
  space.optimizer_instances = 2, space.zero_fixed = 0;
  EXPECT_THROW(search_layouts(c, space, d, 100), Error);
  space.zero_fixed = -1, space.zero = {0};
  EXPECT_THROW(search_layouts(c, space, d, 100), Error);
}

// A mixture of experts' instances shard the experts' optimizer state over the expert-data-parallel
// ranks of one instance: dp 4 with ep 2 leaves 2 such ranks, 1 in each of 2 instances, whose count
// must divide them.
TEST(Layouts, OptimizerInstancesShardTheExpertsWithinAnInstance) {
  const ModelConfig c = small_moe();
  const Device d = parse_device("h100-80gb");
  Layout l;
  l.dp = 4, l.ep = 2, l.zero = 1, l.micro_batch = 2, l.global_batch = 8;
  auto optimizer = [&](int64_t instances) {
    l.optimizer_instances = instances;
    const StepMemory m = plan_layout(c, l, d, "none").rank().memory;
    const double dense = static_cast<double>(m.params - m.expert_params) / 2, experts = m.expert_params / 2.0;
    return std::pair<double, double>{
        static_cast<double>(m.optimizer),
        12 * (dense / (4.0 / static_cast<double>(instances)) + experts / (2.0 / static_cast<double>(instances)))};
  };
  for (int64_t n : {1, 2}) {
    const auto [bytes, expected] = optimizer(n);
    EXPECT_NEAR(bytes, expected, 24) << n << " instances";  // a shard rounds to whole parameters
  }
  l.dp = 2, l.optimizer_instances = 2;  // 1 expert-data-parallel rank
  EXPECT_THROW(plan_layout(c, l, d, "none"), Error);
}

// FSDP2's first all-gather, which no compute hides, is the root unit's (embeddings, final norm,
// head): the same for 4 blocks or 8, and larger for a larger vocabulary.
TEST(Layouts, FsdpFirstGatherIsTheRootUnits) {
  const Device d = parse_device("h100-80gb");
  auto first_gather_s = [&](int64_t layers, int64_t vocab) {
    ModelConfig c = mixed_model();
    c.arch = "llama", c.layers = layers, c.vocab = vocab, c.seq = 512;
    Layout l;
    l.fsdp = true, l.dp = 2, l.micro_batch = 1, l.global_batch = 2;
    const LayoutTime t = plan_layout(c, l, d, "none").time;
    return t.dp_exposed_s - std::max(0.0, t.dp_comm_s - t.compute_s);
  };
  const double base = first_gather_s(4, 1024);
  EXPECT_GT(base, 0.0);
  EXPECT_DOUBLE_EQ(first_gather_s(8, 1024), base);
  EXPECT_GT(first_gather_s(4, 4096), base);
}

// FSDP2 under pipeline stages (torchtitan's unsharded gradients until the last micro-batch,
// Megatron-LM's FSDP2 not running at all) is not modelled: such a layout is refused.
TEST(Frameworks, FsdpUnderPipelineStagesIsRefused) {
  ModelConfig c = small_moe();
  c.arch = "llama";
  Layout l;
  l.fsdp = true, l.dp = 2, l.micro_batch = 1, l.global_batch = 4;
  EXPECT_NO_THROW(validate(l, c, parse_device("h100-80gb")));
  l.pp = 2;
  EXPECT_NE(remat::testing::error_of([&] {
              validate(l, c, parse_device("h100-80gb"));
            }).find("Layout.fsdp with pp 2: FSDP2 under pipeline stages is not modelled"),
            std::string::npos);
}

// Under FSDP2 every weight gradient is autograd's tensor, which FSDP reduce-scatters: Megatron-LM's
// fused weight-gradient buffers (PlanOptions::fused_wgrad) change nothing.
TEST(Frameworks, FsdpKeepsTheWeightGradientsUnderMegatron) {
  ModelConfig c = small_moe();
  c.arch = "llama";
  Layout l;
  l.fsdp = true, l.dp = 2, l.micro_batch = 1, l.global_batch = 2;
  PlanOptions fused, unfused;
  unfused.fused_wgrad = false;
  const Device d = parse_device("h100-80gb");
  EXPECT_EQ(plan_layout(c, l, d, "none", fused).rank().memory.total_peak(),
            plan_layout(c, l, d, "none", unfused).rank().memory.total_peak());
}

// A layout's text names the expert grid of a mixture of experts where it is not Megatron-LM's
// default (ep 1, etp = tp), and never for a dense model (whose etp is 1 whatever tp is).
TEST(Layouts, TheTextNamesTheExpertGrid) {
  Layout l;
  l.tp = 2, l.sp = true, l.dp = 2, l.micro_batch = 1, l.etp = 1;
  EXPECT_EQ(to_string(l, true), "tp 2 + sp, pp 1, dp 2, etp 1, micro-batch 1 x 1");
  EXPECT_EQ(to_string(l), "tp 2 + sp, pp 1, dp 2, micro-batch 1 x 1");
  l.etp = 2, l.ep = 2;
  EXPECT_EQ(to_string(l, true), "tp 2 + sp, pp 1, dp 2, ep 2, micro-batch 1 x 1");
}

}  // namespace
}  // namespace remat
