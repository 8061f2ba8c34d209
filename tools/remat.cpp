// remat: the command-line tool. Each subcommand (cmd_*.cpp) parses its flags, prints its
// configuration and calls the library; main maps errors to exit codes (0 success, 1 a run that
// failed, 2 bad input) and the library's API names to the flags that set them.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>

#include "cli.h"
#include "remat/blas_kernel.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/runtime.h"
#include "remat/version.h"

namespace {

// "ModelConfig.kv_heads" -> "--kv-heads": the library names what the API calls a field; the user
// set it with a flag.
std::string as_flags(const std::string& message) {
  static const std::regex field(
      R"(\b(ModelConfig|BenchOptions|TrainOptions|SampleOptions|Layout|SearchSpace|PlanOptions|DistConfig)\.([a-z_]+))");
  static const std::vector<std::pair<std::string, std::string>> renamed = {{"engines", "engine"},
                                                                           {"attentions", "attention"},
                                                                           {"save_dir", "save"},
                                                                           {"val_fraction", "val-fraction"},
                                                                           {"grad_bytes", "grad-dtype"},
                                                                           {"first_layers", "first-stage-layers"},
                                                                           {"last_layers", "last-stage-layers"},
                                                                           {"head_size", "head-dim"},
                                                                           {"fused_qkv", "qkv"},
                                                                           {"zero_fixed", "zero"},
                                                                           {"world", "world-size"},
                                                                           {"timeout", "dist-timeout"},
                                                                           {"master_port", "master"},
                                                                           {"master_addr", "master"},
                                                                           {"loss_chunks", "loss"},
                                                                           {"allgather_dispatch", "dispatcher"}};
  // Fields only a --model preset or a --model-config file sets: no flag to name, so the field stays.
  static const std::vector<std::string> unflagged = {"norm_eps",   "norm_topk",       "parallel_residual", "qk_norm",
                                                     "rope_theta", "rotary_fraction", "eager_ops"};
  std::string out;
  auto it = std::sregex_iterator(message.begin(), message.end(), field);
  size_t last = 0;
  for (; it != std::sregex_iterator(); ++it) {
    std::string name = (*it)[2];
    if (std::find(unflagged.begin(), unflagged.end(), name) != unflagged.end()) continue;
    for (const auto& [api, flag] : renamed)
      if (name == api) name = flag;
    for (char& c : name)
      if (c == '_') c = '-';
    out += message.substr(last, it->position() - last) + "--" + name;
    last = it->position() + it->length();
  }
  out += message.substr(last);
  // Settings named as a whole by their parsers (parse_threads, parse_gemm).
  for (const auto& [api, flag] :
       {std::pair<std::string, std::string>{"ThreadConfig", "--threads"}, {"GemmChoice", "--gemm"}})
    for (size_t at = out.find(api); at != std::string::npos; at = out.find(api)) out.replace(at, api.size(), flag);
  return out;
}

// An error is one line: a newline or other control character in a value the user gave (a policy,
// a path) is shown escaped.
std::string one_line(const std::string& message) {
  std::string out;
  for (const char c : message) {
    if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else
      out += c;
  }
  return out;
}

// What was printed reached stdout: a full disk or a closed pipe makes the command fail (exit 1), so
// that `remat plan > plan.txt` never succeeds with the plan missing.
int stdout_written(int code) {
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return code;
  fmt::print(stderr, "remat: error: cannot write to standard output: {}\n", std::strerror(errno));
  return code == 0 ? 1 : code;
}

// `mode`, the parsed --blas-kernel auto|keep|NAME, before any work (OpenBLAS reads
// OPENBLAS_CORETYPE only when it loads, so a change means running argv again): sets the
// variable and re-executes once when OpenBLAS loaded a kernel below what this CPU runs (auto) or
// another than NAME; the re-executed process checks the new kernel's results against a reference
// and falls back, once, to OpenBLAS's own choice if they differ. A kernel the user set in
// OPENBLAS_CORETYPE is never changed. REMAT_BLAS_NOTE tells blas_name() what happened. Called
// after the flags are parsed and checked (a typo, a bad value or --help costs no second start of
// LibTorch) and before any work; with `act` false (a command that runs no BLAS product) it only
// checks the value.
// Returns 2 for a bad value; otherwise returns only when this process keeps its kernel.
int choose_blas_kernel(char** argv, const std::string& mode, bool act) {
  const std::string loaded = remat::blas::loaded_kernel();
  if (mode != "auto" && mode != "keep") {
    const auto& known = remat::blas::known_kernels();
    if (std::find(known.begin(), known.end(), mode) == known.end()) {
      std::string allowed = "auto, keep";
      for (const std::string& k : known) allowed += ", " + k;
      fmt::print(stderr, "remat: error: unknown --blas-kernel '{}'; allowed: {}\n", mode, allowed);
      return 2;
    }
    if (!remat::blas::can_run(remat::blas::cpu_features(), mode)) {
      fmt::print(stderr, "remat: error: --blas-kernel {} needs instructions this CPU lacks; its best is {}\n", mode,
                 remat::blas::best_kernel(remat::blas::cpu_features()));
      return 2;
    }
  }
  if (!act) return -1;
  auto again = [&](const char* coretype, const std::string& note) {
    if (coretype != nullptr)
      setenv("OPENBLAS_CORETYPE", coretype, 1);
    else
      unsetenv("OPENBLAS_CORETYPE");
    setenv("REMAT_BLAS_NOTE", note.c_str(), 1);
    std::fflush(stdout);
    execv("/proc/self/exe", argv);
    fmt::print(stderr, "remat: error: cannot re-execute itself for BLAS kernel '{}': {}\n", coretype ? coretype : "",
               std::strerror(errno));
    return 1;
  };
  if (const char* tried = std::getenv("REMAT_BLAS_TRIED")) {  // the re-executed process
    const std::string was = tried;
    unsetenv("REMAT_BLAS_TRIED");
    if (!remat::blas::sgemm_self_check()) {
      setenv("REMAT_BLAS_REFUSED", loaded.c_str(), 1);
      return again(nullptr, fmt::format("OpenBLAS's own choice: kernel {} failed remat's sgemm check", loaded));
    }
    setenv("REMAT_BLAS_NOTE", was.c_str(), 1);
    return -1;
  }
  if (std::getenv("REMAT_BLAS_NOTE") != nullptr || std::getenv("REMAT_BLAS_REFUSED") != nullptr) return -1;  // decided
  if (mode == "keep" || loaded.empty()) return -1;
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return -1;  // the user's choice
  std::string target;
  if (mode == "auto")
    target = remat::blas::upgrade(remat::blas::cpu_features(), loaded);
  else
    target = mode == loaded ? std::string() : mode;
  if (target.empty()) return -1;
  const std::string note = mode == "auto"
                               ? fmt::format("chosen by remat: OpenBLAS picked {}, below what this CPU runs", loaded)
                               : fmt::format("chosen with --blas-kernel; OpenBLAS picked {}", loaded);
  setenv("REMAT_BLAS_TRIED", note.c_str(), 1);
  return again(target.c_str(), note);
}

// Every command's integer options read as decimal (a 64-bit one unless its declaration said
// otherwise: cli::decimal_integer), and the flags all commands that run products share.
void add_shared_flags(const remat::cli::Command& c, std::string& blas_kernel, std::string& gemm, bool& remeasure) {
  for (CLI::Option* o : c.app->get_options())
    if (const std::string t = o->get_type_name();
        (t.rfind("INT", 0) == 0 || t.rfind("UINT", 0) == 0) && !remat::cli::reads_decimal(*o))
      o->transform(t[0] == 'U' ? remat::cli::decimal_integer<uint64_t>() : remat::cli::decimal_integer<int64_t>());
  if (!c.runs_products) return;
  c.app->add_option("--blas-kernel", blas_kernel,
                    "OpenBLAS kernel: auto (a faster one when OpenBLAS picked one below this CPU; default), keep, "
                    "or a name such as SkylakeX");
  c.app->add_option(
      "--gemm", gemm,
      "the engine's GEMM: auto (each class of products on the BLAS unless another won its timed rounds "
      "here on remat's threads, the linears on the BLAS's own threads when a pass runs faster so; cached; "
      "default), onednn, blas, or a record such as linear=onednn,onednn,blas;"
      "head=onednn,onednn,blas");
  if (c.reads_caches)
    c.app->add_flag("--remeasure", remeasure,
                    "measure this machine again (what this command reads from the cache: the GEMM choice, op costs, "
                    "rates) instead of using the cached measurement, and replace it: for one taken while the machine "
                    "was busy");
}

// The first option of the parsed command given an empty value ("--json ''", "--data ''"): a
// mistake, never a default. nullptr when none was.
const CLI::Option* given_empty(const std::vector<remat::cli::Command>& commands) {
  for (const remat::cli::Command& c : commands) {
    if (!c.app->parsed()) continue;
    for (const CLI::Option* o : c.app->get_options())
      if (o->count() > 0 && o->get_expected_min() > 0)
        for (const std::string& v : o->results())
          if (v.empty()) return o;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  remat::MemoryTracker::install();  // first: every tensor after this is counted
  std::signal(SIGPIPE, SIG_IGN);    // a closed pipe (gnuplot, `| head`) is an error to report, not a death

  CLI::App app{"remat: selective activation recomputation for transformer training on LibTorch"};
  app.set_version_flag("--version", fmt::format("remat {} (LibTorch {})", remat::version(), TORCH_VERSION),
                       "print remat's release and the LibTorch it was built with, and exit");
  app.require_subcommand(1);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("remat: error: {} (see remat --help)\n", one_line(e.what()));
  });
  const std::vector<remat::cli::Command> commands = {remat::cli::add_bench(app), remat::cli::add_plan(app),
                                                     remat::cli::add_train(app, argc, argv),
                                                     remat::cli::add_sample(app), remat::cli::add_cpu(app)};
  std::string blas_kernel = "auto";
  std::string gemm = "auto";
  bool remeasure = false;
  for (const remat::cli::Command& c : commands) add_shared_flags(c, blas_kernel, gemm, remeasure);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return stdout_written(app.exit(e) == 0 ? 0 : 2);
  }
  if (const CLI::Option* empty = given_empty(commands)) {
    fmt::print(stderr, "remat: error: {} was given an empty value; give one, or leave the option out\n",
               empty->get_name());
    return 2;
  }
  try {
    remat::cli::set_gemm_flag(gemm);
    remat::set_remeasure(remeasure);
    // `plan` times ops only on the engine: the BLAS kernel matters to it only when the engine's
    // GEMMs are the BLAS's. bench (the module path), train and sample may run BLAS products.
    const bool plan = std::any_of(commands.begin(), commands.end(), [](const remat::cli::Command& c) {
      return c.app->parsed() && c.app->get_name() == "plan";
    });
    const bool products = std::any_of(commands.begin(), commands.end(),
                                      [](const remat::cli::Command& c) { return c.app->parsed() && c.runs_products; });
    for (const remat::cli::Command& c : commands)
      if (c.app->parsed() && c.check) c.check();  // bad flags are refused before a second start
    if (const int code = choose_blas_kernel(argv, blas_kernel, products && (!plan || remat::gemm_uses_blas()));
        code >= 0)
      return code;
    for (const remat::cli::Command& c : commands)
      if (c.app->parsed()) return stdout_written(c.run());
  } catch (const remat::Error& e) {
    remat::cli::end_progress();
    fmt::print(stderr, "remat: error: {}\n", one_line(as_flags(e.what())));
    return e.kind() == remat::Error::Kind::Usage ? 2 : 1;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    remat::cli::end_progress();
    fmt::print(stderr, "remat: error: {}\n", one_line(what));
    return 1;
  }
  return stdout_written(0);
}
