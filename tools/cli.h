// The remat CLI's shared pieces: one file per subcommand (cmd_*.cpp) registers its flags and its
// runner; main (remat.cpp) parses, runs, and maps errors to exit codes and library names to flags.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "remat/config.h"
#include "remat/runtime.h"

namespace remat::cli {

// A subcommand: its parser, the check of its flags, and what runs when it is chosen. main calls
// `check` first, before it may re-execute itself for the BLAS kernel (a second start of LibTorch):
// it turns the flags into the library's options and throws remat::Error for a bad one, computing
// nothing (empty for plan, which checks as it runs). `run` then does the work (checking first
// itself if `check` has not run) and returns the exit code.
struct Command {
  CLI::App* app = nullptr;
  std::function<void()> check;
  std::function<int()> run;
  // False for a command that runs no matrix product: it takes no --gemm or --blas-kernel.
  bool runs_products = true;
  // False for a command that reads no cached measurement of the machine: it takes no --remeasure.
  bool reads_caches = true;
};

Command add_bench(CLI::App& parent);
Command add_plan(CLI::App& parent);
Command add_train(CLI::App& parent, int argc, char** argv);
Command add_sample(CLI::App& parent);
Command add_cpu(CLI::App& parent);

// Flags that build a ModelConfig, shared by bench, plan and train.
struct ShapeFlags {
  std::string dtype = "fp32";
  std::string attention = "math";
  std::string norm, positions, mlp, qkv, loss;  // "" = the kind's
  std::string router = "softmax";
  std::string router_dtype = "model";
  std::string expert_weights = "combine";
  bool bias_flag = false, tied_flag = false;
  std::string model;         // plan: a preset (remat/models.h)
  std::string model_config;  // plan: a Hugging Face config.json
  ModelConfig cfg;
  CLI::App* app = nullptr;
  bool lists_attention = false;  // bench: --attention math,flash runs both

  // --arch --layers --dim --heads --kv-heads --batch --seq --ffn --dropout --attn-block --attention
  // and the decoder's choices: --norm --positions --mlp --bias/--no-bias --qkv-bias --tied/--untied
  // --qkv --loss; the mixture of experts': --experts --top-k --shared-ffn --capacity-factor --router
  // --aux-loss --expert-weights
  void add(CLI::App* a);
  // plan: --model --model-config --vocab --dtype
  void add_planning(CLI::App* a);
  // The config the flags describe (a preset or a config.json first, flags over it), validated.
  ModelConfig resolve();
  // The named shape's published sequences per optimizer step; 0 for none.
  int64_t global_batch() const;
};

// --gemm, one for every command: "auto" (each class of the engine's products on the GEMM measured
// fastest here, once a command knows its threads: settle_gemm), "onednn", "blas", or a record
// gemm_record() gave. Sets it for the process; throws remat::Error listing what is allowed.
void set_gemm_flag(const std::string& text);

// For --gemm auto: measures each class on `threads` (or reads the cached choice) and sets it, once
// per process; returns what was chosen and the rates it was chosen at (empty classes when the user
// chose the GEMM).
const GemmMeasurement& settle_gemm(const ThreadConfig& threads);

// The lines a command's header prints for that choice ("" when the user chose the GEMM).
std::string describe(const GemmMeasurement& m);

// Progress on stderr: one rewritten line on a terminal, plain lines otherwise.
void progress(const std::string& line);
void end_progress();

// "a,b" -> {"a", "b"}; throws remat::Error naming `flag` and the `allowed` items when an item is
// empty ("a,", ",b", "a,,b").
std::vector<std::string> split_list(const std::string& text, const char* flag, const char* allowed);

// An integer flag's text as the decimal the user meant, within [lo, hi], before CLI11 converts it:
// CLI11 reads "010" as octal and "0x10" as hex, and refuses a value past its variable's type without
// naming the range. Leading zeros are dropped ("010" is ten, "-0" is 0). Returns "" when `text`
// is such a decimal (rewritten in place), else the refusal, naming the text and the range.
std::string read_decimal(std::string& text, int64_t lo, uint64_t hi);

// read_decimal over T's range, as CLI11's transform named "decimal". main gives every integer flag
// without one the 64-bit reading; a flag of a narrower type takes its own where it is declared:
//   a->add_option("--steps", steps)->transform(decimal_integer<int>());
template <typename T>
CLI::Validator decimal_integer() {
  return CLI::Validator(
      [](std::string& text) {
        return read_decimal(text, static_cast<int64_t>(std::numeric_limits<T>::min()),
                            static_cast<uint64_t>(std::numeric_limits<T>::max()));
      },
      "", "decimal");
}

// True when the option has a decimal_integer transform.
bool reads_decimal(CLI::Option& o);

// "3m05s" or "42s".
std::string duration(double seconds);

}  // namespace remat::cli
