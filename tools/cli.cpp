#include "cli.h"

#include <unistd.h>

#include <charconv>
#include <cstdio>

#include <fmt/format.h>

#include "remat/block.h"
#include "remat/error.h"
#include "remat/models.h"
#include "util/text.h"

namespace remat::cli {

void ShapeFlags::add(CLI::App* a) {
  app = a;
  std::string kinds;
  for (const std::string& k : block_kinds()) kinds += (kinds.empty() ? "" : ", ") + k;
  a->add_option("--arch", cfg.arch, "block kind: " + kinds)->capture_default_str();
  a->add_option("--layers", cfg.layers, "transformer blocks")->capture_default_str();
  a->add_option("--dim", cfg.dim, "model width")->capture_default_str();
  a->add_option("--heads", cfg.heads, "attention heads (must divide --dim)")->capture_default_str();
  a->add_option("--kv-heads", cfg.kv_heads, "llama: key/value heads (grouped-query attention); 0 = --heads")
      ->capture_default_str();
  a->add_option("--head-dim", cfg.head_size, "width of one attention head; 0 = --dim / --heads")->capture_default_str();
  a->add_option("--batch", cfg.batch,
                "sequences per micro-batch (train: per rank; plan: a one-process plan or --device cpu)")
      ->capture_default_str();
  a->add_option("--seq", cfg.seq, "tokens per sequence")->capture_default_str();
  a->add_option("--ffn", cfg.ffn, "MLP hidden width; 0 = 4 * dim")->capture_default_str();
  a->add_option("--dropout", cfg.dropout, "gpt2, llama: dropout probability")->capture_default_str();
  a->add_option("--attn-block", cfg.attn_block, "causal attention: query rows per stored block")->capture_default_str();
  a->add_option("--attention", attention, "math (T x T scores and probabilities) or flash (one fused op, no T x T)")
      ->capture_default_str();
  // The decoder's choices (gpt2, llama): the kind's own unless given.
  a->add_option("--norm", norm, "layer (LayerNorm) or rms (RMSNorm); default: the kind's");
  a->add_option("--positions", positions, "learned, rope or none; default: the kind's");
  a->add_option("--mlp", mlp, "gelu (fc) or swiglu (gate, up); default: the kind's");
  a->add_flag("--bias,!--no-bias", bias_flag, "biases on every linear (default: the kind's: gpt2 yes, llama no)");
  a->add_flag("--qkv-bias", cfg.qkv_bias, "biases on q, k and v only (Qwen2)");
  a->add_flag("--tied,!--untied", tied_flag, "the LM head is the token embedding (default: the kind's: gpt2 tied)");
  a->add_option("--qkv", qkv, "fused (one qkv linear: GPT-2, Megatron-LM) or separate (q, k, v: HF Llama, torchtitan)");
  a->add_option("--loss", loss,
                "cross-entropy: fp32 (Megatron's, in place on an fp32 copy; default under bf16/fp16), "
                "upcast (PyTorch's cross_entropy(logits.float())), model, fused (Megatron's "
                "--cross-entropy-loss-fusion, bf16), or chunked:N (fused with the LM head, N chunks of the tokens)");
  // The mixture of experts (moe).
  a->add_option("--experts", cfg.experts, "moe: routed experts")->capture_default_str();
  a->add_option("--top-k", cfg.top_k, "moe: experts each token goes to")->capture_default_str();
  a->add_option("--shared-ffn", cfg.shared_ffn, "moe: width of a shared expert every token passes; 0 = none")
      ->capture_default_str();
  a->add_option("--capacity-factor", cfg.capacity_factor,
                "moe: 0 = dropless; c > 0: each expert takes ceil(c * tokens * top-k / experts) rows of each rank's "
                "tokens, the rest dropped")
      ->capture_default_str();
  a->add_option(
       "--router", router,
       "moe: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) scores, or sinkhorn (Megatron-LM's balanced choice)")
      ->capture_default_str();
  a->add_option("--aux-loss", cfg.aux_loss,
                "moe: load-balancing loss coefficient; 0 = off (and the default with --router sinkhorn)")
      ->capture_default_str();
  a->add_option("--expert-weights", expert_weights,
                "moe: where the routing weights multiply: combine (the experts' outputs; Hugging Face, torchtitan) "
                "or activation (the experts' activation, before their second linear; Megatron-LM)")
      ->capture_default_str();
}

void ShapeFlags::add_planning(CLI::App* a) {
  std::string names;
  for (const NamedModel& m : named_models()) names += (names.empty() ? "" : ", ") + m.name;
  a->add_option("--model", model, "a preset: " + names + " (flags override it)");
  a->add_option(
      "--model-config", model_config,
      "a Hugging Face config.json (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE, GPT-2, GPT-NeoX); flags override it");
  a->add_option("--vocab", cfg.vocab, "token models: vocabulary size")->capture_default_str();
  a->add_option("--dtype", dtype,
                "fp32, bf16 or fp16 (the engine, and plan --device cpu, run fp32; other plans take all)")
      ->capture_default_str();
  a->add_option("--router-dtype", router_dtype,
                "moe: model (the router's logits and weights in the model's dtype) or fp32 (Megatron-LM's "
                "--moe-router-dtype fp32: fp32 logits, weights, and the weighted products and combine they make)")
      ->capture_default_str();
  a->add_option("--expert-imbalance", cfg.expert_imbalance,
                "moe with --ep: the busiest expert-parallel rank's dispatched rows over the mean (1 = balanced)")
      ->capture_default_str();
}

ModelConfig ShapeFlags::resolve() {
  if (!model.empty() && !model_config.empty()) fail("--model and --model-config both name a model; give one");
  if (!model.empty() || !model_config.empty()) {
    // The preset or the file, with every flag given on the command line over it.
    const ModelConfig base = model.empty() ? read_model_config(model_config) : named_model(model).config;
    auto unset = [&](const char* flag) { return app->count(flag) == 0; };
    const ModelConfig flags = cfg;
    cfg = base;
    if (!unset("--arch")) cfg.arch = flags.arch;
    if (!unset("--layers")) cfg.layers = flags.layers;
    if (!unset("--dim")) cfg.dim = flags.dim;
    if (!unset("--heads")) cfg.heads = flags.heads;
    if (!unset("--kv-heads")) cfg.kv_heads = flags.kv_heads;
    if (!unset("--head-dim")) cfg.head_size = flags.head_size;
    if (!unset("--ffn")) cfg.ffn = flags.ffn;
    if (!unset("--seq")) cfg.seq = flags.seq;
    if (!unset("--vocab")) cfg.vocab = flags.vocab;
    if (!unset("--dropout")) cfg.dropout = flags.dropout;
    if (!unset("--batch")) cfg.batch = flags.batch;
    if (!unset("--attn-block")) cfg.attn_block = flags.attn_block;
    if (!unset("--qkv-bias")) cfg.qkv_bias = flags.qkv_bias;
    if (!unset("--experts")) cfg.experts = flags.experts;
    if (!unset("--top-k")) cfg.top_k = flags.top_k;
    if (!unset("--shared-ffn")) cfg.shared_ffn = flags.shared_ffn;
    if (!unset("--capacity-factor")) cfg.capacity_factor = flags.capacity_factor;
    if (!unset("--aux-loss")) cfg.aux_loss = flags.aux_loss;
    if (app->get_option_no_throw("--expert-imbalance") && !unset("--expert-imbalance"))
      cfg.expert_imbalance = flags.expert_imbalance;
    if (unset("--router")) router = std::string(to_string(base.router));
    if (unset("--expert-weights")) expert_weights = std::string(to_string(base.expert_weights));
    if (unset("--dtype")) dtype = std::string(to_string(base.dtype));
  }
  cfg.dtype = parse_dtype(dtype);
  cfg.attention = parse_attention(attention.substr(0, attention.find(',')));
  if (!norm.empty()) cfg.norm = parse_norm(norm);
  if (!positions.empty()) cfg.positions = parse_positions(positions);
  if (!mlp.empty()) cfg.mlp = parse_mlp(mlp);
  if (app->count("--bias") + app->count("--no-bias") > 0) cfg.bias = bias_flag ? Switch::On : Switch::Off;
  if (app->count("--tied") + app->count("--untied") > 0) cfg.tied = tied_flag ? Switch::On : Switch::Off;
  if (!qkv.empty()) {
    if (qkv != "fused" && qkv != "separate") fail("unknown --qkv '{}'; allowed: fused, separate", qkv);
    cfg.fused_qkv = qkv == "fused" ? Switch::On : Switch::Off;
  }
  if (!loss.empty()) parse_loss(loss, cfg);
  cfg.router = parse_router(router);
  // Sinkhorn balances the experts by itself: its default is no load-balancing loss (Megatron-LM's).
  if (cfg.router == Router::Sinkhorn && app->count("--aux-loss") == 0) cfg.aux_loss = 0;
  if (router_dtype != "model" && router_dtype != "fp32")
    fail("unknown --router-dtype '{}'; allowed: model, fp32", router_dtype);
  cfg.router_fp32 = router_dtype == "fp32";
  cfg.expert_weights = parse_expert_weights(expert_weights);
  if (attention.find(',') != std::string::npos && !lists_attention)
    fail("--attention takes one of math, flash here, got '{}'; remat bench takes a list", attention);
  validate(cfg);          // first: an unknown --arch is named as such
  if (cfg.arch != "moe")  // else a user who asked for experts would get a model without them, silently
    for (const char* flag : {"--experts", "--top-k", "--shared-ffn", "--capacity-factor", "--router", "--aux-loss",
                             "--expert-weights", "--router-dtype", "--expert-imbalance"})
      if (app->get_option_no_throw(flag) != nullptr && app->count(flag) > 0)
        fail("{} is for a mixture of experts (--arch moe); a {} block has no experts: leave it out", flag, cfg.arch);
  if (cfg.arch == "seed" && app->get_option_no_throw("--vocab") != nullptr && app->count("--vocab") > 0)
    fail(
        "--vocab sizes a token model's embedding and LM head; the seed block (--arch seed) takes float inputs and "
        "has neither: leave --vocab out, or give --arch gpt2, llama or moe");
  return cfg;
}

int64_t ShapeFlags::global_batch() const { return model.empty() ? 0 : named_model(model).global_batch; }

namespace {
bool g_gemm_auto = true;
GemmMeasurement g_gemm_choice;
bool g_gemm_settled = false;
}  // namespace

void set_gemm_flag(const std::string& text) {
  g_gemm_auto = text == "auto";
  if (g_gemm_auto)
    set_gemm(GemmChoice::Auto);
  else
    restore_gemm(text);
}

const GemmMeasurement& settle_gemm(const ThreadConfig& threads) {
  // Silent: a refusal that follows (a policy or size the run cannot take) stays the only line.
  if (g_gemm_auto && !g_gemm_settled) g_gemm_choice = choose_gemm(threads);
  g_gemm_settled = true;
  return g_gemm_choice;
}

namespace {

// "9 of 10 rounds, or 17 of 20 when 10 left it undecided, or in most by 1.15x in the middle one":
// choose_gemm's rule.
std::string rounds_rule() {
  return fmt::format("{} of {} rounds, or {} of {} when {} left it undecided, or in most by {:g}x in the middle one",
                     kGemmRounds - kGemmRoundsLost, kGemmRounds, 2 * kGemmRounds - kGemmRoundsLostOfTwice,
                     2 * kGemmRounds, kGemmRounds, kGemmClearLead);
}

}  // namespace

std::string describe(const GemmMeasurement& m) {
  if (m.classes.empty()) return "";
  std::string out = fmt::format("  GEMM per class, by measurement: the BLAS unless another was faster in {} ({}):\n",
                                rounds_rule(), m.source);
  for (const GemmClassRates& c : m.classes) {
    std::string rates;
    for (const auto& [name, rate] : c.gflops)
      rates += fmt::format("{}{} {:.1f}", rates.empty() ? "" : ", ", name, rate);
    out += fmt::format("    {:<14} {:<13} (GFLOP/s: {})\n", c.product, c.chosen, rates);
  }
  auto pass = [&](const char* name) {
    for (const auto& [n, ms] : m.pass_ms)
      if (n == name) return ms;
    return 0.0;
  };
  if (m.pass_ms.size() == 2)
    out += fmt::format(
        "    linears on {}: a pass of every class took {:.1f} ms (median) with them on remat's kernel threads, {:.1f} "
        "ms on the BLAS's (the BLAS's threads only when faster in {})\n",
        m.classes.front().chosen == "blas-threads" ? "the BLAS's threads" : "remat's kernel threads",
        pass("kernel-threads"), pass("blas-threads"), rounds_rule());
  return out;
}

void progress(const std::string& line) {
  static const bool tty = isatty(fileno(stderr));
  if (tty)
    fmt::print(stderr, "\r\033[K{}", line);
  else
    fmt::print(stderr, "{}\n", line);
  std::fflush(stderr);
}

void end_progress() {
  if (isatty(fileno(stderr))) fmt::print(stderr, "\r\033[K");
}

std::string read_decimal(std::string& text, int64_t lo, uint64_t hi) {
  const std::string given = text;
  const bool negative = !text.empty() && text[0] == '-';
  const size_t sign = negative || (!text.empty() && text[0] == '+');
  if (text.size() == sign || text.find_first_not_of("0123456789", sign) != std::string::npos)
    return "'" + given + "' is not a decimal integer";
  const std::string digits = text.substr(std::min(text.find_first_not_of('0', sign), text.size() - 1));
  uint64_t magnitude = 0;
  const bool parsed = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude).ec == std::errc();
  // The most negative value's magnitude, written without overflowing int64_t.
  const uint64_t lowest = lo < 0 ? static_cast<uint64_t>(-(lo + 1)) + 1 : 0;
  if (!parsed || (negative && magnitude > lowest) || (!negative && magnitude > hi))
    return fmt::format("'{}' is out of range ({}..{})", given, lo, hi);
  text = (negative && magnitude != 0 ? "-" : "") + digits;
  return "";
}

bool reads_decimal(CLI::Option& o) {
  try {
    o.get_validator("decimal");
    return true;
  } catch (const CLI::OptionNotFound&) {
    return false;
  }
}

std::vector<std::string> split_list(const std::string& text, const char* flag, const char* allowed) {
  std::vector<std::string> items = split_fields(text, ',');
  for (const std::string& item : items)
    if (item.empty()) fail("{} '{}' has an empty item; write a comma-separated list of {}", flag, text, allowed);
  return items;
}

std::string duration(double s) {
  const int64_t t = static_cast<int64_t>(s);
  return t >= 60 ? fmt::format("{}m{:02d}s", t / 60, static_cast<int>(t % 60)) : fmt::format("{}s", t);
}

}  // namespace remat::cli
