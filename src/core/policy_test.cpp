#include "remat/policy.h"

#include <gtest/gtest.h>

#include "remat/error.h"
#include "test_util.h"

namespace remat {
namespace {

BlockSpec gpt2(double dropout = 0.1) { return make_block(testing::tiny("gpt2", dropout)); }

BlockSpec seed() { return make_block(testing::tiny("seed")); }

std::vector<std::string> dropped(const std::string& text, const BlockSpec& b = gpt2(), int layer = 0) {
  const ResolvedPolicy r = Policy::parse(text).resolve(b, 6);
  std::vector<std::string> out;
  for (int t : b.choosable())
    if (!r.layers[layer].saves(t)) out.push_back(b.tensors[t].name);
  return out;
}

using testing::error_of;

std::string parse_error(const std::string& text) {
  return error_of([&] { Policy::parse(text); });
}

std::string resolve_error(const std::string& text, const BlockSpec& b = gpt2()) {
  return error_of([&] { Policy::parse(text).resolve(b, 6); });
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using Names = std::vector<std::string>;

// resolve() sizes its answer by `layers`: a default Policy or no layers is refused, not indexed.
TEST(Policy, ResolveRefusesAnEmptyPolicyAndNoLayers) {
  EXPECT_TRUE(contains(error_of([] { Policy().resolve(seed(), 4); }), "holds no policy"));
  EXPECT_TRUE(
      contains(error_of([] { Policy::parse("full").resolve(seed(), 0); }), "policy 'full' resolved for 0 layers"));
  EXPECT_EQ(error_of([] { Policy::parse("full").resolve(seed(), 1); }), "");
}

TEST(Policy, NoneKeepsEverything) { EXPECT_EQ(dropped("none"), Names{}); }

TEST(Policy, FullDropsEveryChoosableTensor) {
  const BlockSpec b = gpt2();
  EXPECT_EQ(dropped("full").size(), b.choosable().size());
}

TEST(Policy, AttnDropsTheTxTTensorsOnly) {
  EXPECT_EQ(dropped("attn"), (Names{"probs", "probs_mask", "probs_drop"}));
  EXPECT_EQ(dropped("attn", gpt2(0.0)), (Names{"probs"}));
}

TEST(Policy, PresetsMatchTheirDescriptions) {
  EXPECT_EQ(dropped("mlp-act"), (Names{"act"}));
  EXPECT_EQ(dropped("norm"), (Names{"ln1", "ln2"}));
  EXPECT_EQ(dropped("mlp"), (Names{"fc", "act", "mlp_mask"}));
}

TEST(Policy, PlusIsTheUnionOfDrops) {
  EXPECT_EQ(dropped("attn+mlp-act"), (Names{"probs", "probs_mask", "probs_drop", "act"}));
}

TEST(Policy, SaveKeepsOnlyTheNamedTensors) {
  const BlockSpec b = gpt2();
  const Names d = dropped("save:ln1,qkv", b);
  EXPECT_EQ(d.size(), b.choosable().size() - 2);
  EXPECT_EQ(std::count(d.begin(), d.end(), "qkv"), 0);
  EXPECT_EQ(std::count(d.begin(), d.end(), "ln1"), 0);
}

TEST(Policy, KeepPinOutranksAPreset) {
  EXPECT_EQ(dropped("attn+keep:probs_mask"), (Names{"probs", "probs_drop"}));
  const ResolvedPolicy r = Policy::parse("attn+keep:probs_mask").resolve(gpt2(), 6);
  const BlockSpec b = gpt2();
  EXPECT_EQ(r.layers[0].tensors[b.find("probs_mask")].strength, Strength::Must);
  EXPECT_EQ(r.layers[0].tensors[b.find("probs")].strength, Strength::Prefer);
}

TEST(Policy, DropPinsARecompute) {
  const BlockSpec b = gpt2();
  const ResolvedPolicy r = Policy::parse("drop:fc").resolve(b, 6);
  EXPECT_EQ(dropped("drop:fc"), (Names{"fc"}));
  EXPECT_EQ(r.layers[0].tensors[b.find("fc")].strength, Strength::Must);
}

TEST(Policy, EveryKKeepsLayersDivisibleByK) {
  const BlockSpec b = gpt2();
  const ResolvedPolicy r = Policy::parse("every:3").resolve(b, 6);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(r.layers[i].keeps_all(b), i % 3 == 0) << i;
  for (int i = 0; i < 6; ++i) EXPECT_EQ(r.layers[i].drops_all(b), i % 3 != 0) << i;
}

TEST(Policy, EveryKTakesAPreset) {
  EXPECT_EQ(dropped("every:2=attn", gpt2(), 0), Names{});
  EXPECT_EQ(dropped("every:2=attn", gpt2(), 1), (Names{"probs", "probs_mask", "probs_drop"}));
}

TEST(Policy, BlockNRecomputesTheFirstNLayers) {
  const BlockSpec b = gpt2();
  const ResolvedPolicy r = Policy::parse("block:2").resolve(b, 6);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(r.layers[i].drops_all(b), i < 2) << i;
}

TEST(Policy, UniformNChunksLayers) {
  const ResolvedPolicy r = Policy::parse("uniform:2").resolve(gpt2(), 6);
  EXPECT_EQ(r.segment, 2);
  EXPECT_TRUE(r.layers[3].keeps_all(gpt2()));
}

TEST(Policy, LayerRangesAssignPresets) {
  const BlockSpec b = gpt2();
  const ResolvedPolicy r = Policy::parse("layers:0-1=attn,3=save:ln1,qkv,4-5=full").resolve(b, 6);
  EXPECT_EQ(dropped("layers:0-1=attn,3=save:ln1,qkv,4-5=full", b, 1), (Names{"probs", "probs_mask", "probs_drop"}));
  EXPECT_TRUE(r.layers[2].keeps_all(b));
  EXPECT_TRUE(r.layers[3].saves(b.find("qkv")));
  EXPECT_FALSE(r.layers[3].saves(b.find("fc")));
  EXPECT_TRUE(r.layers[5].drops_all(b));
}

TEST(Policy, SameChoicesComparesEveryTensorChoice) {
  const BlockSpec b = gpt2();
  const ResolvedPolicy r = Policy::parse("layers:0-2=attn,3-5=mlp-act").resolve(b, 6);
  EXPECT_TRUE(r.layers[0].same_choices(r.layers[2]));
  EXPECT_FALSE(r.layers[0].same_choices(r.layers[3]));
  const ResolvedPolicy other = Policy::parse("attn").resolve(b, 6);
  EXPECT_TRUE(r.layers[1].same_choices(other.layers[5]));  // equal choices, different objects
}

TEST(Policy, SplitsListsWithoutBreakingPolicies) {
  EXPECT_EQ(split_policy_list("none,full,every:2,every:3"), (Names{"none", "full", "every:2", "every:3"}));
  EXPECT_EQ(split_policy_list("none,save:ln1,qkv,layers:0-1=attn,2-5=full,attn+mlp-act"),
            (Names{"none", "save:ln1,qkv", "layers:0-1=attn,2-5=full", "attn+mlp-act"}));
  EXPECT_EQ(split_policy_list("save:ln1,mlp_mask;full"), (Names{"save:ln1,mlp_mask", "full"}));
  EXPECT_EQ(split_policy_list("none,atn"), (Names{"none", "atn"}));  // a typo stays itself
  EXPECT_EQ(split_policy_list("layers:0=keep:qkv,probs,1-2=full,none"),
            (Names{"layers:0=keep:qkv,probs,1-2=full", "none"}));
}

// Errors: one line each, naming the bad token.
TEST(PolicyErrors, EmptyPieceOfAList) {
  EXPECT_TRUE(contains(error_of([] { split_policy_list("none,,full"); }), "empty policy in the list 'none,,full'"));
  EXPECT_TRUE(contains(error_of([] { split_policy_list("none;"); }), "empty policy in the list"));
}
TEST(PolicyErrors, Empty) { EXPECT_TRUE(contains(parse_error(""), "empty policy")); }
TEST(PolicyErrors, UnknownPreset) {
  const std::string e = parse_error("atn");
  EXPECT_TRUE(contains(e, "unknown policy term 'atn'")) << e;
  EXPECT_TRUE(contains(e, "allowed: none, full, attn")) << e;
}
TEST(PolicyErrors, UnknownPrefix) { EXPECT_TRUE(contains(parse_error("ckpt:2"), "'ckpt:2'")); }
TEST(PolicyErrors, EveryZero) {
  EXPECT_TRUE(contains(parse_error("every:0"), "every:K needs a positive integer, got '0'"));
}
TEST(PolicyErrors, EveryNegative) { EXPECT_TRUE(contains(parse_error("every:-2"), "got '-2'")); }
TEST(PolicyErrors, EveryNotANumber) { EXPECT_TRUE(contains(parse_error("every:two"), "got 'two'")); }
TEST(PolicyErrors, BlockZero) { EXPECT_TRUE(contains(parse_error("block:0"), "block:N needs a positive integer")); }
TEST(PolicyErrors, UniformMissingNumber) {
  EXPECT_TRUE(contains(parse_error("uniform:"), "uniform:N needs a positive integer, got ''"));
}
TEST(PolicyErrors, FormWithoutNumber) { EXPECT_TRUE(contains(parse_error("every"), "'every' needs a number")); }
TEST(PolicyErrors, EmptyTerm) { EXPECT_TRUE(contains(parse_error("attn+"), "empty term in 'attn+'")); }
TEST(PolicyErrors, EmptyPresetAfterEquals) { EXPECT_TRUE(contains(parse_error("every:2="), "empty preset")); }
TEST(PolicyErrors, EmptyNameList) { EXPECT_TRUE(contains(parse_error("save:"), "empty tensor name in 'save:'")); }
TEST(PolicyErrors, EmptyNameInList) { EXPECT_TRUE(contains(parse_error("save:ln1,"), "empty tensor name")); }
TEST(PolicyErrors, ReversedRange) { EXPECT_TRUE(contains(parse_error("layers:3-1=full"), "bad layer range '3-1'")); }
TEST(PolicyErrors, RangeWithoutPreset) {
  EXPECT_TRUE(contains(parse_error("layers:0-2"), "bad layer assignment '0-2'"));
}
TEST(PolicyErrors, EmptyLayerList) { EXPECT_TRUE(contains(parse_error("layers:"), "bad layer assignment ''")); }
TEST(PolicyErrors, OverlappingRanges) {
  EXPECT_TRUE(contains(parse_error("layers:0-3=attn,2-5=full"), "layer ranges '0-3=attn' and '2-5=full' overlap"));
}
TEST(PolicyErrors, NestedForms) { EXPECT_TRUE(contains(parse_error("every:2=block:1"), "do not nest")); }
TEST(PolicyErrors, UnknownTensorName) {
  const std::string e = resolve_error("save:ln3");
  EXPECT_TRUE(contains(e, "unknown tensor 'ln3' in 'save:ln3'; a gpt2 block can keep: ln1, ln1_mean")) << e;
}
TEST(PolicyErrors, BlockInputIsNotChoosable) {
  EXPECT_TRUE(contains(resolve_error("drop:x"), "'x' in 'drop:x' is the block input"));
}
TEST(PolicyErrors, TransientTensorIsNotChoosable) {
  EXPECT_TRUE(contains(resolve_error("keep:scores"), "'scores' in 'keep:scores' is never read by a backward"));
}
TEST(PolicyErrors, ConflictingPins) {
  EXPECT_TRUE(contains(resolve_error("keep:qkv+drop:qkv"), "tensor 'qkv' is pinned both to save and to recompute"));
}
TEST(PolicyErrors, RangeBeyondLastLayer) {
  EXPECT_TRUE(contains(resolve_error("layers:4-7=full"), "exceeds the model's 6 layers (0-5)"));
}
TEST(PolicyErrors, BlockBeyondLastLayer) {
  EXPECT_TRUE(contains(resolve_error("block:7"), "block:7 exceeds the model's 6 layers"));
}
TEST(PolicyErrors, PresetWithNothingToDropInThisBlock) {
  EXPECT_TRUE(contains(resolve_error("norm", seed()), "preset 'norm' in 'norm' drops nothing in a seed block"));
}

TEST(Policy, PresetsSelectByTagOnEveryBlockKind) {
  // A preset drops exactly the choosable tensors that carry its tag, whatever they are called.
  const std::pair<const char*, uint32_t> presets[] = {
      {"attn", tag::kAttnCore}, {"mlp-act", tag::kMlpAct}, {"norm", tag::kNormOut}, {"mlp", tag::kMlpInner}};
  for (const std::string& kind : testing::all_kinds()) {
    const BlockSpec b = make_block(testing::tiny(kind, kind == "seed" ? 0.0 : 0.1));
    for (const auto& [preset, bits] : presets) {
      Names want;
      for (int t : b.choosable())
        if (b.tensors[t].tags & bits) want.push_back(b.tensors[t].name);
      if (want.empty()) continue;  // refused, as PresetWithNothingToDropInThisBlock shows
      EXPECT_EQ(dropped(preset, b), want) << kind << " " << preset;
    }
  }
}

TEST(Policy, PinsStandAlone) {
  const BlockSpec b = gpt2();
  const LayerPolicy pins = Policy::parse_pins("keep:qkv+drop:fc,act", b);
  EXPECT_EQ(pins.tensors[b.find("qkv")].strength, Strength::Must);
  EXPECT_TRUE(pins.saves(b.find("qkv")));
  EXPECT_FALSE(pins.saves(b.find("fc")));
  EXPECT_FALSE(pins.saves(b.find("act")));
  EXPECT_TRUE(pins.saves(b.find("ln1")));
  EXPECT_TRUE(contains(error_of([&] { Policy::parse_pins("attn", b); }), "'attn' is not a pin"));
  EXPECT_TRUE(contains(error_of([&] { Policy::parse_pins("keep:ln9", b); }), "unknown tensor 'ln9'"));
}

TEST(Budget, ParsesSizesAndPercentages) {
  EXPECT_EQ(parse_budget("300MiB").bytes, 300LL << 20);
  EXPECT_EQ(parse_budget("2GB").bytes, 2000000000LL);
  EXPECT_EQ(parse_budget("1.5GiB").bytes, 3LL << 29);
  EXPECT_EQ(parse_budget("4096").bytes, 4096);
  EXPECT_EQ(parse_budget("60%").percent, 60.0);
  for (const char* bad : {"", "300XB", "-5MB", "abc", "0GB", "1.2.3GB", "0.1B", "99999999999TiB", "5000%", "1e9"})
    EXPECT_THROW(parse_budget(bad), Error) << bad;
}

// A percentage is a share of none's activations and parameter gradients (Planner::bytes_of), and
// says so wherever it is printed.
TEST(Budget, PercentagesAreLabelledAsWhatTheyMeasure) {
  EXPECT_EQ(to_string(parse_budget("60%")),
            "60% of none's activations and gradients (above weights, optimizer and data)");
  EXPECT_EQ(to_string(parse_budget("300MiB")), "300.0 MiB");
}

TEST(Budget, IsParsedWithThePolicy) {
  EXPECT_EQ(Policy::parse("budget:300MiB+keep:qkv").budget().bytes, 300LL << 20);
  EXPECT_TRUE(Policy::parse("budget:60%").is_budget());
  EXPECT_FALSE(Policy::parse("attn").is_budget());
  EXPECT_TRUE(contains(parse_error("budget:abc"), "bad budget 'abc'"));
  EXPECT_THROW(Policy::parse("budget:"), Error);
  EXPECT_THROW(Policy::parse("budget:1GB+attn"), Error);
  EXPECT_THROW(Policy::parse("budget:1GB").resolve(gpt2(), 4), Error);
}

// A per-layer choice is written back as the policy a user would type, and parses to the same layers.
TEST(LayersPolicyText, OnePresetEverywhereIsThatPreset) {
  EXPECT_EQ(layers_policy_text({{0, "attn"}, {1, "attn"}, {2, "attn"}}), "attn");
}

TEST(LayersPolicyText, RunsOfConsecutiveLayersShareARange) {
  const std::string text = layers_policy_text({{0, "attn"}, {1, "attn"}, {2, "full"}, {3, "save:ln1,qkv"}});
  EXPECT_EQ(text, "layers:0-1=attn,2=full,3=save:ln1,qkv");
  EXPECT_EQ(Policy::parse(text).resolve(gpt2(), 4).layers[3].same_choices(
                Policy::parse("save:ln1,qkv").resolve(gpt2(), 1).layers[0]),
            true);
}

TEST(LayersPolicyText, AGapInTheLayersEndsARange) {
  EXPECT_EQ(layers_policy_text({{2, "full"}, {3, "full"}, {6, "full"}, {7, "attn"}}), "layers:2-3=full,6=full,7=attn");
}

}  // namespace
}  // namespace remat
