// remat train and remat sample: a GPT trained on text under any recompute policy, and text from it.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "app/corpus.h"
#include "app/launch.h"
#include "app/report.h"
#include "app/train.h"
#include "cli.h"
#include "remat/costs.h"
#include "remat/error.h"
#include "remat/policy.h"
#include "remat/runtime.h"
#include "remat/units.h"
#include "util/paths.h"
#include "util/timing.h"

namespace remat::cli {

namespace {

struct TrainFlags {
  ShapeFlags shape;
  TrainOptions o;
  std::string resume, csv, threads, master, memory_limit;
  std::vector<std::string> charts;
  int nproc = 1, rank = -1, world = -1, timeout_s = 60;
  double bucket_mb = 2;
  std::vector<std::string> argv;  // as given, for --nproc's ranks
  bool checked = false;           // check() has turned the flags into `o`
  CLI::App* app = nullptr;        // the subcommand, for which flags were given
};

// This process launches the ranks (--nproc N, not itself a rank).
// (Its ranks are started without --nproc.)
bool launches(const TrainFlags& f) { return f.nproc > 1 && f.rank < 0; }

// The options of the ranks this process launches (--nproc N): a world of N, each rank on ATen 1
// thread and BLAS and remat's kernels cores / N, unless --threads says otherwise.
TrainOptions ranks_options(const TrainFlags& f) {
  TrainOptions o = f.o;
  o.dist.world = f.nproc;
  if (f.threads.empty()) o.threads = data_parallel_threads(f.nproc);
  return o;
}

// `--nproc N`: this process launches N ranks of itself (without --nproc) and waits for them. Each
// gets ATen 1 thread and BLAS and remat's kernels cores / N, unless --threads says otherwise.
// --remeasure is taken here, not by the ranks, which would measure at once on shared cores.
int launch(TrainFlags& f) {
  std::vector<std::string> args;
  for (size_t i = 0; i < f.argv.size(); ++i) {
    const std::string& a = f.argv[i];
    if (a == "--nproc") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0 || a == "--remeasure" || a.rfind("--remeasure=", 0) == 0) continue;
    args.push_back(a);
  }
  const ThreadConfig cores = default_threads();
  const ThreadConfig per_rank = ranks_options(f).threads;
  if (f.threads.empty()) {
    args.push_back("--threads");
    args.push_back(to_string(per_rank));
  }
  fmt::print(stderr, "remat train: {} local ranks, threads ATen/BLAS {} each ({} cores)\n", f.nproc,
             to_string(per_rank), cores.blas);
  // --gemm auto is measured here, once, on a rank's threads, and handed to every rank: ranks that
  // measured at once on shared cores could choose differently. A resumed run keeps its saved GEMM.
  if (f.resume.empty()) {
    fmt::print(stderr, "{}", describe(settle_gemm(per_rank)));
    args.push_back("--gemm");
    args.push_back(gemm_record());
  }
  // What the ranks read from the cache (a budget is planned from the machine's rates), measured
  // again once, on a rank's threads and GEMM (a resumed run's was restored by check_resume).
  if (remeasuring()) calibrated_rates(per_rank);
  return launch_local(f.nproc, args, std::chrono::seconds(5),
                      [](const std::string& line) { fmt::print(stderr, "remat: error: {}\n", line); });
}

// The long names of the flags given (train()'s explicit_flags). --gemm auto is no GEMM of its own:
// a resumed run keeps the one it was trained on, a new run measures.
std::vector<std::string> explicit_flags(CLI::App* app) {
  std::vector<std::string> given;
  for (const CLI::Option* opt : app->get_options())
    if (opt->count() > 0 && !opt->get_lnames().empty()) given.push_back(opt->get_lnames()[0]);
  if (app->get_option("--gemm")->as<std::string>() == "auto")
    given.erase(std::remove(given.begin(), given.end(), "gemm"), given.end());
  return given;
}

// The flags as TrainOptions in f.o, checked: check_train_options, for the world the ranks will form
// when this process launches them (once, here: each rank would refuse them again). A resumed run
// is checked with the saved options merged in, once the BLAS kernel is settled: by the launcher
// before it starts the ranks (check_resume), by train() in one process.
void check(TrainFlags& f) {
  if (f.nproc < 1 || f.nproc > 256) fail("--nproc must be in 1..256, got {}", f.nproc);
  f.shape.cfg.vocab = 256;
  f.o.model = f.shape.resolve();
  if (!f.threads.empty()) f.o.threads = parse_threads(f.threads);
  f.o.dist = dist_config_from_env();
  if (f.rank >= 0 || f.world >= 0) {  // --rank/--world-size/--master instead of the variables
    if (f.rank < 0 || f.world < 1 || f.master.empty())
      fail("--rank, --world-size and --master ADDR:PORT go together; got --rank {} --world-size {} --master '{}'",
           f.rank, f.world, f.master);
    if (f.nproc > 1)
      fail("--nproc {} starts its own ranks, and --rank makes this process one rank of a run: give one or the other",
           f.nproc);
    if (f.rank >= f.world) fail("--rank {} must be in 0..{} for --world-size {}", f.rank, f.world - 1, f.world);
    f.o.dist.rank = f.rank;
    f.o.dist.world = f.world;
    const size_t colon = f.master.rfind(':');
    if (colon == std::string::npos || colon == 0)
      fail("--master '{}' must be ADDR:PORT, e.g. 10.0.0.1:29500", f.master);
    f.o.dist.master_addr = f.master.substr(0, colon);
    const std::string digits = f.master.substr(colon + 1);
    const long port = digits.empty() || digits.size() > 5 || digits.find_first_not_of("0123456789") != std::string::npos
                          ? 0
                          : std::stol(digits);
    if (port <= 0 || port > 65535) fail("--master '{}': the port must be in 1..65535", f.master);
    f.o.dist.master_port = static_cast<int>(port);
  }
  if (f.timeout_s <= 0) fail("--dist-timeout must be a positive number of seconds, got {}", f.timeout_s);
  f.o.dist.timeout = std::chrono::seconds(f.timeout_s);
  if (!(f.bucket_mb > 0) || f.bucket_mb > 4096) fail("--bucket-mb must be in (0, 4096], got {}", f.bucket_mb);
  f.o.bucket_bytes = static_cast<int64_t>(f.bucket_mb * (1 << 20));
  if (!f.memory_limit.empty()) {
    Budget b;
    try {
      b = parse_budget(f.memory_limit);
    } catch (const Error&) {}
    if (b.bytes <= 0) fail("--memory-limit takes a size such as 2GiB or 300MiB, got '{}'", f.memory_limit);
    f.o.memory_limit = b.bytes;
  }
  if (f.app->count("--master") > 0 && f.rank < 0)
    fail(
        "--master goes with --rank and --world-size (this process as one rank of a run); --nproc starts its own "
        "ranks, and a launcher's ranks read MASTER_ADDR and MASTER_PORT");
  if (f.nproc == 1 && f.o.dist.world == 1)
    for (const char* flag : {"--bucket-mb", "--dist-timeout"})
      if (f.app->count(flag) > 0)
        fail("{} is for a data-parallel run (--nproc N, or a rank of one); this run is one process: leave it out",
             flag);
  if (f.o.save_every > 0 && f.o.save_dir.empty() && f.resume.empty())
    fail("--save-every {} saves the train state every so many steps; give --save DIR too", f.o.save_every);
  if (f.nproc > 1 && f.rank < 0)
    for (const char* var : {"RANK", "WORLD_SIZE"})
      if (const char* v = std::getenv(var))
        fail(
            "--nproc {} starts its own ranks, but {}={} is set (this would be one rank of another launcher's run): "
            "unset {}, or leave --nproc out",
            f.nproc, var, v, var);
  FileRoles files;
  files.input("--data", f.o.data);
  if (!FileRoles::same(f.resume, f.o.save_dir)) files.input("--resume", f.resume, /*folder=*/true);  // resumed in place
  files.output("--save", f.o.save_dir, /*folder=*/true);
  files.output("--csv", f.csv);
  for (const std::string& c : f.charts) files.output("--chart", c);
  files.check();
  if (!f.csv.empty()) check_writable(f.csv);
  for (const std::string& c : f.charts) {
    check_chart_path(c);
    check_writable(c);
  }
  const TrainOptions o = launches(f) ? ranks_options(f) : f.o;
  if (launches(f))
    check_train_options(o, f.resume);
  else if (f.resume.empty())
    check_train_options(o);
  if (f.resume.empty()) {
    // Before the GEMM choice is measured (here, or by the launcher for its ranks): the text (read
    // again by train()) and a rank's step memory, all ranks on this machine together.
    static_cast<void>(load_corpus(o.data, o.val_fraction, o.model.seq));
    check_train_memory(o);
  }
  f.checked = true;
}

// One progress line per step on a terminal (redrawn), about twenty in all elsewhere.
std::function<void(const TrainProgress&)> progress_printer() {
  const bool tty = isatty(fileno(stderr));
  auto last_line = std::make_shared<int64_t>(0);
  return [tty, last_line](const TrainProgress& p) {
    const std::string val = std::isnan(p.val_loss) ? "-" : fmt::format("{:.3f}", p.val_loss);
    const int width = 24, done = static_cast<int>(width * p.step / p.steps);
    const std::string line =
        fmt::format("step {}/{} [{}{}] loss {:.3f} | val {} | {:.1f}k tok/s | peak {} | ETA {}", p.step, p.steps,
                    std::string(done, '='), std::string(width - done, ' '), p.loss, val, p.tokens_per_s / 1000,
                    bytes_str(p.peak_bytes), duration(p.eta_s));
    // Best effort: a terminal that went away (SIGHUP, a closed window) fails the write, and the run
    // goes on to save and stop.
    try {
      if (tty) {
        fmt::print(stderr, "\r\033[K{}", line);
      } else if (p.step == p.steps || p.step - *last_line >= std::max<int64_t>(1, p.steps / 20)) {
        fmt::print(stderr, "{}\n", line);
        *last_line = p.step;
      }
    } catch (const std::system_error&) {}
  };
}

// The header, once the run has started (after its checks, on the leader).
std::function<void(const TrainOptions&, int64_t)> header_printer(const TrainFlags& f, const GemmMeasurement& gemm) {
  return [resume = f.resume, gemm](const TrainOptions& o, int64_t first_step) {
    fmt::print("remat train: {} | policy {} | {} steps x {} tokens | seed {}\n", describe(o.model), o.policy, o.steps,
               o.model.batch * o.model.seq * o.accum * o.dist.world, o.seed);
    if (o.dist.world > 1)
      fmt::print(
          "  data parallel: {} ranks x {} micro-batch(es) of {} | ZeRO-{} | buckets of {} MiB | c10d Gloo at {}:{}\n",
          o.dist.world, o.accum, o.model.batch, o.zero, static_cast<double>(o.bucket_bytes) / (1 << 20),
          o.dist.master_addr, o.dist.master_port);
    fmt::print("  BLAS: {}\n  GEMM: {}\n{}", blas_name(), gemm_name(), describe(gemm));
    if (!resume.empty()) fmt::print("  resuming the run saved in {} at step {}\n", resume, first_step + 1);
    std::fflush(stdout);
  };
}

template <typename Field>
double median_of(const std::vector<TrainRecord>& log, Field field) {
  std::vector<double> v;
  for (const TrainRecord& rec : log) v.push_back(rec.*field);
  return detail::median(std::move(v));
}

// What a finished run prints: the policy, loss, speed and peak against the prediction, per rank.
void print_summary(const TrainResult& r) {
  // This process's steps: a resumed run's earlier ones ran under the saved policy and settings.
  const std::vector<TrainRecord> log(r.log.begin() + static_cast<std::ptrdiff_t>(r.restored), r.log.end());
  int64_t peak = 0;
  for (const TrainRecord& rec : log) peak = std::max(peak, rec.peak_bytes);
  fmt::print("  policy as run: {}\n", r.policy_text);
  const std::string against =
      fmt::format("predicted {}{}", bytes_str(r.predicted_peak),
                  peak == r.predicted_peak ? ", equal" : fmt::format(", {:+d} B", peak - r.predicted_peak));
  const std::string val = std::isnan(r.final_val_loss)
                              ? std::string("no validation ran")  // a run stopped before its first
                              : fmt::format("final validation loss {:.4f} nats/byte", r.final_val_loss);
  fmt::print("  {} | {:.1f}k tokens/s (median) | peak {} ({})\n", val,
             median_of(log, &TrainRecord::tokens_per_s) / 1000, bytes_str(peak), against);
  if (r.rank_peaks.size() > 1) {
    const double red = median_of(log, &TrainRecord::reduce_s), exp = median_of(log, &TrainRecord::exposed_s);
    fmt::print(
        "  all-reduce: {} buckets, {:.1f} ms per step (median), {:.1f} ms not hidden by the backward ({:.0f}% "
        "hidden)\n",
        r.buckets, 1e3 * red, 1e3 * exp, red > 0 ? 100.0 * std::max(0.0, 1.0 - exp / red) : 0.0);
    for (size_t q = 0; q < r.rank_peaks.size(); ++q)
      fmt::print("  rank {}: peak {} = {} B (predicted {} B{})\n", q, bytes_str(r.rank_peaks[q]), r.rank_peaks[q],
                 r.rank_predicted[q],
                 r.rank_peaks[q] == r.rank_predicted[q]
                     ? ", equal"
                     : fmt::format(", {:+d} B", r.rank_peaks[q] - r.rank_predicted[q]));
  }
  fmt::print("  weights digest: {}\n", r.weights_digest);
}

// Ctrl-C, kill and a closed terminal: the first ends the run after the step under way, saving the
// state (--save); a second ends the process at once. The ranks of a parallel run all stop after
// the same step (TrainOptions::should_stop); --nproc's launcher passes its signal on to each, which
// repeats a signal the rank may have had already (the terminal's, a scheduler's): a signal from the
// launcher is never a second one, nor is one after it (the launcher kills its ranks on its own
// second signal).
volatile std::sig_atomic_t g_stop = 0, g_stop_from_launcher = 0;
pid_t g_launcher = 0;
void on_stop(int sig, siginfo_t* info, void*) {
  const bool from_launcher = g_launcher != 0 && info != nullptr && info->si_pid == g_launcher;
  if (g_stop != 0) {
    if (from_launcher || g_stop_from_launcher) return;
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop = sig;
  g_stop_from_launcher = from_launcher;
}

int run(TrainFlags& f, CLI::App* app) {
  if (!f.checked) check(f);
  if (launches(f)) {
    if (!f.resume.empty()) check_resume(ranks_options(f), f.resume, explicit_flags(app));
    return launch(f);
  }
  const bool leader = f.o.dist.rank == 0;
  const std::vector<std::string> given = explicit_flags(app);
  const GemmMeasurement gemm_choice = f.resume.empty() ? settle_gemm(f.o.threads) : GemmMeasurement{};
  f.o.progress = progress_printer();
  f.o.started = header_printer(f, gemm_choice);
  {
    // The handler runs on a stack of its own: oneDNN's JIT GEMMs move the stack pointer into heap
    // buffers, below which a signal frame on the thread's own stack would overwrite the heap.
    static std::vector<char> handler_stack(size_t{256} << 10);
    stack_t alt{};
    alt.ss_sp = handler_stack.data(), alt.ss_size = handler_stack.size();
    ::sigaltstack(&alt, nullptr);
    g_launcher = launcher_pid();
    struct sigaction stop {};
    stop.sa_sigaction = on_stop;
    stop.sa_flags = SA_ONSTACK | SA_RESTART | SA_SIGINFO;
    sigemptyset(&stop.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      // A signal the process was started ignoring (nohup's SIGHUP, a background job's SIGINT) stays ignored.
      struct sigaction was {};
      if (::sigaction(sig, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) ::sigaction(sig, &stop, nullptr);
    }
    f.o.should_stop = [] { return static_cast<int>(g_stop); };
    unblock_stop_signals();  // a rank of --nproc starts with them blocked: one sent meanwhile lands now
  }
  const TrainResult r = train(f.o, f.resume, given);
  end_progress();
  if (!leader) return r.stopped != 0 ? 128 + r.stopped : 0;
  // The files first: the summary's write fails on a terminal that went away.
  if (!f.csv.empty()) write_file_atomic(f.csv, r.csv());
  for (const std::string& c : f.charts)
    r.write_chart(c, "remat train: " + describe(r.options.model) + ", policy " + r.options.policy);
  print_summary(r);
  if (!r.options.save_dir.empty()) fmt::print("  train state: {}/state.bin\n", r.options.save_dir);
  if (!f.csv.empty()) fmt::print("wrote {}\n", f.csv);
  for (const std::string& c : f.charts) fmt::print("wrote {}\n", c);
  if (r.stopped) {
    const int64_t at = r.log.empty() ? 0 : r.log.back().step;
    fmt::print(stderr, "remat: stopped by signal {} ({}) after step {} of {}; {}\n", r.stopped, strsignal(r.stopped),
               at, r.options.steps,
               r.options.save_dir.empty()
                   ? std::string("nothing was saved (no --save)")
                   : fmt::format("its state is saved: continue with --resume {}", r.options.save_dir));
    return 128 + r.stopped;
  }
  return 0;
}

struct SampleFlags {
  std::string load;
  SampleOptions o;
};

}  // namespace

Command add_train(CLI::App& parent, int argc, char** argv) {
  auto f = std::make_shared<TrainFlags>();
  f->argv.assign(argv, argv + argc);
  CLI::App* a = parent.add_subcommand("train", "train a GPT on text with any recompute policy");
  f->app = a;
  f->shape.cfg = default_train_model();
  f->shape.add(a);
  TrainOptions& o = f->o;
  a->add_option("--data", o.data, "a text file (default: Debian's English fortunes)");
  a->add_option("--policy", o.policy, "recompute policy, e.g. attn+mlp-act or budget:300MiB")->capture_default_str();
  a->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  a->add_option("--accum", o.accum, "micro-batches per step (gradient accumulation)")->capture_default_str();
  a->add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  a->add_option("--min-lr", o.min_lr, "cosine floor")->capture_default_str();
  a->add_option("--warmup", o.warmup, "linear warm-up steps")->capture_default_str();
  a->add_option("--weight-decay", o.weight_decay, "AdamW decay on weight matrices")->capture_default_str();
  a->add_option("--clip", o.clip, "global gradient-norm clip; 0 = off")->capture_default_str();
  a->add_option("--eval-every", o.eval_every, "validation every N steps; 0 = at the end")->capture_default_str();
  a->add_option("--eval-batches", o.eval_batches, "batches per validation")->capture_default_str();
  a->add_option("--seed", o.seed, "weights, batches, dropout")->capture_default_str();
  a->add_option("--save", o.save_dir, "write the train state to this folder (a resume: the folder it resumes from)");
  a->add_option("--save-every", o.save_every, "steps between saves; 0 = at the end (and at Ctrl-C or SIGTERM)")
      ->capture_default_str();
  a->add_option("--resume", f->resume,
                "continue the run saved in this folder; flags left out (policy, evaluation, saving too) are its own");
  a->add_option("--threads", f->threads, "ATen/BLAS threads, e.g. 1/2 (--nproc: 1/(cores / N) per rank)");
  a->add_option("--nproc", f->nproc, "data parallel: start N local ranks (c10d Gloo)")
      ->transform(decimal_integer<int>())
      ->capture_default_str();
  a->add_option("--rank", f->rank, "data parallel across hosts: this process's rank (or RANK)")
      ->transform(decimal_integer<int>());
  a->add_option("--world-size", f->world, "data parallel across hosts: ranks in all (or WORLD_SIZE)")
      ->transform(decimal_integer<int>());
  a->add_option("--master", f->master, "data parallel across hosts: ADDR:PORT of rank 0 (or MASTER_ADDR, MASTER_PORT)");
  a->add_option("--zero", f->o.zero, "1: ZeRO-1, each rank keeps the Adam moments of its share")
      ->transform(decimal_integer<int>())
      ->capture_default_str();
  a->add_option("--bucket-mb", f->bucket_mb, "gradient all-reduce bucket size")->capture_default_str();
  a->add_option("--memory-limit", f->memory_limit,
                "bytes of tensors this process may hold, as a GPU's memory (e.g. 80GiB); beyond it a step stops "
                "with the plan that fits");
  a->add_option("--dist-timeout", f->timeout_s, "seconds every collective and the rendezvous may take")
      ->transform(decimal_integer<int>())
      ->capture_default_str();
  a->add_option("--csv", f->csv, "write the metrics as CSV");
  a->add_option("--chart", f->charts, "write the loss chart (.png or .svg; repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  return {a, [f] { check(*f); }, [f, a] { return run(*f, a); }};
}

Command add_sample(CLI::App& parent) {
  auto f = std::make_shared<SampleFlags>();
  CLI::App* a = parent.add_subcommand("sample", "generate text with a trained model");
  a->add_option("--load", f->load, "the folder remat train --save wrote")->required();
  a->add_option("--prompt", f->o.prompt, "text to continue");
  a->add_option("--tokens", f->o.tokens, "bytes to generate")->capture_default_str();
  a->add_option("--temperature", f->o.temperature, "at least 1e-6; lower is more conservative")->capture_default_str();
  a->add_option("--top-k", f->o.top_k, "sample from the k likeliest bytes; 0 = all")->capture_default_str();
  a->add_option("--seed", f->o.seed, "sampling seed")->capture_default_str();
  f->o.progress = [](int64_t done, int64_t total) { progress(fmt::format("sampling: {} of {} bytes", done, total)); };
  return {a, [f] { check_sample_options(f->o); },
          [f] {
            const std::string text = sample(f->load, f->o);
            end_progress();
            fmt::print("{}\n", text);
            return 0;
          },
          /*runs_products=*/true, /*reads_caches=*/false};
}

}  // namespace remat::cli
