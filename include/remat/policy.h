// Policy: which activations each layer keeps for its backward and which it recomputes.
//
// A policy is a string, parsed once (syntax errors) and resolved against a block kind and a layer
// count (name and range errors). The grammar:
//
//   policy  := preset
//            | every:K[=preset]      layer i keeps everything when i % K == 0, else runs preset
//                                    (default full): the seed note's "checkpoint every K-th layer"
//            | block:N[=preset]      the first N layers run preset (default full), the rest none
//                                    (Megatron's recompute_method=block)
//            | uniform:N             chunks of N layers keep only the chunk input and recompute
//                                    the whole chunk (Megatron's recompute_method=uniform)
//            | layers:R=preset[,R=preset...]   R is I or I-J (0-based, inclusive); others none
//            | budget:SIZE[+keep:..][+drop:..]  the planner's choice (planner.h): the fastest policy
//                                    whose true peak fits SIZE ("300MiB", "2GB", "60%" of none's)
//   preset  := term[+term...]        union of what the terms drop
//   term    := none                  keep every activation
//            | full                  recompute everything from the block input
//            | attn                  drop scores and probabilities, the (B, H, T, T) tensors
//                                    (Megatron's selective core-attention recompute)
//            | mlp-act               drop the MLP activation output (llm.c's GELU recompute)
//            | norm                  drop LayerNorm outputs; their mean and rstd stay saved
//            | mlp                   drop the MLP's inner tensors; recompute it from its input
//            | save:NAME[,NAME...]   must save these, recompute every other tensor
//            | keep:NAME[,NAME...]   must save these (a pin: no planner moves it)
//            | drop:NAME[,NAME...]   must recompute these (a pin)
//
// Every choice has a strength: presets "prefer", save/keep/drop "must". Executing a policy treats
// both alike; the planner may override a prefer choice, never a must choice.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/block.h"

namespace remat {

enum class Choice : uint8_t { Save, Recompute };
enum class Strength : uint8_t {
  Default,  // nobody said anything: save
  Prefer,   // a preset chose it
  Must,     // the user pinned it (save:, keep:, drop:)
};

struct TensorPolicy {
  Choice choice = Choice::Save;
  Strength strength = Strength::Default;
};

// Choices for one layer, indexed by the BlockSpec's tensor id. Only choosable tensors (read by some
// backward, not the block input) are ever Recompute.
struct LayerPolicy {
  std::vector<TensorPolicy> tensors;

  bool saves(int tensor) const { return tensors[tensor].choice == Choice::Save; }
  // True when no choosable tensor is recomputed.
  bool keeps_all(const BlockSpec& spec) const;
  // True when every choosable tensor is recomputed.
  bool drops_all(const BlockSpec& spec) const;
  // Names of the recomputed tensors, comma-separated ("" when none).
  std::string dropped_names(const BlockSpec& spec) const;
};

// A policy resolved for one model: one LayerPolicy per layer, plus layer chunks.
struct ResolvedPolicy {
  std::vector<LayerPolicy> layers;
  // 0: no chunks. N >= 1: layers are grouped into chunks of N (the last may be shorter); a chunk
  // keeps only its input during forward and reruns all its layers in backward (uniform:N).
  int64_t chunk = 0;
};

class Policy {
 public:
  // Parses `text`. Throws remat::Error naming the bad token and the allowed ones.
  static Policy parse(std::string_view text);

  // Per-layer choices for `layers` blocks of `spec`. Throws remat::Error for tensor names the block
  // does not have, presets that name none of its tensors, and ranges beyond the last layer.
  ResolvedPolicy resolve(const BlockSpec& spec, int64_t layers) const;

  const std::string& text() const { return text_; }

  // "300MiB" for budget:300MiB+keep:qkv; empty when this is not a budget policy.
  const std::string& budget() const { return budget_; }
  // The keep:/drop: pins of a budget policy as one layer's choices (Must strength).
  LayerPolicy pins(const BlockSpec& spec) const;

  // The preset names with a one-line description each, for --help and errors.
  static std::string preset_help();

 private:
  enum class TermKind : uint8_t { Preset, Save, Keep, Drop };
  struct Term {
    TermKind kind;
    int preset = -1;                 // index into the preset table
    std::vector<std::string> names;  // Save, Keep, Drop
    std::string token;               // as written, for errors
  };
  struct Rule {
    int64_t first = 0, last = 0;     // inclusive layer range (resolved for every/block)
    std::vector<Term> terms;         // the preset, parsed
    std::string token;
  };
  enum class Form : uint8_t { All, Every, Block, Uniform, Layers, Budget };

  static std::vector<Term> parse_preset(std::string_view text, std::string_view context);
  static LayerPolicy apply(const BlockSpec& spec, const std::vector<Term>& terms,
                           std::string_view token);

  std::string text_;
  Form form_ = Form::All;
  int64_t n_ = 0;                    // K for every, N for block and uniform
  std::vector<Rule> rules_;          // All/Every/Block/Budget: one rule; Layers: one per range
  std::string budget_;               // Budget: the size as written
};

// Splits a list of policies as --policies takes it. Separators are ';', or ',' when the next piece
// starts a policy (a preset name or a form such as every:, save:), so commas inside a policy stay:
// "none,save:ln1,qkv,layers:0-1=attn,2-5=full" -> none | save:ln1,qkv | layers:0-1=attn,2-5=full.
std::vector<std::string> split_policy_list(std::string_view list);

}  // namespace remat
