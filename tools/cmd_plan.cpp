// remat plan: the fastest policy whose true peak memory fits a budget, in one process (--budget),
// or the layouts of a multi-GPU run that fit each GPU (--gpus, --device, --tp/--pp/--dp ...).
#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/report.h"
#include "cli.h"
#include "remat/block.h"
#include "remat/costs.h"
#include "remat/error.h"
#include "remat/layout.h"
#include "remat/planner.h"
#include "remat/policy.h"
#include "remat/resolve.h"
#include "remat/runtime.h"
#include "remat/units.h"
#include "util/paths.h"

namespace remat::cli {

namespace {

struct PlanFlags {
  ShapeFlags shape;
  std::string budget, pins, costs = "auto", threads, json;
  // Layouts of a multi-GPU run.
  std::string device, policies = "none,attn,attn+mlp-act,full,auto", grad_dtype = "fp32", reserve;
  std::string tokens;
  int64_t gpus = 0, tp = 0, pp = 0, vpp = 0, dp = 0, micro_batch = 0, global_batch = 0, cp = 1, ep = 0, etp = 0;
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  std::string framework = "megatron", cublas_workspace, fsdp_root = "reshard", dispatcher = "allgather";
  bool no_batch_mask = false, no_fused_wgrad = false, no_grouped_gemm = false, deterministic = false,
       expandable_segments = false, fsdp = false, pure_bf16 = false;
  int zero = -1, top = 5;
  int64_t optimizer_instances = 1;
  bool sp = false;
  CLI::App* app = nullptr;

  bool layouts() const {
    for (const char* f : {"--device",
                          "--gpus",
                          "--tp",
                          "--pp",
                          "--vpp",
                          "--dp",
                          "--zero",
                          "--optimizer-instances",
                          "--sp",
                          "--micro-batch",
                          "--global-batch",
                          "--policies",
                          "--grad-dtype",
                          "--reserve",
                          "--top",
                          "--tokens",
                          "--cp",
                          "--framework",
                          "--no-batch-mask",
                          "--no-fused-wgrad",
                          "--no-grouped-gemm",
                          "--deterministic",
                          "--dispatcher",
                          "--cublas-workspace",
                          "--expandable-segments",
                          "--fsdp",
                          "--fsdp-root",
                          "--pure-bf16",
                          "--first-stage-layers",
                          "--last-stage-layers",
                          "--ep",
                          "--etp"})
      if (app->count(f) > 0) return true;
    return false;
  }
};

nlohmann::json memory_json(const StepMemory& s) {
  return {{"params", s.params},
          {"expert_params", s.expert_params},
          {"grads", s.grads},
          {"optimizer", s.optimizer},
          {"data", s.data},
          {"buffers", s.buffers},
          {"fixed", s.fixed},
          {"saved", s.saved},
          {"peak", s.peak},
          {"total_peak", s.total_peak()},
          {"allocated_peak", s.allocated_peak},
          {"reserved_peak", s.reserved_peak},
          {"peak_at", s.peak_at}};
}

// ---- one process -------------------------------------------------------------------------------

// The one-process plan as JSON (also when it cannot be met).
// A plan that does not fit is refused, as a rule before any op cost is measured
// (plan_on_placeholder_costs): its JSON holds the bytes, which do not depend on the costs, and no times.
nlohmann::json single_plan_json(const ModelConfig& cfg, const Budget& budget, const Plan& p, const CostModel& costs) {
  nlohmann::json j;
  j["config"] = model_json(cfg);
  j["budget"] = p.budget;
  j["budget_text"] = to_string(budget);
  j["fits"] = p.fits;
  j["memory"] = memory_json(p.memory);
  j["none_memory"] = memory_json(p.none_memory);
  if (!p.fits) {
    j["min_budget"] = p.min_budget;
    return j;
  }
  j["policy"] = p.policy_text;
  j["step_s"] = p.step_ms / 1e3;
  j["none_step_s"] = p.none_step_ms / 1e3;
  j["costs"] = costs.source;
  j["frontier"] = nlohmann::json::array();
  for (const BlockOption& o : p.frontier)
    j["frontier"].push_back({{"option", o.text},
                             {"saved_bytes", o.saved},
                             {"recompute_ms", o.recompute_ms},
                             {"forward_extra", o.forward_extra},
                             {"backward_extra", o.backward_extra}});
  return j;
}

// A plan that fits: its memory and step time beside none's, its policy, and the block's frontier.
void print_single_plan(const Plan& p) {
  const StepMemory &n = p.none_memory, &m = p.memory;
  Table mem;
  mem.header = {"predicted", "none", "plan"};
  mem.numeric = {false, true, true};
  mem.rows = {{"weights", bytes_str(n.params), bytes_str(m.params)},
              {"optimizer state", bytes_str(n.optimizer), bytes_str(m.optimizer)},
              {"data", bytes_str(n.data), bytes_str(m.data)},
              {"saved after forward", bytes_str(n.saved), bytes_str(m.saved)},
              {"peak above that (activations, gradients)", bytes_str(n.peak), bytes_str(m.peak)},
              {"total peak", bytes_str(n.total_peak()), bytes_str(m.total_peak())},
              {"budget", "", bytes_str(p.budget)},
              {"step time", seconds_str(p.none_step_ms / 1e3),
               fmt::format("{} ({:+.1f}%)", seconds_str(p.step_ms / 1e3), 100.0 * (p.step_ms / p.none_step_ms - 1.0))}};
  fmt::print("{}\n  peak at: {}\n\n  policy: {}\n\n", mem.markdown(), m.peak_at, p.policy_text);

  Table front;
  front.header = {"block option (one layer)", "saved", "recompute ms", "forward extra", "backward extra"};
  front.numeric = {false, true, true, true, true};
  for (const BlockOption& o : p.frontier)
    front.rows.push_back({o.text, bytes_str(o.saved), fmt::format("{:.2f}", o.recompute_ms), bytes_str(o.forward_extra),
                          bytes_str(o.backward_extra)});
  fmt::print("block frontier (no option beats another on saved bytes, time and working sets):\n\n{}\n",
             front.markdown());
}

int run_single(PlanFlags& f) {
  const ModelConfig cfg = f.shape.resolve();
  if (f.app->count("--expert-imbalance") > 0)
    fail(
        "--expert-imbalance sizes the busiest expert-parallel rank's tokens; a one-process plan has every expert "
        "on one rank: plan a cluster (--gpus N --device D) to use it");
  if (f.budget.empty())
    fail(
        "--budget is required, e.g. --budget 300MiB, --budget 2GB or --budget 60%; or plan a multi-GPU run with "
        "--gpus N --device D");
  const Budget budget = parse_budget(f.budget);
  const CostSource source = parse_cost_source(f.costs);
  FileRoles files;
  files.input("--model-config", f.shape.model_config);
  files.output("--json", f.json);
  files.check();
  if (!f.json.empty()) check_writable(f.json);
  const ModelSpec spec = make_model(cfg);
  const LayerPolicy pins = f.pins.empty() ? keep_everything(spec.block) : Policy::parse_pins(f.pins, spec.block);
  const ThreadConfig threads = f.threads.empty() ? default_threads() : parse_threads(f.threads);
  auto write_json = [&](const Plan& plan, const CostModel& costs) {
    if (f.json.empty()) return;
    write_file_atomic(f.json, single_plan_json(cfg, budget, plan, costs).dump(2) + "\n");
    fmt::print("wrote {}\n", f.json);
  };
  // A budget no policy meets is a refusal: one line on stderr, nothing on stdout but the JSON asked for.
  auto refuse = [&](const Plan& unmet, const CostModel& costs) {
    write_json(unmet, costs);
    const auto [asked, least] = bytes_pair_str(unmet.budget, unmet.min_budget);
    fail(
        "budget {} ({}) cannot be met: the smallest peak any policy reaches is {} (weights {}, gradients and "
        "activations {}, optimizer {}, data {})",
        f.budget, asked, least, bytes_str(unmet.memory.params), bytes_str(unmet.memory.peak),
        bytes_str(unmet.memory.optimizer), bytes_str(unmet.memory.data));
  };
  // Whether it is met does not depend on the op costs: asked before they are measured.
  if (const Plan unmet = plan_on_placeholder_costs(cfg, spec, budget, pins, threads); !unmet.fits) refuse(unmet, {});
  const CostModel costs = choose_costs(cfg, source, threads);

  const auto t0 = std::chrono::steady_clock::now();
  const Plan p = make_plan(cfg, budget, costs, pins);
  const double planned_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!p.fits) refuse(p, costs);
  fmt::print("remat plan: {} | budget {}\n", describe(cfg), to_string(budget));
  fmt::print("  costs: {}\n  planned in {:.0f} ms\n\n", costs.source, planned_ms);
  print_single_plan(p);
  write_json(p, costs);
  return 0;
}

// ---- layouts of a multi-GPU run ------------------------------------------------------------------

// A path rather than a preset or custom:... (parse_device's order).
bool is_device_file(const std::string& text) {
  for (const std::string& n : device_names())
    if (text == n) return false;
  return text.rfind("custom:", 0) != 0;
}

// "300B", "1.4T", "2e9": tokens to train on.
double parse_tokens(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.' || text[i] == 'e'))
    ++i;
  char* end = nullptr;
  const std::string num = text.substr(0, i);
  const double v = num.empty() ? -1 : std::strtod(num.c_str(), &end);
  const std::string unit = text.substr(i);
  const double scale = unit.empty()  ? 1
                       : unit == "K" ? 1e3
                       : unit == "M" ? 1e6
                       : unit == "B" ? 1e9
                       : unit == "T" ? 1e12
                                     : -1;
  if (num.empty() || end != num.c_str() + num.size() || !(v > 0) || !std::isfinite(v) || scale < 0)
    fail("bad --tokens '{}'; write a count such as 300B, 1.4T or 2e9 (units K, M, B, T)", text);
  return v * scale;
}

// What a layout's plan counts outside PyTorch's allocator on each GPU: outside_allocator's named
// terms, or the --reserve given instead.
nlohmann::json outside_json(const PlanOptions& opt, const Device& device, const ModelConfig& cfg, const Layout& l) {
  nlohmann::json out = nlohmann::json::array();
  if (opt.reserve >= 0) {
    out.push_back({{"name", "--reserve"}, {"bytes", opt.reserve}, {"why", "given on the command line"}});
    return out;
  }
  for (const Allocation& a : outside_allocator(opt, device, cfg, l))
    out.push_back({{"name", a.name}, {"bytes", a.bytes}, {"why", a.why}});
  return out;
}

// One layout's plan as JSON, with what lies outside the allocator (outside_json); `experts`: the
// model routes experts (the text names ep and etp).
nlohmann::json plan_json(const LayoutPlan& p, bool experts, const nlohmann::json& outside) {
  const Layout& l = p.layout;
  nlohmann::json stages = nlohmann::json::array();
  for (const RankPlan& r : p.ranks) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const LayerRange& c : r.chunks) chunks.push_back({c.first, c.end});
    nlohmann::json fixed = nlohmann::json::array();
    for (const Allocation& a : r.fixed) fixed.push_back({{"name", a.name}, {"bytes", a.bytes}, {"why", a.why}});
    stages.push_back({{"stage", r.stage},
                      {"layers", chunks},
                      {"policy", r.policy},
                      {"memory", memory_json(r.memory)},
                      {"fixed", fixed},
                      {"parameters", r.params},
                      {"headroom", p.budget - r.memory.total_peak()},
                      {"micro_batch_s", r.micro_ms / 1e3}});
  }
  const LayoutTime& t = p.time;
  return {{"layout",
           {{"tp", l.tp},
            {"sp", l.sp},
            {"cp", l.cp},
            {"fsdp", l.fsdp},
            {"pp", l.pp},
            {"vpp", l.vpp},
            {"first_stage_layers", l.first_layers},
            {"last_stage_layers", l.last_layers},
            {"dp", l.dp},
            {"ep", l.ep},
            {"etp", l.etp},
            {"zero", l.zero},
            {"optimizer_instances", l.optimizer_instances},
            {"micro_batch", l.micro_batch},
            {"global_batch", l.batch()},
            {"micro_batches", l.micro_batches()},
            {"grad_bytes", l.grad_bytes},
            {"gpus", l.gpus()},
            {"text", to_string(l, experts)}}},
          {"policy", p.policy},
          {"fits", p.fits},
          {"parameters", p.params},
          {"margin", p.margin},
          {"reserved_uncertainty", kReservedUncertainty},
          {"reserved_tight", p.reserved_tight},
          {"budget", p.budget},
          {"peak", p.peak()},
          {"worst_stage", p.rank().stage},
          {"stages", stages},
          {"outside_allocator", outside},
          {"time",
           {{"step_s", t.step_s},
            {"compute_s", t.compute_s},
            {"recompute_s", t.recompute_s},
            {"tp_comm_s", t.tp_comm_s},
            {"bubble_s", t.bubble_s},
            {"p2p_s", t.p2p_s},
            {"dp_comm_s", t.dp_comm_s},
            {"dp_exposed_s", t.dp_exposed_s},
            {"optimizer_s", t.optimizer_s},
            {"mfu", t.mfu},
            {"tokens_per_s", t.tokens_per_s}}}};
}

// What LayoutTime::tp_comm_s holds on layout `l`: its tensor-parallel collectives, expert
// all-to-alls and the context-parallel ring's sends the attention does not hide.
std::string comm_name(const Layout& l) {
  std::vector<std::string> parts;
  if (l.tp > 1 || (l.ep == 1 && l.cp == 1)) parts.emplace_back("tensor-parallel collectives");
  if (l.ep > 1) parts.emplace_back("expert all-to-alls");
  if (l.cp > 1) parts.emplace_back("context-parallel ring sends not hidden");
  return fmt::format("{}", fmt::join(parts, ", "));
}

// The best layout's step: where its time and each stage's bytes go.
void print_breakdown(const LayoutPlan& p, const ModelConfig& cfg, const PlanOptions& opt, double tokens,
                     const Device& device) {
  const bool experts = routes_experts(cfg.arch), opt_reserve_given = opt.reserve >= 0 || opt.budget > 0;
  const LayoutTime& t = p.time;
  const bool pipeline = p.layout.pp > 1;
  fmt::print("\n{} with {}:\n\n", to_string(p.layout, experts),
             p.policy == "auto" ? "auto (each stage planned)" : p.policy);
  Table m;
  m.header = {p.layout.gpus() > 1 || p.layout.pp > 1 ? "per GPU" : "memory",
              "weights",
              "gradients",
              "optimizer",
              "step's peak",
              "fixed + data",
              "total",
              "headroom"};
  m.numeric = {false, true, true, true, true, true, true, true};
  // Every stage up to 8; beyond, the first two, the most loaded and the last (--json has all).
  std::vector<size_t> shown;
  for (size_t i = 0; i < p.ranks.size(); ++i)
    if (p.ranks.size() <= 8 || i < 2 || i + 1 == p.ranks.size() || static_cast<int>(i) == p.worst) shown.push_back(i);
  for (size_t k = 0; k < shown.size(); ++k) {
    const RankPlan& r = p.ranks[shown[k]];
    const StepMemory& s = r.memory;
    std::string name = pipeline ? fmt::format("stage {}", r.stage) : "every GPU";
    if (static_cast<int>(shown[k]) == p.worst && pipeline) name += " (most)";
    // Gradients kept between steps are in the persistent buffers; FSDP2's sharded ones are made and
    // freed within the step, counted in its peak.
    const std::string grads = s.buffers >= s.grads ? bytes_str(s.grads) : "in step's peak";
    m.rows.push_back({name, bytes_str(s.params), grads, bytes_str(s.optimizer), bytes_str(s.peak),
                      bytes_str(std::max<int64_t>(0, s.buffers - s.grads) + s.data + s.fixed),
                      bytes_str(s.total_peak()), bytes_str(p.budget - s.total_peak())});
    if (k + 1 < shown.size() && shown[k + 1] > shown[k] + 1)
      m.rows.push_back({fmt::format("stages {}-{}", p.ranks[shown[k] + 1].stage, p.ranks[shown[k + 1] - 1].stage),
                        "(in --json)", "", "", "", "", "", ""});
  }
  fmt::print("{}\n", m.markdown());
  fmt::print(
      "  step's peak: what the step adds at its highest: activations, and the gradients and optimizer "
      "temporaries not kept in persistent buffers\n");
  std::string fixed;
  for (const Allocation& a : p.rank().fixed)
    if (a.bytes > 0) fixed += fmt::format("{}{} {}", fixed.empty() ? "" : ", ", a.name, bytes_str(a.bytes));
  if (!fixed.empty()) fmt::print("  fixed{}: {}\n", pipeline ? fmt::format(" (stage {})", p.rank().stage) : "", fixed);
  std::string outside;
  for (const Allocation& a : outside_allocator(opt, device, cfg, p.layout))
    outside += fmt::format("{}{} {}", outside.empty() ? "" : ", ", a.name, bytes_str(a.bytes));
  if (!outside.empty() && !opt_reserve_given)
    fmt::print("  outside PyTorch's allocator: {}; budget {}\n", outside, bytes_str(p.budget));
  const Layout& l = p.layout;
  const bool sharded = l.fsdp || l.zero >= 3;
  fmt::print("  parameters: {:.4g}B in all; stage {}'s {:.4g}B{} on each GPU\n", static_cast<double>(p.params) / 1e9,
             p.rank().stage, static_cast<double>(p.rank().params) / 1e9,
             sharded ? fmt::format(", a 1/{} shard of them", l.shards())
                     : std::string(l.tp > 1 ? " (its tensor-parallel share)" : ""));
  fmt::print("  peak{}: {} = {} B, at the {}\n", pipeline ? fmt::format(" (stage {})", p.rank().stage) : "",
             bytes_str(p.peak()), p.peak(), p.rank().memory.peak_at);
  if (p.policy == "auto") {
    fmt::print("  recompute per stage:\n");
    for (size_t i : shown)
      fmt::print("    {}: {}\n", pipeline ? fmt::format("stage {}", p.ranks[i].stage) : "every GPU", p.ranks[i].policy);
  }
  fmt::print(
      "\n  step {}: compute {} on the slowest stage (recompute {}, {} {}), pipeline "
      "bubble {}, pipeline sends {}, data-parallel reduction {} ({} not hidden), optimizer {}\n",
      seconds_str(t.step_s), seconds_str(t.compute_s), seconds_str(t.recompute_s), comm_name(p.layout),
      seconds_str(t.tp_comm_s), seconds_str(t.bubble_s), seconds_str(t.p2p_s), seconds_str(t.dp_comm_s),
      seconds_str(t.dp_exposed_s), seconds_str(t.optimizer_s));
  fmt::print("  MFU {:.1f}%, {:.0f} tokens/s", 100 * t.mfu, t.tokens_per_s);
  if (tokens > 0) fmt::print(", {} tokens in {}", fmt::format("{:.3g}", tokens), seconds_str(tokens / t.tokens_per_s));
  fmt::print("\n");
}

// The flags a multi-GPU plan checks before it reads the device.
void check_layout_flags(const PlanFlags& f, const ModelConfig& cfg) {
  if (f.device.empty())
    fail("--device is required to plan a multi-GPU run; allowed: {}, custom:..., or a JSON file",
         fmt::join(device_names(), ", "));
  for (const char* flag : {"--costs", "--pins", "--threads"})
    if (f.app->count(flag) > 0)
      fail(
          "{} is for a one-process plan (no --device, --gpus or other layout flag); a multi-GPU plan takes no {}: "
          "leave it out",
          flag, flag);
  if (f.app->count("--budget") > 0 && f.app->count("--reserve") > 0)
    fail("--budget and --reserve both set the memory a GPU may use; give one");
  if (f.grad_dtype != "fp32" && f.grad_dtype != "bf16" && f.grad_dtype != "fp16")
    fail("bad --grad-dtype '{}'; allowed: fp32 (Megatron's main_grad), bf16, fp16 (the ZeRO paper's)", f.grad_dtype);
  if (f.top < 1 || f.top > 100) fail("--top must be in 1..100, got {}", f.top);
  // 0 is the library's "searched"; given as a flag it is a mistake (leaving the flag out searches).
  for (const char* flag : {"--gpus", "--tp", "--pp", "--vpp", "--dp", "--micro-batch", "--cp", "--ep", "--etp",
                           "--first-stage-layers", "--last-stage-layers"})
    if (f.app->count(flag) > 0) {
      const int64_t v = f.app->get_option(flag)->as<int64_t>();
      if (v < 1 || v > kMostGpus)
        fail("{} must be in 1..{}, got {}; leave it out to {}", flag, kMostGpus, v,
             std::string_view(flag) == "--etp" ? "follow tp" : "search");
    }
  if ((f.app->count("--first-stage-layers") > 0) != (f.app->count("--last-stage-layers") > 0))
    fail(
        "--first-stage-layers and --last-stage-layers split a pipeline together: give both (the middle stages "
        "share the other layers evenly)");
  FileRoles files;
  files.input("--model-config", f.shape.model_config);
  if (is_device_file(f.device)) files.input("--device", f.device);
  files.output("--json", f.json);
  files.check();
  if (!f.json.empty()) check_writable(f.json);
  if (f.device != "cpu") {
    // On a GPU the micro-batch is searched (or --micro-batch), the step's sequences --global-batch.
    if (f.app->count("--batch") > 0)
      fail("--batch sizes a one-process plan; a multi-GPU plan takes --micro-batch and --global-batch");
    return;
  }
  // Before parse_device, which calibrates this machine once.
  for (const char* flag : {"--tp", "--pp", "--vpp", "--sp", "--ep", "--etp", "--cp", "--zero", "--optimizer-instances"})
    if (f.app->count(flag) > 0 && (std::string(flag) == "--sp" ? f.sp : f.app->get_option(flag)->as<int64_t>() > 1))
      fail(
          "{} is a GPU layout; --device cpu plans remat's own trainer (data parallel, optimizer state sharded over "
          "all ranks): leave {} out, or plan a GPU --device",
          flag, flag);
  for (const char* flag :
       {"--framework", "--no-batch-mask", "--no-fused-wgrad", "--deterministic", "--dispatcher", "--no-grouped-gemm",
        "--fsdp", "--fsdp-root", "--pure-bf16", "--expandable-segments", "--cublas-workspace", "--grad-dtype"})
    if (f.app->count(flag) > 0)
      fail(
          "{} describes a GPU framework or PyTorch's allocator; --device cpu plans remat's own trainer: leave {} "
          "out, or plan a GPU --device",
          flag, flag);
  if (cfg.dtype != DType::F32)
    fail("--dtype {}: --device cpu plans remat's own trainer, which trains fp32", to_string(cfg.dtype));
}

// A size flag, positive, in bytes; `none` when not given. example: "such as 2GiB".
int64_t size_flag(const std::string& text, const char* flag, const char* example, int64_t none) {
  if (text.empty()) return none;
  Budget b;
  try {
    b = parse_budget(text);
  } catch (const Error&) {}  // named below: parse_budget's message speaks of a budget, and offers a share
  if (b.bytes <= 0) fail("{} takes a size {}, got '{}'", flag, example, text);
  return b.bytes;
}

PlanOptions plan_options(const PlanFlags& f) {
  PlanOptions opt;
  opt.framework = parse_framework(f.framework);
  opt.batch_mask = !f.no_batch_mask;
  opt.fused_wgrad = !f.no_fused_wgrad;
  opt.grouped_gemm = !f.no_grouped_gemm;
  opt.deterministic = f.deterministic;
  if (f.dispatcher != "allgather" && f.dispatcher != "alltoall")
    fail("--dispatcher '{}': allowed are allgather (Megatron-LM's default) and alltoall", f.dispatcher);
  opt.allgather_dispatch = f.dispatcher == "allgather";
  opt.expandable_segments = f.expandable_segments;
  if (f.fsdp_root != "reshard" && f.fsdp_root != "keep")
    fail("--fsdp-root '{}': allowed are reshard (PyTorch 2.8 and later) and keep (before 2.8)", f.fsdp_root);
  opt.fsdp_root_reshard = f.fsdp_root == "reshard";
  opt.pure_dtype = f.pure_bf16;
  opt.cublas_workspace = size_flag(f.cublas_workspace, "--cublas-workspace", "such as 32MiB", opt.cublas_workspace);
  opt.reserve = size_flag(f.reserve, "--reserve", "such as 2GiB", opt.reserve);
  opt.budget = size_flag(f.budget, "--budget with --device", "per GPU such as 70GiB", opt.budget);
  return opt;
}

// The layouts to search: what the flags fix, the rest searched (sized by size_space).
// The default policies a search leaves out: those with nothing to drop in the block, and why.
struct LeftOut {
  std::vector<std::string> policies;
  std::string reason;  // the first one's
};

// Each policy resolved for the block as the search will, before any work: one the user lists is
// refused; one of the default list that cannot run there (attn and attn+mlp-act under flash
// attention, which keeps no T x T tensor) is left out, named in `left_out`.
SearchSpace search_space(const PlanFlags& f, const ModelConfig& cfg, const PlanOptions& opt, LeftOut& left_out) {
  SearchSpace space;
  space.policies = split_policy_list(f.policies);
  if (space.policies.empty()) fail("--policies needs at least one policy, e.g. none,attn,full,auto");
  const bool listed = f.app->count("--policies") > 0;
  const BlockSpec block = make_block(cfg);
  std::vector<std::string> kept;
  for (const std::string& p : space.policies) try {
      if (p != "auto") (void)resolve_layout_policy(p, block, cfg.layers);
      kept.push_back(p);
    } catch (const Error& e) {
      if (listed) throw;
      if (left_out.policies.empty()) left_out.reason = e.what();
      left_out.policies.push_back(p);
    }
  space.policies = kept;
  // --pure-bf16 keeps the gradients in the model's dtype as well.
  space.grad_bytes = cfg.dtype == DType::F32 || (f.grad_dtype == "fp32" && !opt.pure_dtype) ? 4 : 2;
  space.tp = f.tp, space.pp = f.pp, space.dp = f.dp, space.vpp = f.vpp, space.micro_batch = f.micro_batch;
  space.cp = f.cp;
  space.ep = f.ep;
  space.etp = f.etp;
  space.first_layers = f.first_stage_layers, space.last_layers = f.last_stage_layers;
  space.fsdp = f.fsdp || opt.framework == Framework::Torchtitan;
  if (space.fsdp && f.zero > 0)
    fail(
        "--zero {} with FSDP (--fsdp, --framework torchtitan): FSDP2 shards weights, gradients and optimizer state "
        "itself; leave --zero out",
        f.zero);
  if (space.fsdp) space.zero = {0};
  for (const char* flag :
       {"--no-batch-mask", "--no-fused-wgrad", "--no-grouped-gemm", "--deterministic", "--dispatcher"})
    if (opt.framework != Framework::Megatron && f.app->count(flag) > 0)
      fail("{} describes Megatron-LM; --framework {} has no such setting: leave it out", flag,
           to_string(opt.framework));
  if (f.no_grouped_gemm && !routes_experts(cfg.arch))
    fail("--no-grouped-gemm: --arch {} has no experts; it applies to --arch moe", cfg.arch);
  if (f.app->count("--dispatcher") > 0 && !routes_experts(cfg.arch))
    fail("--dispatcher: --arch {} has no experts to dispatch tokens to; it applies to --arch moe", cfg.arch);
  if (f.app->count("--fsdp-root") > 0 && !space.fsdp)
    fail("--fsdp-root sets FSDP2's root unit; this plan does not shard with FSDP2 (--fsdp, --framework torchtitan)");
  if (f.app->count("--grad-dtype") > 0 && f.grad_dtype != "fp32" && cfg.dtype == DType::F32)
    fail("--grad-dtype {} is for mixed precision; --dtype fp32 keeps fp32 gradients", f.grad_dtype);
  if (f.app->count("--grad-dtype") > 0 && space.fsdp)
    fail(
        "--grad-dtype sets Megatron-LM's gradient buffers; FSDP2 (--fsdp, --framework torchtitan) reduce-scatters "
        "in its reduce dtype (fp32, or bf16 with --pure-bf16): leave --grad-dtype out");
  if (opt.pure_dtype && cfg.dtype != DType::BF16)
    fail("--pure-bf16 keeps weights, gradients and Adam state in bf16; give --dtype bf16 with it, not {}",
         to_string(cfg.dtype));
  if (opt.pure_dtype && f.app->count("--grad-dtype") > 0 && f.grad_dtype == "fp32")
    fail("--grad-dtype fp32 with --pure-bf16, which keeps every gradient in bf16: leave one out");
  if (opt.deterministic && !routes_experts(cfg.arch))
    fail("--deterministic changes only a mixture of experts' unpermute here; --arch {} has none: leave it out",
         cfg.arch);
  if (f.app->count("--expert-imbalance") > 0 && cfg.capacity_factor > 0)
    fail(
        "--expert-imbalance sizes dropless routing's busiest rank; --capacity-factor {} fixes every expert's rows: "
        "leave one out",
        cfg.capacity_factor);
  if (f.app->count("--expert-imbalance") > 0 && f.app->count("--ep") > 0 && f.ep == 1)
    fail("--expert-imbalance sizes the busiest expert-parallel rank; --ep 1 keeps every expert on each rank");
  space.zero_fixed = f.zero;
  if (f.optimizer_instances < 1 || f.optimizer_instances > kMostGpus)
    fail("--optimizer-instances must be in 1..{}, got {}", kMostGpus, f.optimizer_instances);
  if (f.optimizer_instances > 1 && (opt.framework != Framework::Megatron || f.fsdp))
    fail("--optimizer-instances {} splits Megatron-LM's distributed optimizer; {} has none: leave it out",
         f.optimizer_instances, f.fsdp ? "--fsdp" : "--framework " + std::string(to_string(opt.framework)));
  if (f.optimizer_instances > 1 && f.zero >= 0 && f.zero != 1)
    fail("--optimizer-instances {} splits Megatron-LM's distributed optimizer (--zero 1); got --zero {}",
         f.optimizer_instances, f.zero);
  // The instances split the dp x cp ranks, which divide the GPUs (by --dp x --cp where given).
  const int64_t ranks = f.dp > 0 ? f.dp * f.cp : f.gpus;
  if (f.optimizer_instances > 1 && ranks > 0 && ranks % f.optimizer_instances != 0)
    fail("--optimizer-instances {} must divide the data- x context-parallel ranks, {}: give a divisor of {}",
         f.optimizer_instances,
         f.dp > 0 ? fmt::format("--dp {} x --cp {}", f.dp, f.cp) : fmt::format("which divide --gpus {}", f.gpus),
         ranks);
  space.optimizer_instances = f.optimizer_instances;
  if (f.app->count("--sp") > 0) space.sp_fixed = f.sp ? 1 : 0;
  // torchtitan's tensor-parallel plan shards the norms' tokens (SequenceParallel) whenever tp > 1.
  space.sp_with_tp = opt.framework == Framework::Torchtitan;
  if (space.sp_with_tp && f.app->count("--sp") > 0 && !f.sp && f.tp != 1)
    fail(
        "--no-sp: torchtitan's tensor parallelism is always sequence-parallel (its plan shards the norms); leave it "
        "out");
  return space;
}

// The GPU count and the global batch: given, or what the flags and the device make.
// The GPU count: given, or what explicit --tp --pp --dp make; refused before the device is read
// (--device cpu calibrates this machine). Each flag is at most kMostGpus (checked), so the product
// is capped just past it as it goes, before it could overflow.
void size_gpus(SearchSpace& space, const PlanFlags& f) {
  int64_t product = 1;
  for (int64_t v : {f.tp > 0 ? f.tp : 1, f.cp, f.pp > 0 ? f.pp : 1, f.dp > 0 ? f.dp : 1})
    product = std::min(product * v, kMostGpus + 1);
  const std::string grid =
      fmt::format("--tp {}{} x --pp {} x --dp {}", f.tp, f.cp > 1 ? fmt::format(" x --cp {}", f.cp) : "", f.pp, f.dp);
  if (f.gpus == 0 && product > kMostGpus) fail("{} is more than {} GPUs", grid, kMostGpus);
  space.gpus = f.gpus > 0 ? f.gpus : product;
  if (f.gpus > 0 && f.tp > 0 && f.pp > 0 && f.dp > 0 && product != f.gpus)
    fail("{} is {} GPUs, not --gpus {}", grid,
         product > kMostGpus ? fmt::format("more than {}", kMostGpus) : std::to_string(product), f.gpus);
}

// The global batch, and the engine's fixed grid.
void size_space(SearchSpace& space, const PlanFlags& f, const ModelConfig& cfg, const Device& device) {
  space.global_batch = f.global_batch > 0 ? f.global_batch : f.shape.global_batch();
  if (device.engine && space.global_batch <= 0) space.global_batch = cfg.batch * (f.dp > 0 ? f.dp : space.gpus);
  if (space.global_batch <= 0)
    fail("--global-batch (sequences per optimizer step) is required: --model {} has no published one",
         f.shape.model.empty() ? "(none)" : f.shape.model);
  if (device.engine) {
    space.tp = 1, space.pp = 1;
    if (space.micro_batch == 0) space.micro_batch = cfg.batch;  // the engine's --batch is the micro-batch
  }
}

// What the plan assumes: the device, its rates, the memory a GPU may use, the margin.
void print_layout_header(const ModelConfig& cfg, const SearchSpace& space, const Device& device, const PlanOptions& opt,
                         const LeftOut& left_out) {
  fmt::print("remat plan: {} | {} x {} | {} tokens per step\n", describe(cfg), space.gpus, device.name,
             space.global_batch * cfg.seq);
  fmt::print("  device: {}\n", device.source);
  if (!left_out.policies.empty())
    fmt::print("  policies: {}; {} left out of the default list ({})\n", fmt::join(space.policies, ", "),
               fmt::join(left_out.policies, ", "), left_out.reason);
  if (!device.engine)
    fmt::print(
        "  assumed: matmuls at {:.0f}% of the peak, memory-bound ops at {:.0f}% of HBM bandwidth, collectives "
        "at {:.0f}% of link bandwidth; tensor-parallel collectives and pipeline sends not overlapped; the "
        "data-parallel reduction overlaps the last micro-batch's backward (ZeRO-2: every backward; ZeRO-3 "
        "and FSDP: every micro-batch's compute); gradients in {}\n",
        100 * device.matmul_efficiency, 100 * device.memory_efficiency, 100 * device.link_efficiency,
        space.fsdp ? (opt.pure_dtype ? "bf16, reduce-scattered by FSDP2" : "fp32, reduce-scattered by FSDP2")
        : space.grad_bytes == 4 ? "fp32 buffers"
                                : "16-bit buffers");
  else
    fmt::print(
        "  remat's own engine and trainer (remat train --nproc): exact to the byte against its tracker; step times "
        "leave out the data-parallel all-reduce (Gloo's rate here is not measured)\n");
  if (opt.budget > 0)
    fmt::print("  per {}: {} usable (given --budget)\n", device.engine ? "rank" : "GPU", bytes_str(opt.budget));
  else if (opt.reserve >= 0 || device.engine)
    fmt::print("  per {}: {} - {} {}\n", device.engine ? "rank" : "GPU", bytes_str(device.memory),
               bytes_str(opt.reserve >= 0 ? opt.reserve : kCpuReserve),
               device.engine ? "kept free for the system (--reserve)" : "given with --reserve");
  else {
    const std::vector<Allocation> outside = outside_allocator(opt, device, ModelConfig{}, Layout{});
    fmt::print(
        "  per GPU: {} less what lies outside PyTorch's allocator: the CUDA context {}, NCCL's buffers {} per "
        "ring communicator (tensor-, context-, data-parallel) and {} per point-to-point peer in a node ({} across "
        "nodes)\n",
        bytes_str(device.memory), bytes_str(outside.front().bytes), bytes_str(nccl_ring_bytes()),
        bytes_str(nccl_peer_bytes(true)), bytes_str(nccl_peer_bytes(false)));
  }
  if (!device.engine)
    fmt::print(
        "  margin: a stage's peak stays {:.0f}% under that (the validated uncertainty, docs/validation.md); "
        "reserved peaks within {:.0f}% of it are marked tight\n",
        100 * (opt.margin >= 0 ? opt.margin : kAllocatedUncertainty), 100 * kReservedUncertainty);
}

// A search's answer and, when nothing fits, what would.
struct LayoutAnswer {
  SearchResult res;
  double searched_s = 0;
  int64_t fewest = 0;                      // the fewest GPUs that fit (nothing fits)
  std::vector<std::string> other_devices;  // the devices that fit at this count (nothing fits)
};

LayoutAnswer answer_layouts(const ModelConfig& cfg, const SearchSpace& space, const Device& device, int top,
                            const PlanOptions& opt) {
  LayoutAnswer a;
  const auto t0 = std::chrono::steady_clock::now();
  a.res = search_layouts(cfg, space, device, top, opt);
  a.searched_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!a.res.best.empty()) return a;
  a.fewest = min_gpus(cfg, space, device, opt);
  if (!device.engine)
    for (const std::string& name : device_names()) {
      if (name == "cpu" || name == device.name) continue;
      const Device other = parse_device(name);
      if (opt.budget > other.memory) continue;  // a --budget is per GPU: one smaller cannot give it
      if (!search_layouts(cfg, space, other, 1, opt).best.empty()) a.other_devices.push_back(name);
    }
  return a;
}

nlohmann::json device_json(const Device& device) {
  return {{"name", device.name},
          {"memory", device.memory},
          {"bf16_tflops", device.bf16_tflops},
          {"fp32_tflops", device.fp32_tflops},
          {"hbm_gbps", device.hbm_gbps},
          {"intra_gbps", device.intra_gbps},
          {"inter_gbps", device.inter_gbps},
          {"gpus_per_node", device.gpus_per_node},
          {"source", device.source},
          {"assumed",
           {{"matmul_efficiency", device.matmul_efficiency},
            {"memory_efficiency", device.memory_efficiency},
            {"link_efficiency", device.link_efficiency}}}};
}

nlohmann::json layouts_json(const ModelConfig& cfg, const SearchSpace& space, const Device& device,
                            const LayoutAnswer& a, const PlanOptions& opt) {
  auto one = [&](const LayoutPlan& p) {
    return plan_json(p, routes_experts(cfg.arch), outside_json(opt, device, cfg, p.layout));
  };
  nlohmann::json j;
  j["config"] = model_json(cfg);
  j["device"] = device_json(device);
  j["gpus"] = space.gpus;
  if (!a.res.best.empty()) j["budget_per_gpu"] = a.res.best.front().budget;
  j["fits"] = !a.res.best.empty();
  j["searched_s"] = a.searched_s;
  j["layouts"] = nlohmann::json::array();
  for (const LayoutPlan& p : a.res.best) j["layouts"].push_back(one(p));
  if (a.res.best.empty()) {
    if (!a.res.least.ranks.empty()) j["least"] = one(a.res.least);
    j["min_gpus"] = a.fewest;
    j["devices_that_fit"] = a.other_devices;
  }
  return j;
}

// Nothing fits: the least a GPU would need, and what would fit instead.
[[noreturn]] void fail_no_layout(const ModelConfig& cfg, const SearchSpace& space, const Device& device,
                                 const LayoutAnswer& a) {
  std::string least = "no layout of these flags validates";
  if (!a.res.refused.empty()) least += fmt::format(" ({})", a.res.refused);
  if (!a.res.least.ranks.empty())
    least = fmt::format(
        "the smallest per-GPU peak is {} ({}, policy {}) against a budget of {}, which a peak stays "
        "{:.0f}% under",
        bytes_str(a.res.least.peak()), to_string(a.res.least.layout, routes_experts(cfg.arch)), a.res.least.policy,
        bytes_str(a.res.least.budget), 100 * a.res.least.margin);
  // (No layout at all validates: a value the flags fix, which no GPU count changes, or none of the
  // counts min_gpus found.)
  const std::string count =
      a.fewest > 0            ? fmt::format("; {} GPUs fit{}", a.fewest, space.dp > 0 ? " (with the dp they give)" : "")
      : a.res.candidates == 0 ? ""
                              : "; no count up to 65536 fits";
  fail(
      "{} x {} cannot train {}: {}{}{}", space.gpus, device.name, describe(cfg), least, count,
      a.other_devices.empty() ? "" : fmt::format("; at {} GPUs, {} fit", space.gpus, fmt::join(a.other_devices, ", ")));
}

// The fastest layouts that fit, one row each, and what "tight" means when a row is.
void print_layouts(const ModelConfig& cfg, const std::vector<LayoutPlan>& best, const Device& device) {
  Table t;
  t.header = {"#", "layout", "policy", "peak per GPU", "reserved", "headroom", "step", "MFU", "tokens/s"};
  t.numeric = {true, false, false, true, true, true, true, true, true};
  bool tight = false;
  int roomy = 0;  // the first (1-based) whose modelled reserved peak is under the budget
  for (size_t i = 0; i < best.size(); ++i) {
    const LayoutPlan& p = best[i];
    std::string policy = p.policy == "auto" ? "auto (per stage)" : p.policy;
    int64_t reserved = 0;
    for (const RankPlan& r : p.ranks) reserved = std::max(reserved, r.memory.reserved_peak);
    tight = tight || p.reserved_tight;
    if (roomy == 0 && reserved <= p.budget) roomy = static_cast<int>(i) + 1;
    t.rows.push_back({std::to_string(i + 1), to_string(p.layout, routes_experts(cfg.arch)), policy, bytes_str(p.peak()),
                      device.engine ? "-" : bytes_str(reserved) + (p.reserved_tight ? " (tight)" : ""),
                      bytes_str(p.budget - (device.engine ? p.peak() : reserved)), seconds_str(p.time.step_s),
                      fmt::format("{:.1f}%", 100 * p.time.mfu), fmt::format("{:.0f}", p.time.tokens_per_s)});
  }
  fmt::print("\n{}: {:.3g}B parameters\n", describe(cfg), static_cast<double>(best.front().params) / 1e9);
  fmt::print("\nfastest layouts that fit:\n\n{}", t.markdown());
  if (tight) {
    fmt::print(
        "(tight: the caching allocator's modelled reserved peak is within {:.0f}% of the budget, its validated "
        "uncertainty; over the budget, PyTorch frees its cache and retries, which is slow, and fragmentation "
        "can still run out of memory; --expandable-segments fragments less)\n",
        100 * kReservedUncertainty);
    if (roomy > 1) fmt::print("(the fastest with its reserved peak under the budget is #{})\n", roomy);
  }
}

int run_layouts(PlanFlags& f) {
  ModelConfig cfg = f.shape.resolve();
  // The GPU frameworks planned run fused attention (Transformer Engine's, PyTorch's SDPA): a causal
  // block gets flash attention unless --attention says math. remat's engine (--device cpu) runs math
  // by default, as bench and train do; a block that attends to every position runs math only.
  if (f.app->count("--attention") == 0 && f.device != "cpu" && attends_causally(cfg.arch))
    cfg.attention = AttentionImpl::Flash;
  // torchtitan computes its loss as PyTorch's cross_entropy(logits.float()) (components/loss.py).
  if (f.framework == "torchtitan" && f.shape.loss.empty() && cfg.dtype != DType::F32) cfg.loss = Loss::Upcast;
  check_layout_flags(f, cfg);
  const double tokens = f.tokens.empty() ? 0 : parse_tokens(f.tokens);
  const PlanOptions opt = plan_options(f);
  LeftOut left_out;
  SearchSpace space = search_space(f, cfg, opt, left_out);
  size_gpus(space, f);
  // The device's memory against the sizes given, before parse_device calibrates this machine (cpu).
  const auto check_sizes = [&](const std::string& name, int64_t memory) {
    if (opt.budget > memory)
      fail("--budget {} is more than device {} has ({}); give at most its memory", f.budget, name, bytes_str(memory));
    if (opt.reserve >= memory)
      fail("--reserve {} is all of device {}'s memory ({}) or more; give less", f.reserve, name, bytes_str(memory));
    if (opt.cublas_workspace >= memory)
      fail("--cublas-workspace {} is all of device {}'s memory ({}) or more; give less", f.cublas_workspace, name,
           bytes_str(memory));
  };
  if (f.device == "cpu") check_sizes("cpu", physical_memory());
  const Device device = parse_device(f.device);  // (cpu: calibrates this machine once)
  check_sizes(device.name, device.memory);
  size_space(space, f, cfg, device);
  const LayoutAnswer a = answer_layouts(cfg, space, device, f.top, opt);
  cfg.batch = space.global_batch;
  auto write_json = [&] {
    if (f.json.empty()) return;
    write_file_atomic(f.json, layouts_json(cfg, space, device, a, opt).dump(2) + "\n");
    fmt::print("wrote {}\n", f.json);
  };
  if (a.res.best.empty()) {  // a refusal: one line on stderr, nothing on stdout but the JSON asked for
    write_json();
    fail_no_layout(cfg, space, device, a);
  }
  print_layout_header(cfg, space, device, opt, left_out);
  fmt::print("  searched {} layouts ({} memory replays) in {:.2f} s\n", a.res.candidates, a.res.evaluated,
             a.searched_s);
  print_layouts(cfg, a.res.best, device);
  print_breakdown(a.res.best.front(), cfg, opt, tokens, device);
  write_json();
  return 0;
}

int run(PlanFlags& f) { return f.layouts() ? run_layouts(f) : run_single(f); }

// The multi-GPU layout's flags: the device, the GPUs and how they are split, the batch, the policies.
void add_layout_flags(CLI::App* a, PlanFlags* f) {
  a->add_option(
      "--device", f->device,
      fmt::format("plan a multi-GPU run on: {}, custom:MEM,TFLOPS,GBPS[,INTRA,INTER,PER_NODE], or a JSON file",
                  fmt::join(device_names(), ", ")));
  a->add_option("--gpus", f->gpus, "devices in all; searches the layouts (or say --tp --pp --dp)");
  a->add_option("--tp", f->tp, "tensor-parallel size (default: searched)");
  a->add_option("--ep", f->ep,
                "expert-parallel ranks, --arch moe: experts split over the data- x tensor-parallel ranks over etp "
                "(default: searched)");
  a->add_option("--etp", f->etp,
                "expert-tensor-parallel ranks, --arch moe: each expert's linears split over etp of the tp ranks "
                "(Megatron-LM's --expert-tensor-parallel-size; default: tp)");
  a->add_flag("--sp,!--no-sp", f->sp, "sequence parallelism on (or off) with tp > 1 (default: searched)");
  a->add_option("--cp", f->cp, "context-parallel ranks: the sequence split, attention in a ring (flash)")
      ->capture_default_str();
  a->add_option("--pp", f->pp, "pipeline stages, 1F1B (default: searched)");
  a->add_option("--vpp", f->vpp, "model chunks per pipeline stage, interleaved 1F1B (default: searched)");
  a->add_option("--first-stage-layers", f->first_stage_layers,
                "layers of the first pipeline stage, an uneven pipeline (with --last-stage-layers; default: even, or "
                "the first and last share what the middle stages' ceil(layers / pp) leave)");
  a->add_option("--last-stage-layers", f->last_stage_layers,
                "layers of the last pipeline stage (see --first-stage-layers)");
  a->add_option("--dp", f->dp, "data-parallel replicas (default: gpus / (tp pp))");
  a->add_option("--zero", f->zero,
                "ZeRO stage 0-3; 1 is Megatron's distributed optimizer (default: 0 and 1 searched; 2 and 3 are the "
                "ZeRO paper's accounting, not checked against a measured run)")
      ->transform(decimal_integer<int>());
  a->add_option("--optimizer-instances", f->optimizer_instances,
                "Megatron-LM's --num-distributed-optimizer-instances: the data- x context-parallel ranks split into N "
                "instances of the distributed optimizer, each sharding its state over its own ranks (implies --zero 1)")
      ->capture_default_str();
  a->add_option("--micro-batch", f->micro_batch, "sequences per micro-batch (default: searched over 1, 2, 4, 8)");
  a->add_option("--global-batch", f->global_batch,
                "sequences per optimizer step (default: the --model's published one)");
  a->add_option("--policies", f->policies,
                "recompute policies to try, comma-separated; auto plans each stage (by default, those listed with "
                "something to drop in the block)")
      ->capture_default_str();
  a->add_option("--grad-dtype", f->grad_dtype, "gradient buffers: fp32 (Megatron) or bf16/fp16 (the ZeRO paper)")
      ->capture_default_str();
  a->add_option("--reserve", f->reserve,
                "memory per GPU outside PyTorch's allocator (default: the CUDA context and NCCL's buffers, named in "
                "the plan; on the CPU 2GiB for the system)");
  a->add_option("--top", f->top, "layouts to list")->transform(decimal_integer<int>())->capture_default_str();
  a->add_option("--tokens", f->tokens, "tokens to train on (300B, 1.4T): prints the run's time");
}

// What runs on each GPU: the framework and the settings of it that move memory.
void add_framework_flags(CLI::App* a, PlanFlags* f) {
  a->add_option("--framework", f->framework,
                "what runs on each GPU: megatron (Megatron-LM with Transformer Engine) or torchtitan (at 9dec370, "
                "December 2024: FSDP2, foreach AdamW, eager ops)")
      ->capture_default_str();
  a->add_flag("--no-batch-mask", f->no_batch_mask,
              "megatron: the dataloader puts no attention mask on the GPU (--no-create-attention-mask-in-dataloader)");
  a->add_flag("--no-fused-wgrad", f->no_fused_wgrad,
              "megatron: weight gradients are made in bf16, then added to the fp32 buffers "
              "(--no-gradient-accumulation-fusion)");
  a->add_flag("--deterministic", f->deterministic,
              "megatron: PyTorch's deterministic algorithms (--deterministic-mode); a mixture of experts' unpermute "
              "then keeps the experts' outputs for its backward (index_add)");
  a->add_option(
       "--dispatcher", f->dispatcher,
       "megatron, moe: the token dispatcher (--moe-token-dispatcher-type): allgather keeps the expert-parallel "
       "group's gathered tokens in a buffer, alltoall does not")
      ->capture_default_str();
  a->add_flag("--no-grouped-gemm", f->no_grouped_gemm,
              "megatron, moe: one GEMM per local expert (SequentialMLP, Megatron-LM without --moe-grouped-gemm)");
  a->add_flag("--fsdp", f->fsdp,
              "shard with FSDP2 (fully_shard per block; torchtitan's, and --framework torchtitan's)");
  a->add_option("--fsdp-root", f->fsdp_root,
                "FSDP2's root unit (embedding, final norm, head) after the forward: reshard (PyTorch 2.8 and later, "
                "given reshard_after_forward=True as torchtitan passes) or keep (PyTorch before 2.8)")
      ->capture_default_str();
  a->add_flag("--pure-bf16", f->pure_bf16,
              "no fp32 copies: weights, gradients and Adam state in bf16 (as torchtune keeps them; its trainer itself "
              "is not modelled)");
  a->add_flag("--expandable-segments", f->expandable_segments,
              "PyTorch's allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)");
  a->add_option("--cublas-workspace", f->cublas_workspace,
                "PyTorch's cuBLAS workspace per stream, as CUBLAS_WORKSPACE_CONFIG sets it (default: PyTorch's for the "
                "device)");
}

}  // namespace

Command add_plan(CLI::App& parent) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* a = parent.add_subcommand(
      "plan", "find the fastest policy that fits a budget, or the layouts of a multi-GPU run that fit each GPU");
  f->app = a;
  f->shape.cfg.arch = "gpt2";
  f->shape.add(a);
  f->shape.add_planning(a);
  a->get_option("--attention")
      ->description(
          "math (T x T scores and probabilities) or flash (one fused op, no T x T); default: flash with a GPU "
          "--device (a causal block), as the frameworks planned run it, else math")
      ->default_str("");
  a->add_option("--budget", f->budget,
                "one process: total peak memory, e.g. 300MiB, 2GB, 1.5GiB, or 60% (of none's activations and "
                "gradients, above weights, optimizer and data); with --device: bytes per GPU");
  a->add_option("--pins", f->pins, "choices the plan must keep, e.g. keep:qkv+drop:fc");
  a->add_option("--costs", f->costs, "auto (measure when a layer runs here quickly), measured, estimated")
      ->capture_default_str();
  a->add_option("--threads", f->threads, "ATen/BLAS threads for measuring, e.g. 1/2");
  a->add_option("--json", f->json, "write the plan as JSON (also when it cannot be met)");
  add_layout_flags(a, f.get());
  add_framework_flags(a, f.get());
  return {a, nullptr, [f] { return run(*f); }};  // plan re-executes itself only under --gemm blas
}

}  // namespace remat::cli
