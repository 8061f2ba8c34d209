// remat: the command-line tool. Each subcommand (cmd_*.cpp) parses its flags, prints its
// configuration and calls the library; main maps errors to exit codes (0 success, 1 a run that
// failed, 2 bad input) and the library's API names to the flags that set them.
#include <charconv>
#include <csignal>
#include <regex>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli.h"
#include "remat/error.h"
#include "remat/memory.h"

namespace {

// "ModelConfig.kv_heads" -> "--kv-heads": the library names what the API calls a field; the user
// set it with a flag.
std::string as_flags(const std::string& message) {
  static const std::regex field(R"(\b(ModelConfig|BenchOptions|TrainOptions|SampleOptions|Layout|SearchSpace)\.([a-z_]+))");
  static const std::vector<std::pair<std::string, std::string>> renamed = {
      {"engines", "engine"}, {"save_dir", "save"}, {"val_fraction", "val-fraction"}, {"grad_bytes", "grad-dtype"}};
  std::string out;
  auto it = std::sregex_iterator(message.begin(), message.end(), field);
  size_t last = 0;
  for (; it != std::sregex_iterator(); ++it) {
    std::string name = (*it)[2];
    for (const auto& [api, flag] : renamed)
      if (name == api) name = flag;
    for (char& c : name)
      if (c == '_') c = '-';
    out += message.substr(last, it->position() - last) + "--" + name;
    last = it->position() + it->length();
  }
  out += message.substr(last);
  const std::string threads = "ThreadConfig";  // parse_threads names the whole setting
  for (size_t at = out.find(threads); at != std::string::npos; at = out.find(threads)) out.replace(at, threads.size(), "--threads");
  return out;
}

// CLI11 reads an integer beyond int64's range as INT64_MAX, and the error then names that number:
// refuse the text the user gave, as given.
CLI::Validator fits_in_int64() {
  return CLI::Validator(
      [](std::string& v) {
        int64_t x = 0;
        const char* end = v.data() + v.size();
        const auto [at, ec] = std::from_chars(v.data() + (!v.empty() && v[0] == '+'), end, x);
        if (ec == std::errc::result_out_of_range) return "'" + v + "' is out of range (a 64-bit integer)";
        return std::string();  // anything else: CLI11's own conversion decides
      },
      "");
}

}  // namespace

int main(int argc, char** argv) {
  remat::MemoryTracker::install();  // first: every tensor after this is counted
  std::signal(SIGPIPE, SIG_IGN);    // a closed pipe (gnuplot, `| head`) is an error to report, not a death

  CLI::App app{"remat: selective activation recomputation for transformer training on LibTorch"};
  app.require_subcommand(1);
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("remat: error: {} (see remat --help)\n", e.what());
  });
  const std::vector<remat::cli::Command> commands = {remat::cli::add_bench(app), remat::cli::add_plan(app),
                                                     remat::cli::add_train(app, argc, argv), remat::cli::add_sample(app)};
  for (const remat::cli::Command& c : commands)
    for (CLI::Option* o : c.app->get_options())
      if (o->get_type_name() == "INT" || o->get_type_name() == "UINT") o->check(fits_in_int64());
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  // An option given an empty value ("--json ''", "--data ''") is a mistake, never a default.
  for (const remat::cli::Command& c : commands) {
    if (!c.app->parsed()) continue;
    for (const CLI::Option* o : c.app->get_options())
      if (o->count() > 0 && o->get_expected_min() > 0)
        for (const std::string& v : o->results())
          if (v.empty()) {
            fmt::print(stderr, "remat: error: {} was given an empty value; give one, or leave the option out\n",
                       o->get_name());
            return 2;
          }
  }
  try {
    for (const remat::cli::Command& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const remat::Error& e) {
    remat::cli::end_progress();
    fmt::print(stderr, "remat: error: {}\n", as_flags(e.what()));
    return e.kind() == remat::Error::Kind::Usage ? 2 : 1;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    remat::cli::end_progress();
    fmt::print(stderr, "remat: error: {}\n", what);
    return 1;
  }
  return 0;
}
