// Policy: which activations each layer keeps for its backward and which it recomputes.
//
// A policy is a string, parsed once (syntax errors, budgets included) and resolved against a block
// kind and a layer count (name and range errors). The grammar:
//
//   policy  := preset
//            | every:K[=preset]      layer i keeps everything when i % K == 0, else runs preset
//                                    (default full): the seed note's "checkpoint every K-th layer"
//            | block:N[=preset]      the first N layers run preset (default full), the rest none
//                                    (Megatron's recompute_method=block)
//            | uniform:N             segments of N layers keep only the segment input and recompute
//                                    the whole segment (Megatron's recompute_method=uniform)
//            | layers:R=preset[,R=preset...]   R is I or I-J (0-based, inclusive); others none
//            | budget:SIZE[+keep:..][+drop:..]  the planner's choice (resolve.h): the fastest policy
//                                    whose true peak fits SIZE ("300MiB", "2GB", "60%")
//   preset  := term[+term...]        union of what the terms drop
//   term    := none                  keep every activation
//            | full                  recompute everything from the block input
//            | attn                  drop the T x T attention tensors (Megatron's core-attention recompute)
//            | mlp-act               drop the MLP activation output (llm.c's GELU recompute)
//            | norm                  drop normalisation outputs; their statistics stay saved
//            | mlp                   drop the MLP's inner tensors; recompute it from its input
//            | moe-act               drop the routed experts' activation (Megatron's moe_act)
//            | moe                   drop the router's and the routed experts' tensors (Megatron's moe)
//            | shared                drop the shared expert's tensors (Megatron's shared_experts)
//            | torchtitan-op         torchtitan's selective op mode: keep every other matmul's output
//                                    (the 1st, 3rd, ...) and attention's, recompute the rest
//            | save:NAME[,NAME...]   must save these, recompute every other tensor
//            | keep:NAME[,NAME...]   must save these (a pin: no planner moves it)
//            | drop:NAME[,NAME...]   must recompute these (a pin)
//
// Presets select tensors by tag (block.h, tag::), so `attn` means the same on every block kind.
// Every choice has a strength: presets "prefer", save/keep/drop "must". Executing a policy treats
// both alike; the planner may override a prefer choice, never a must choice.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "remat/block.h"

namespace remat {

// What happens to a tensor the backward reads: kept from the forward, or dropped and recomputed.
enum class Choice : uint8_t { Save, Recompute };
enum class Strength : uint8_t {
  Default,  // nobody said anything: save
  Prefer,   // a preset chose it
  Must,     // the user pinned it (save:, keep:, drop:)
};

struct TensorPolicy {
  Choice choice = Choice::Save;
  Strength strength = Strength::Default;  // who decided: a stronger choice wins over a weaker one
  // Saved although no backward reads it (with Choice::Save): activation checkpointing's save lists
  // keep an op's output whatever reads it (torchtitan's op mode keeps every other matmul's output).
  bool hold = false;
};

// Choices for one layer, indexed by the BlockSpec's tensor id. Only choosable tensors (read by some
// backward, not an input) are ever Recompute.
struct LayerPolicy {
  std::vector<TensorPolicy> tensors;
  // Recompute every dropped tensor the backward needs when the layer's backward starts, in forward
  // order, as torch.utils.checkpoint and Megatron-LM rerun a checkpointed layer's forward; false:
  // each just before the backward op that reads it (remat's executor). GPU plans replay the former.
  bool eager = false;

  // Whether `tensor` is kept from the forward; kept although no backward reads it.
  bool saves(int tensor) const { return tensors[tensor].choice == Choice::Save; }
  bool holds(int tensor) const { return tensors[tensor].hold && saves(tensor); }
  // True when both make the same choice for every tensor and recompute alike (the schedule they
  // compile to is equal).
  bool same_choices(const LayerPolicy& other) const;
  // Appends what the compiled schedule depends on: the recompute order ('e' eager, 'l' lazy), then
  // per tensor 'h' (held), '1' (saved) or '0' (recomputed). Equal keys, equal schedules: the key of
  // ScheduleCache and of the planner's memos.
  void append_key(std::string& key) const;
  // True when no choosable tensor is recomputed.
  bool keeps_all(const BlockSpec& spec) const;
  // True when every choosable tensor is recomputed.
  bool drops_all(const BlockSpec& spec) const;
  // Names of the recomputed tensors, comma-separated ("" when none).
  std::string dropped_names(const BlockSpec& spec) const;
};

// Keeps every activation of `spec`: how stems and heads always run.
LayerPolicy keep_everything(const BlockSpec& spec);
// Recomputes every choosable tensor of `spec` (its inputs are kept): a uniform:N segment's first
// forward, whose backward never runs.
LayerPolicy keep_nothing(const BlockSpec& spec);

// A policy resolved for one model: one LayerPolicy per layer, plus uniform:N's segment size.
struct ResolvedPolicy {
  std::vector<LayerPolicy> layers;
  // 0: no segments. N >= 1: layers are grouped into segments of N (the last may be shorter); a
  // segment keeps only its input during forward and reruns all its layers in backward (uniform:N).
  int64_t segment = 0;
};

// A memory budget for the planner.
struct Budget {
  int64_t bytes = 0;   // total peak in bytes, when > 0
  double percent = 0;  // else: the fixed bytes (weights, optimizer state, data) plus this share of
                       // what `none` adds on top of them during a step (activations, gradients)
};

// "300MiB", "2GB", "1.5GiB", "123456" (bytes), "60%". Throws remat::Error naming the text and the
// allowed forms for anything else, including sizes that round to 0 or do not fit in 64 bits.
Budget parse_budget(std::string_view text);
// "300.0 MiB" or "60% of none's activations and gradients".
std::string to_string(const Budget& b);

class Policy {
 public:
  // Parses `text`, budget included. Throws remat::Error naming the bad token and the allowed ones.
  static Policy parse(std::string_view text);

  // Per-layer choices for `layers` blocks of `spec`. Throws remat::Error for tensor names the block
  // does not have, presets that drop nothing in it, ranges beyond the last layer, and budget
  // policies (those resolve through the planner: resolve_policy in resolve.h).
  ResolvedPolicy resolve(const BlockSpec& spec, int64_t layers) const;

  // The text it was parsed from.
  const std::string& text() const { return text_; }
  // A budget: policy, which the planner resolves.
  bool is_budget() const { return form_ == Form::Budget; }
  // uniform:N: segments of layers (ResolvedPolicy::segment), which may keep less than full.
  bool is_segmented() const { return form_ == Form::Uniform; }
  // REQUIRES: is_budget().
  const Budget& budget() const { return budget_; }
  // The keep:/drop: pins of a budget policy as one layer's choices (Must strength); none for others.
  LayerPolicy pins(const BlockSpec& spec) const;
  // Pins on their own, "keep:A,B+drop:C" (what `remat plan --pins` takes). Throws remat::Error for
  // anything but keep: and drop: terms, and for names `spec` does not have.
  static LayerPolicy parse_pins(std::string_view text, const BlockSpec& spec);

 private:
  enum class TermKind : uint8_t { Preset, Save, Keep, Drop };
  struct Term {
    TermKind kind;
    int preset = -1;                 // index into the preset table
    std::vector<std::string> names;  // Save, Keep, Drop
    std::string token;               // as written, for errors
  };
  struct Rule {
    int64_t first = 0, last = 0;  // inclusive layer range (Layers)
    std::vector<Term> terms;      // the preset, parsed
    std::string token;
  };
  enum class Form : uint8_t { All, Every, Block, Uniform, Layers, Budget };

  static std::vector<Term> parse_preset(std::string_view text, std::string_view context);
  static LayerPolicy apply(const BlockSpec& spec, const std::vector<Term>& terms, std::string_view token);

  std::string text_;
  Form form_ = Form::All;
  int64_t n_ = 0;            // K for every, N for block and uniform
  std::vector<Rule> rules_;  // All/Every/Block/Budget: one rule; Layers: one per range
  Budget budget_;            // Budget
};

// Splits a list of policies as --policies takes it. Separators are ';', or ',' when the next piece
// starts a policy (a preset name or a form such as every:, save:), so commas inside a policy stay:
// "none,save:ln1,qkv,layers:0-1=attn,2-5=full" -> none | save:ln1,qkv | layers:0-1=attn,2-5=full.
// Throws remat::Error for an empty piece ("none,,full", a trailing ',').
std::vector<std::string> split_policy_list(std::string_view list);

// The policy text of per-layer presets, given as (layer, preset text) in ascending layer order:
// the preset itself when every layer has the same one, else "layers:0-5=attn,6-11=none" (runs of
// consecutive layers with one preset). REQUIRES: layers is not empty.
std::string layers_policy_text(const std::vector<std::pair<int64_t, std::string>>& layers);

}  // namespace remat
