#include "remat/policy.h"

#include <algorithm>
#include <charconv>
#include <iterator>

#include "remat/error.h"

namespace remat {

namespace {

// The presets: each prefers to recompute the choosable tensors that carry one of its tags
// (block.h, tag::), so a preset means the same on every block kind. "full" drops every choosable
// tensor.
struct PresetDef {
  const char* name;
  const char* doc;
  uint32_t tags;
  bool all = false;
  const char* missing = "";       // what a block without such tensors lacks, for the error
  bool matmul_save_list = false;  // torchtitan-op: by op, not by tag (save_list_of)
};

const std::vector<PresetDef>& presets() {
  static const std::vector<PresetDef> table = {
      {"none", "keep every activation", 0},
      {"full", "recompute everything from the block input", 0, /*all=*/true},
      {"attn", "drop the T x T attention tensors: scores, probabilities, their dropout (Megatron core_attn)",
       tag::kAttnCore, false, "no T x T attention tensor (flash attention keeps none)"},
      {"mlp-act", "drop the MLP activation output (llm.c recomputes GELU)", tag::kMlpAct, false, "no MLP activation"},
      {"norm", "drop normalisation outputs, keep their statistics", tag::kNormOut, false, "no normalisation"},
      {"mlp", "drop the MLP's inner tensors, recompute it from its input", tag::kMlpInner, false, "no MLP tensor"},
      {"moe-act", "drop the routed experts' activation (Megatron moe_act)", tag::kExpertAct, false,
       "no routed expert (--arch moe)"},
      {"moe", "drop the router's and the routed experts' tensors, recompute them from the norm (Megatron moe)",
       tag::kRouter | tag::kExperts, false, "no router or expert (--arch moe)"},
      {"shared", "drop the shared expert's tensors (Megatron shared_experts)", tag::kShared, false,
       "no shared expert (--arch moe --shared-ffn N)"},
      {"torchtitan-op",
       "torchtitan's selective op mode: keep the outputs of the 1st, 3rd, ... matmul of the block and of attention, "
       "recompute the rest",
       0, false, "", /*matmul_save_list=*/true},
  };
  return table;
}

constexpr const char* kAllowed =
    "none, full, attn, mlp-act, norm, mlp, moe-act, moe, shared, torchtitan-op, save:NAMES, keep:NAMES, drop:NAMES, "
    "every:K[=PRESET], "
    "block:N[=PRESET], uniform:N, layers:I-J=PRESET[,...], budget:SIZE";

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A non-negative integer of at most 9 digits, or -1.
int64_t to_int(std::string_view s) {
  if (!is_digits(s) || s.size() > 9) return -1;
  int64_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

int64_t positive(std::string_view s, std::string_view form, std::string_view text) {
  const int64_t v = to_int(s);
  if (v <= 0) fail("{} needs a positive integer, got '{}' in policy '{}'", form, s, text);
  return v;
}

void merge(TensorPolicy& cur, Choice choice, Strength strength, std::string_view tensor, std::string_view token) {
  if (strength > cur.strength) {
    cur = {choice, strength};
  } else if (strength == cur.strength && choice != cur.choice) {
    if (strength == Strength::Must) fail("tensor '{}' is pinned both to save and to recompute in '{}'", tensor, token);
    cur.choice = Choice::Recompute;  // two presets: the union of what they drop
  }
}

// torchtitan's selective op checkpointing (activation_checkpoint.py, _op_sac_save_list): a block
// keeps the output of each matmul whose count in the forward is odd (the 1st, 3rd, ...; the count
// restarts with every block) and the outputs of its attention; everything else is recomputed. The
// kept outputs stay whether a backward reads them or not (the checkpoint's storage holds them).
std::vector<int> save_list_of(const BlockSpec& spec) {
  std::vector<int> kept;
  int matmuls = 0;
  for (const OpNode& op : spec.ops) {
    if (op.kind == OpKind::Linear && ++matmuls % 2 == 1) kept.push_back(op.out[0]);
    if (op.kind == OpKind::FlashAttention || op.kind == OpKind::AttnValues)
      kept.insert(kept.end(), op.out.begin(), op.out.end());
  }
  return kept;
}

// A layers: policy's rules before their presets are parsed. Pieces split on ','; a piece "I=..."
// or "I-J=..." starts a rule, any other piece continues the previous rule's name list
// (save:ln1,qkv).
struct LayerRule {
  int64_t first = 0, last = 0;  // inclusive
  std::string token;            // "I-J=PRESET"
  std::string_view preset() const { return std::string_view(token).substr(token.find('=') + 1); }
};

std::vector<LayerRule> layer_rules(std::string_view text) {
  std::vector<LayerRule> rules;
  for (std::string_view piece : split(text.substr(7), ',')) {
    const size_t eq = piece.find('=');
    const std::string_view range = piece.substr(0, eq);
    const size_t dash = range.find('-');
    const bool starts_rule = eq != std::string_view::npos && is_digits(range.substr(0, dash)) &&
                             (dash == std::string_view::npos || is_digits(range.substr(dash + 1)));
    if (!starts_rule) {
      if (rules.empty() || piece.empty() || piece.find('=') != std::string_view::npos)
        fail(
            "bad layer assignment '{}' in policy '{}'; write I=PRESET or I-J=PRESET, "
            "e.g. layers:0-3=attn,4-5=full",
            piece, text);
      rules.back().token += "," + std::string(piece);
      continue;
    }
    LayerRule rule;
    rule.first = to_int(range.substr(0, dash));
    rule.last = dash == std::string_view::npos ? rule.first : to_int(range.substr(dash + 1));
    if (rule.first < 0 || rule.last < 0 || rule.first > rule.last)
      fail("bad layer range '{}' in policy '{}'; write I or I-J with I <= J", range, text);
    rule.token = std::string(piece);
    rules.push_back(std::move(rule));
  }
  if (rules.empty()) fail("empty layer list in policy '{}'", text);
  return rules;
}

void check_no_overlap(std::vector<LayerRule> rules, std::string_view text) {
  std::sort(rules.begin(), rules.end(), [](const LayerRule& a, const LayerRule& b) { return a.first < b.first; });
  for (size_t i = 1; i < rules.size(); ++i)
    if (rules[i].first <= rules[i - 1].last)
      fail("layer ranges '{}' and '{}' overlap in policy '{}'", rules[i - 1].token, rules[i].token, text);
}

}  // namespace

bool LayerPolicy::same_choices(const LayerPolicy& other) const {
  if (this == &other) return true;
  if (tensors.size() != other.tensors.size() || eager != other.eager) return false;
  for (size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].choice != other.tensors[t].choice || tensors[t].hold != other.tensors[t].hold) return false;
  return true;
}

void LayerPolicy::append_key(std::string& key) const {
  key += eager ? 'e' : 'l';
  for (size_t t = 0; t < tensors.size(); ++t)
    key += holds(static_cast<int>(t)) ? 'h' : saves(static_cast<int>(t)) ? '1' : '0';
}

bool LayerPolicy::keeps_all(const BlockSpec& spec) const {
  for (int t : spec.choosable())
    if (!saves(t)) return false;
  return true;
}

bool LayerPolicy::drops_all(const BlockSpec& spec) const {
  for (int t : spec.choosable())
    if (saves(t)) return false;
  return true;
}

std::string LayerPolicy::dropped_names(const BlockSpec& spec) const {
  std::string s;
  for (int t : spec.choosable())
    if (!saves(t)) s += (s.empty() ? "" : ", ") + spec.tensors[t].name;
  return s;
}

std::vector<Policy::Term> Policy::parse_preset(std::string_view text, std::string_view context) {
  if (text.empty()) fail("empty preset in policy '{}'; allowed: {}", context, kAllowed);
  std::vector<Term> terms;
  for (std::string_view piece : split(text, '+')) {
    if (piece.empty()) fail("empty term in '{}' (a '+' with nothing on one side)", context);
    Term term;
    term.token = std::string(piece);
    const size_t colon = piece.find(':');
    if (colon != std::string_view::npos) {
      const std::string_view head = piece.substr(0, colon);
      if (head == "save")
        term.kind = TermKind::Save;
      else if (head == "keep")
        term.kind = TermKind::Keep;
      else if (head == "drop")
        term.kind = TermKind::Drop;
      else if (head == "every" || head == "block" || head == "uniform" || head == "layers" || head == "budget")
        fail("'{}' cannot appear inside a preset in '{}'; per-layer forms do not nest", piece, context);
      else
        fail("unknown policy term '{}' in '{}'; allowed: {}", piece, context, kAllowed);
      for (std::string_view name : split(piece.substr(colon + 1), ',')) {
        if (name.empty()) fail("empty tensor name in '{}'; write {}:NAME[,NAME...]", piece, head);
        term.names.emplace_back(name);
      }
    } else {
      const auto& table = presets();
      const auto it = std::find_if(table.begin(), table.end(), [&](const PresetDef& p) { return piece == p.name; });
      if (it == table.end()) {
        if (piece == "every" || piece == "block" || piece == "uniform" || piece == "layers")
          fail("'{}' needs a number in policy '{}' (e.g. {}:2)", piece, context, piece);
        fail("unknown policy term '{}' in '{}'; allowed: {}", piece, context, kAllowed);
      }
      term.kind = TermKind::Preset;
      term.preset = static_cast<int>(it - table.begin());
    }
    terms.push_back(std::move(term));
  }
  return terms;
}

Policy Policy::parse(std::string_view text) {
  Policy p;
  p.text_ = std::string(text);
  if (text.empty()) fail("empty policy; allowed: {}", kAllowed);

  // every:K[=preset] and block:N[=preset] share a shape.
  for (auto [prefix, form] : {std::pair{"every:", Form::Every}, std::pair{"block:", Form::Block}}) {
    if (!starts_with(text, prefix)) continue;
    const std::string_view rest = text.substr(std::string_view(prefix).size());
    const size_t eq = rest.find('=');
    p.form_ = form;
    p.n_ = positive(rest.substr(0, eq), form == Form::Every ? "every:K" : "block:N", text);
    Rule rule;
    rule.token = std::string(text);
    rule.terms = parse_preset(eq == std::string_view::npos ? "full" : rest.substr(eq + 1), text);
    p.rules_.push_back(std::move(rule));
    return p;
  }
  if (starts_with(text, "uniform:")) {
    p.form_ = Form::Uniform;
    p.n_ = positive(text.substr(8), "uniform:N", text);
    return p;
  }
  if (starts_with(text, "budget:")) {
    p.form_ = Form::Budget;
    const std::string_view rest = text.substr(7);
    const size_t plus = rest.find('+');
    const std::string_view size = rest.substr(0, plus);
    if (size.empty()) fail("budget: needs a size in policy '{}', e.g. budget:300MiB or budget:60%", text);
    p.budget_ = parse_budget(size);
    Rule rule;
    rule.token = std::string(text);
    if (plus != std::string_view::npos) rule.terms = parse_preset(rest.substr(plus + 1), text);
    for (const Term& t : rule.terms)
      if (t.kind != TermKind::Keep && t.kind != TermKind::Drop)
        fail("'{}' cannot follow a budget in '{}'; a budget takes only keep: and drop: pins", t.token, text);
    p.rules_.push_back(std::move(rule));
    return p;
  }
  if (starts_with(text, "layers:")) {
    p.form_ = Form::Layers;
    const std::vector<LayerRule> rules = layer_rules(text);
    for (const LayerRule& r : rules) {
      Rule rule;
      rule.first = r.first, rule.last = r.last, rule.token = r.token;
      rule.terms = parse_preset(r.preset(), text);
      p.rules_.push_back(std::move(rule));
    }
    check_no_overlap(rules, text);
    return p;
  }
  p.form_ = Form::All;
  Rule rule;
  rule.token = std::string(text);
  rule.terms = parse_preset(text, text);
  p.rules_.push_back(std::move(rule));
  return p;
}

LayerPolicy Policy::apply(const BlockSpec& spec, const std::vector<Term>& terms, std::string_view token) {
  LayerPolicy lp;
  lp.tensors.resize(spec.tensors.size());
  for (int in : spec.inputs) lp.tensors[in] = {Choice::Save, Strength::Must};
  const std::vector<int> choosable = spec.choosable();

  auto lookup = [&](const std::string& name, std::string_view term) {
    const int t = spec.find(name);
    if (t >= 0 && spec.is_input(t)) fail("'{}' in '{}' is the block input; it is always kept", name, term);
    if (t >= 0 && !spec.tensors[t].read_by_backward)
      fail("'{}' in '{}' is never read by a backward, so it is never kept; a {} block can keep: {}", name, term,
           spec.kind, spec.choosable_names());
    if (t < 0)
      fail("unknown tensor '{}' in '{}'; a {} block can keep: {}", name, term, spec.kind, spec.choosable_names());
    return t;
  };

  for (const Term& term : terms) {
    switch (term.kind) {
      case TermKind::Preset: {
        const PresetDef& def = presets()[term.preset];
        if (def.matmul_save_list) {
          const std::vector<int> kept = save_list_of(spec);
          for (int t : choosable) {
            const bool keep = std::find(kept.begin(), kept.end(), t) != kept.end();
            merge(lp.tensors[t], keep ? Choice::Save : Choice::Recompute, Strength::Prefer, spec.tensors[t].name,
                  token);
          }
          for (int t : kept)
            if (!spec.is_input(t) && !spec.tensors[t].read_by_backward)
              lp.tensors[t] = {Choice::Save, Strength::Prefer, true};
          break;
        }
        int named = 0;
        for (int t : choosable) {
          if (!def.all && !(spec.tensors[t].tags & def.tags)) continue;
          merge(lp.tensors[t], Choice::Recompute, Strength::Prefer, spec.tensors[t].name, token);
          ++named;
        }
        if (named == 0 && def.tags != 0)
          fail("preset '{}' in '{}' drops nothing in a {} block: it has {} to keep", def.name, token, spec.kind,
               def.missing);
        break;
      }
      case TermKind::Save: {
        std::vector<int> named;
        for (const std::string& n : term.names) named.push_back(lookup(n, term.token));
        for (int t : choosable) {
          const bool keep = std::find(named.begin(), named.end(), t) != named.end();
          merge(lp.tensors[t], keep ? Choice::Save : Choice::Recompute, keep ? Strength::Must : Strength::Prefer,
                spec.tensors[t].name, token);
        }
        break;
      }
      case TermKind::Keep:
      case TermKind::Drop:
        for (const std::string& n : term.names)
          merge(lp.tensors[lookup(n, term.token)], term.kind == TermKind::Keep ? Choice::Save : Choice::Recompute,
                Strength::Must, n, token);
        break;
    }
  }
  return lp;
}

LayerPolicy Policy::pins(const BlockSpec& spec) const {
  if (form_ != Form::Budget) return apply(spec, {}, text_);
  return apply(spec, rules_[0].terms, text_);
}

LayerPolicy Policy::parse_pins(std::string_view text, const BlockSpec& spec) {
  const std::vector<Term> terms = parse_preset(text, text);
  for (const Term& t : terms)
    if (t.kind != TermKind::Keep && t.kind != TermKind::Drop)
      fail("pins '{}': '{}' is not a pin; pins are keep:NAMES and drop:NAMES joined by '+'", text, t.token);
  return apply(spec, terms, text);
}

LayerPolicy keep_everything(const BlockSpec& spec) {
  LayerPolicy lp;
  lp.tensors.resize(spec.tensors.size());
  for (int in : spec.inputs) lp.tensors[in] = {Choice::Save, Strength::Must};
  return lp;
}

LayerPolicy keep_nothing(const BlockSpec& spec) {
  LayerPolicy lp = keep_everything(spec);
  for (int t : spec.choosable()) lp.tensors[t] = {Choice::Recompute, Strength::Must};
  return lp;
}

ResolvedPolicy Policy::resolve(const BlockSpec& spec, int64_t layers) const {
  if (form_ == Form::Budget)
    fail("policy '{}' needs the planner to resolve (remat::resolve_policy in resolve.h)", text_);
  if (text_.empty()) fail("this Policy holds no policy (it was default-constructed); make one with Policy::parse");
  if (layers < 1) fail("policy '{}' resolved for {} layers; a model has at least 1", text_, layers);
  ResolvedPolicy r;
  const LayerPolicy none = keep_everything(spec);
  r.layers.assign(static_cast<size_t>(layers), none);
  switch (form_) {
    case Form::All: {
      const LayerPolicy lp = apply(spec, rules_[0].terms, rules_[0].token);
      std::fill(r.layers.begin(), r.layers.end(), lp);
      break;
    }
    case Form::Every: {
      const LayerPolicy lp = apply(spec, rules_[0].terms, rules_[0].token);
      for (int64_t i = 0; i < layers; ++i)
        if (i % n_ != 0) r.layers[i] = lp;
      break;
    }
    case Form::Block: {
      if (n_ > layers) fail("block:{} exceeds the model's {} layers in policy '{}'", n_, layers, text_);
      const LayerPolicy lp = apply(spec, rules_[0].terms, rules_[0].token);
      for (int64_t i = 0; i < n_; ++i) r.layers[i] = lp;
      break;
    }
    case Form::Uniform:
      if (n_ > layers) fail("uniform:{} exceeds the model's {} layers in policy '{}'", n_, layers, text_);
      r.segment = n_;
      break;
    case Form::Budget:
      break;  // refused above
    case Form::Layers:
      for (const Rule& rule : rules_) {
        if (rule.last >= layers)
          fail("layer range '{}' in policy '{}' exceeds the model's {} layers (0-{})", rule.token, text_, layers,
               layers - 1);
        const LayerPolicy lp = apply(spec, rule.terms, rule.token);
        for (int64_t i = rule.first; i <= rule.last; ++i) r.layers[i] = lp;
      }
      break;
  }
  return r;
}

std::vector<std::string> split_policy_list(std::string_view list) {
  // A piece continues the previous policy only where that policy is mid-list: a name after
  // save:/keep:/drop:, or a layer assignment after layers:. Anything else starts a new policy, so a
  // typo is reported as itself.
  auto is_name = [](std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    }) && std::none_of(presets().begin(), presets().end(), [&](const PresetDef& p) { return s == p.name; });
  };
  auto continues = [&](const std::string& prev, std::string_view piece) {
    const std::string_view last_term = std::string_view(prev).substr(prev.rfind('+') + 1);
    const bool in_names = starts_with(last_term, "save:") || starts_with(last_term, "keep:") ||
                          starts_with(last_term, "drop:") || last_term.find("=save:") != std::string_view::npos ||
                          last_term.find("=keep:") != std::string_view::npos ||
                          last_term.find("=drop:") != std::string_view::npos;
    if (in_names && is_name(piece)) return true;
    return starts_with(prev, "layers:") && !piece.empty() && piece[0] >= '0' && piece[0] <= '9';
  };
  std::vector<std::string> out;
  for (std::string_view group : split(list, ';')) {
    std::vector<std::string> pieces;
    for (std::string_view piece : split(group, ',')) {
      if (!pieces.empty() && continues(pieces.back(), piece))
        pieces.back() += "," + std::string(piece);
      else
        pieces.emplace_back(piece);
    }
    for (std::string& p : pieces) {
      if (p.empty())
        fail("empty policy in the list '{}'; separate policies with one ',' or ';' (e.g. none,full)", list);
      out.push_back(std::move(p));
    }
  }
  return out;
}

std::string layers_policy_text(const std::vector<std::pair<int64_t, std::string>>& layers) {
  if (layers.empty()) fail("layers_policy_text: no layers; give one (layer, policy) pair per layer");
  bool uniform = true;
  for (const auto& [l, t] : layers) uniform = uniform && t == layers.front().second;
  if (uniform) return layers.front().second;
  std::string s = "layers:";
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1].first == layers[j].first + 1 &&
           layers[j + 1].second == layers[i].second)
      ++j;
    s += fmt::format("{}{}={}", i ? "," : "",
                     i == j ? std::to_string(layers[i].first) : fmt::format("{}-{}", layers[i].first, layers[j].first),
                     layers[i].second);
    i = j + 1;
  }
  return s;
}

}  // namespace remat
