#include "app/train.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <system_error>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "app/corpus.h"
#include "app/train_state.h"
#include "remat/block.h"
#include "remat/error.h"
#include "remat/memory.h"
#include "remat/memory_model.h"
#include "remat/policy.h"
#include "remat/units.h"
#include "test_util.h"
#include "util/hash.h"

#include <nlohmann/json.hpp>

namespace remat {
namespace {

using testing::temp_dir;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A few kilobytes of varied English-like text.
std::string corpus_file(const std::string& dir) {
  const std::string path = dir + "/text.txt";
  std::ofstream out(path);
  const char* words[] = {"the", "quick", "brown",  "fox",   "jumps", "over",  "a",     "lazy", "dog",
                         "and", "then",  "sleeps", "under", "tree",  "while", "birds", "sing"};
  uint32_t x = 12345;
  for (int i = 0; i < 4000; ++i) {
    x = x * 1664525u + 1013904223u;
    out << words[(x >> 16) % 17] << ((x >> 8) % 7 == 0 ? ".\n" : " ");
  }
  return path;
}

TrainOptions tiny(const std::string& data) {
  TrainOptions o;
  o.model = default_train_model();
  o.model.layers = 2;
  o.model.dim = 32;
  o.model.heads = 4;
  o.model.batch = 4;
  o.model.seq = 16;
  o.model.attn_block = 8;  // two causal row blocks
  o.model.dropout = 0.1;
  o.data = data;
  o.steps = 30;
  o.warmup = 5;
  o.eval_every = 10;
  o.eval_batches = 2;
  return o;
}

// Trains `o` (saving into o.save_dir) until a simulated crash after step `at`, resuming
// `resume_dir` when one is given; returns with `o` rid of the crash.
void crash_after(TrainOptions& o, int64_t at, const std::string& resume_dir = "") {
  o.progress = [at](const TrainProgress& p) {
    if (p.step == at) throw std::runtime_error("simulated crash");
  };
  EXPECT_THROW(train(o, resume_dir), std::runtime_error);
  o.progress = nullptr;
}

// A run of `steps` on tiny's model and a corpus in `dir`, saving into dir/run every `save_every`
// steps, crashed at step `crash_at`: its options, for the resume a test makes of it.
TrainOptions interrupted_run(const std::string& dir, int64_t steps, int64_t save_every, int64_t crash_at) {
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = steps;
  o.save_dir = dir + "/run";
  o.save_every = save_every;
  crash_after(o, crash_at);
  return o;
}

std::vector<double> losses(const TrainResult& r) {
  std::vector<double> v;
  for (const TrainRecord& rec : r.log) v.push_back(rec.loss);
  return v;
}

TEST(Train, LossTrajectoryIsBitwiseTheSameUnderRecompute) {
  const std::string dir = temp_dir("policies");
  const std::string data = corpus_file(dir);
  TrainOptions o = tiny(data);
  const TrainResult none = train(o);
  ASSERT_EQ(none.log.size(), 30u);
  EXPECT_LT(none.log.back().loss, none.log.front().loss);  // it learns
  for (const char* p : {"full", "attn", "mlp-act", "every:2", "uniform:2"}) {
    o.policy = p;
    const TrainResult r = train(o);
    EXPECT_EQ(losses(r), losses(none)) << p;
    EXPECT_EQ(r.weights_digest, none.weights_digest) << p;
    EXPECT_EQ(r.final_val_loss, none.final_val_loss) << p;
  }
  std::filesystem::remove_all(dir);
}

TEST(Train, LlamaTrainsTheSameUnderRecompute) {
  const std::string dir = temp_dir("llama");
  TrainOptions o = tiny(corpus_file(dir));
  o.model.arch = "llama";
  o.model.kv_heads = 2;
  o.steps = 12;
  const TrainResult none = train(o);
  EXPECT_LT(none.log.back().loss, none.log.front().loss);
  for (const char* p : {"full", "attn+mlp-act", "norm"}) {
    o.policy = p;
    EXPECT_EQ(train(o).weights_digest, none.weights_digest) << p;
  }
  std::filesystem::remove_all(dir);
}

// A mixture of experts small enough for a test, with its load-balancing loss over 2 micro-batches.
TrainOptions tiny_moe(const std::string& data) {
  TrainOptions o = tiny(data);
  o.model.arch = "moe";
  o.model.experts = 4, o.model.top_k = 2, o.model.ffn = 32, o.model.aux_loss = 0.05;
  o.accum = 2;
  o.steps = 12;
  return o;
}

// The mixture of experts: routing recomputed under every policy gives the weights of none.
TEST(Train, MoeTrainsTheSameUnderRecompute) {
  const std::string dir = temp_dir("moe");
  TrainOptions o = tiny_moe(corpus_file(dir));
  const TrainResult none = train(o);
  EXPECT_LT(none.log.back().loss, none.log.front().loss);
  for (const char* p : {"full", "moe", "moe-act+attn"}) {
    o.policy = p;
    EXPECT_EQ(train(o).weights_digest, none.weights_digest) << p;
  }
  std::filesystem::remove_all(dir);
}

// And a resume after a crash gives the uninterrupted run's weights.
TEST(Train, MoeResumesBitwise) {
  const std::string dir = temp_dir("moe-resume");
  TrainOptions o = tiny_moe(corpus_file(dir));
  const TrainResult straight = train(o);
  o.save_dir = dir + "/run";
  o.save_every = 5;
  crash_after(o, 8);
  EXPECT_EQ(train(o, o.save_dir).weights_digest, straight.weights_digest);
  std::filesystem::remove_all(dir);
}

TEST(Train, ResumeAfterACrashContinuesBitwise) {
  const std::string dir = temp_dir("resume");
  const std::string data = corpus_file(dir);
  TrainOptions o = tiny(data);
  const TrainResult straight = train(o);

  o.save_dir = dir + "/run";
  o.save_every = 10;
  crash_after(o, 17);
  EXPECT_EQ(load_train_state(o.save_dir).header.at("step").get<int64_t>(), 10);
  const TrainResult resumed = train(o, o.save_dir);
  EXPECT_EQ(resumed.weights_digest, straight.weights_digest);
  // Its log is the whole run's: the 10 steps saved, then the 20 resumed.
  ASSERT_EQ(resumed.log.size(), 30u);
  for (size_t i = 0; i < 30; ++i) {
    EXPECT_EQ(resumed.log[i].step, straight.log[i].step);
    EXPECT_EQ(resumed.log[i].loss, straight.log[i].loss) << "step " << i + 1;
    EXPECT_EQ(std::isnan(resumed.log[i].val_loss), std::isnan(straight.log[i].val_loss)) << "step " << i + 1;
  }
  EXPECT_GE(resumed.log[10].elapsed_s, resumed.log[9].elapsed_s);  // the clock goes on
  std::filesystem::remove_all(dir);
}

// A state saved without the earlier steps' metrics (by release 0.12 or earlier) resumes with a log
// from its step on; saved again it holds those rows only, and a second resume reads them.
TEST(Train, AStateWithoutTheEarlierStepsMetricsResumesTwice) {
  const std::string dir = temp_dir("resume_metrics");
  TrainOptions o = tiny(corpus_file(dir));
  const TrainResult straight = train(o);
  o.save_dir = dir + "/run";
  o.save_every = 10;
  crash_after(o, 17);
  TrainState older = load_train_state(o.save_dir);
  older.tensors.erase(
      std::remove_if(older.tensors.begin(), older.tensors.end(), [](const auto& t) { return t.first == "metrics"; }),
      older.tensors.end());
  save_train_state(o.save_dir, older);
  crash_after(o, 25, o.save_dir);
  const TrainResult resumed = train(o, o.save_dir);
  EXPECT_EQ(resumed.weights_digest, straight.weights_digest);
  ASSERT_EQ(resumed.log.size(), 20u);
  EXPECT_EQ(resumed.restored, 10u);
  EXPECT_EQ(resumed.log.front().step, 11);
  EXPECT_EQ(resumed.log.front().loss, straight.log[10].loss);
  std::filesystem::remove_all(dir);
}

// Adam steps once a step: a header whose counts differ (or are negative) is refused, naming both,
// however its checksum came out (a state written by another program).
TEST(Train, AHeaderWhoseStepsDisagreeIsRefused) {
  const std::string dir = temp_dir("resume_steps");
  TrainOptions o = interrupted_run(dir, 8, 4, 5);
  TrainState s = load_train_state(o.save_dir);
  ASSERT_EQ(s.header.at("adam_steps").get<int64_t>(), 4);
  s.header["step"] = 2;
  save_train_state(o.save_dir, s);
  EXPECT_NE(testing::error_of([&] { train(o, o.save_dir); }).find("its step 2 and Adam's steps 4 must be equal"),
            std::string::npos);
  s.header["step"] = 4;
  save_train_state(o.save_dir, s);
  EXPECT_EQ(testing::error_of([&] { train(o, o.save_dir); }), "");
  std::filesystem::remove_all(dir);
}

// An explicit --blas-kernel on resume is the arithmetic check's to judge (it matters only where the
// saved GEMM runs the BLAS), not refused as a flag that differs from the saved one.
TEST(Train, AnExplicitBlasKernelIsLeftToTheArithmeticCheck) {
  const std::string dir = temp_dir("resume_kernel");
  TrainOptions o = interrupted_run(dir, 6, 3, 4);
  TrainState s = load_train_state(o.save_dir);
  s.header["options"]["blas-kernel"] = "Haswell";
  save_train_state(o.save_dir, s);
  const std::string refusal = testing::error_of([&] { train(o, o.save_dir, {"blas-kernel"}); });
  EXPECT_EQ(refusal.find("differs from the run saved"), std::string::npos) << refusal;
  std::filesystem::remove_all(dir);
}

// A saved run's id names its text; "fortunes" stands for Debian's, so a file of that name is
// recorded as ./fortunes and a resume without --data reads that file again.
TEST(Corpus, AFileNamedFortunesIsNotTheDefaultText) {
  const std::string dir = temp_dir("corpus_fortunes");
  std::filesystem::rename(corpus_file(dir), dir + "/fortunes");
  const std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir);
  const Corpus c = load_corpus("fortunes", 0.1, 8);
  std::filesystem::current_path(cwd);
  const auto id = split_corpus_id(c.id);
  ASSERT_TRUE(id.has_value()) << c.id;
  EXPECT_EQ(id->first, "./fortunes");
  std::filesystem::remove_all(dir);
}

// A resumed run holds what a new one holds: the state it was read from is let go once restored,
// and its steps peak at the memory model's prediction.
TEST(Train, AResumedRunPeaksAsPredicted) {
  const std::string dir = temp_dir("resume_peak");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 6, o.save_dir = dir + "/run", o.save_every = 2;
  crash_after(o, 3);
  const int64_t before = MemoryTracker::live();
  const TrainResult resumed = train(o, o.save_dir);
  int64_t peak = 0;
  for (size_t i = resumed.restored; i < resumed.log.size(); ++i) peak = std::max(peak, resumed.log[i].peak_bytes);
  EXPECT_EQ(peak - before, resumed.predicted_peak);
  std::filesystem::remove_all(dir);
}

// A stop request (TrainOptions::should_stop, the CLI's Ctrl-C) ends the run after the step under
// way and saves it, with no --save-every; the result gives the request's reason.
TEST(Train, AStopRequestSavesTheStepAndEnds) {
  const std::string dir = temp_dir("stop");
  TrainOptions o = tiny(corpus_file(dir));
  o.save_dir = dir + "/run";
  auto polls = std::make_shared<int>(0);
  o.should_stop = [polls] { return ++*polls == 7 ? 15 : 0; };
  const TrainResult r = train(o);
  EXPECT_EQ(r.stopped, 15);
  ASSERT_EQ(r.log.size(), 7u);
  EXPECT_EQ(load_train_state(o.save_dir).header.at("step").get<int64_t>(), 7);
  std::filesystem::remove_all(dir);
}

// A hang-up (SIGHUP) also takes the terminal away: the progress line that follows fails. The step
// is saved before that line is written.
TEST(Train, AStopSavesBeforeTheProgressLineThatMayFail) {
  const std::string dir = temp_dir("hangup");
  TrainOptions o = tiny(corpus_file(dir));
  o.save_dir = dir + "/run";
  auto polls = std::make_shared<int>(0);
  o.should_stop = [polls] { return ++*polls == 5 ? 1 : 0; };
  o.progress = [polls](const TrainProgress&) {
    if (*polls == 5) throw std::system_error(EIO, std::generic_category(), "cannot write to file");
  };
  EXPECT_THROW(train(o), std::system_error);
  EXPECT_EQ(load_train_state(o.save_dir).header.at("step").get<int64_t>(), 5);
  std::filesystem::remove_all(dir);
}

// A budget is planned on one micro-batch: a run whose accumulation keeps more than the budget under
// that plan is refused, naming its peak; the same budget without accumulation trains.
TEST(Train, ABudgetTheAccumulatedStepExceedsIsRefused) {
  const std::string dir = temp_dir("budget_accum");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 2, o.eval_every = 0;
  ModelConfig m = o.model;
  m.vocab = kByteVocab;
  const BlockSpec block = make_block(m);
  ResolvedPolicy none;
  none.layers.assign(m.layers, keep_everything(block));
  const int64_t one = simulate_memory(compile_step(std::make_shared<const ModelSpec>(make_model(m)), none), o.threads,
                                      nullptr, trainer_step_shape(1, 1, 0, 0))
                          .total_peak();
  o.policy = fmt::format("budget:{}", one);
  EXPECT_EQ(testing::error_of([&] { train(o); }), "");
  o.accum = 2;
  EXPECT_TRUE(contains(testing::error_of([&] { train(o); }), "is planned on one micro-batch, and this run's step"));
  std::filesystem::remove_all(dir);
}

TEST(Train, ResumeMayChangeThePolicyButNotTheTrajectory) {
  const std::string dir = temp_dir("resume_policy");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 20;
  o.save_dir = dir + "/run";
  o.save_every = 10;
  const TrainResult straight = [&] {
    TrainOptions s = o;
    s.save_dir.clear();
    return train(s);
  }();
  crash_after(o, 12);
  o.policy = "full";
  EXPECT_EQ(train(o, o.save_dir, {"policy"}).weights_digest, straight.weights_digest);
  std::filesystem::remove_all(dir);
}

// A resume that leaves the settings out continues the saved run's: its policy, evaluation and save
// settings, and saving into the folder it resumes from.
TEST(Train, AResumeLeavingSettingsOutKeepsTheSavedOnes) {
  const std::string dir = temp_dir("resume_settings");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 8, o.policy = "full", o.eval_every = 4, o.save_every = 2;
  o.save_dir = dir + "/run";
  crash_after(o, 3);
  const TrainResult resumed = train(tiny(o.data), o.save_dir);
  EXPECT_EQ(resumed.options.policy, "full");
  EXPECT_EQ(resumed.options.eval_every, 4);
  EXPECT_EQ(resumed.options.save_every, 2);
  EXPECT_EQ(resumed.options.save_dir, o.save_dir);
  EXPECT_EQ(load_train_state(o.save_dir).header.at("step").get<int64_t>(), 8);
  std::filesystem::remove_all(dir);
}

TEST(Train, RefusesAMismatchedResume) {
  const std::string dir = temp_dir("mismatch");
  TrainOptions o = interrupted_run(dir, 5, 2, 3);
  TrainOptions other = o;
  other.model.dim = 64;
  try {
    train(other, o.save_dir, {"dim"});
    FAIL() << "accepted --dim 64 for a dim 32 run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--dim 64 differs from the run saved in"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// The data is its bytes: the same file under another path (a resume from another folder) continues
// the run; other bytes are refused.
TEST(Train, AResumeTakesTheSameDataUnderAnotherPath) {
  const std::string dir = temp_dir("resume_data_path");
  TrainOptions o = interrupted_run(dir, 5, 2, 3);
  std::filesystem::create_directories(dir + "/moved");
  std::filesystem::copy_file(o.data, dir + "/moved/text.txt");
  std::filesystem::copy_file(o.data, dir + "/moved/longer.txt");
  std::ofstream(dir + "/moved/longer.txt", std::ios::app) << "more";
  TrainOptions moved = o;
  moved.data = dir + "/moved/longer.txt";
  EXPECT_TRUE(contains(testing::error_of([&] { train(moved, o.save_dir, {"data"}); }), "--data differs"));
  moved.data = dir + "/moved/../moved/text.txt";
  EXPECT_EQ(testing::error_of([&] { train(moved, o.save_dir, {"data"}); }), "");
  std::filesystem::remove_all(dir);
}

// Explicit choices that name what gpt2 builds by default continue a run saved without them.
TEST(Train, AResumeAcceptsChoicesTheSavedKindBuiltByDefault) {
  const std::string dir = temp_dir("resume_choices");
  TrainOptions o = interrupted_run(dir, 5, 2, 3);
  o.model.norm = Norm::Layer, o.model.positions = Positions::Learned, o.model.mlp = Mlp::Gelu;
  o.model.bias = Switch::On, o.model.tied = Switch::On, o.model.fused_qkv = Switch::On, o.model.loss = Loss::Model;
  const TrainResult r = train(o, o.save_dir, {"norm", "positions", "mlp", "bias", "tied", "qkv", "loss"});
  EXPECT_EQ(r.log.back().step, 5);
  std::filesystem::remove_all(dir);
}

// A choice other than the one the saved run built is refused, named with the saved one.
TEST(Train, AResumeRefusesAChoiceTheSavedRunDidNotBuild) {
  const std::string dir = temp_dir("resume_choice_differs");
  TrainOptions o = interrupted_run(dir, 5, 2, 3);
  o.model.bias = Switch::Off;
  try {
    train(o, o.save_dir, {"bias"});
    FAIL() << "accepted --bias off for a run built with biases";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "--bias \"off\" differs from the run saved in")) << e.what();
    EXPECT_TRUE(contains(e.what(), "(\"on\")")) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Trains two steps of the tiny model, saving to dir/run; returns that folder.
std::string saved_run(const std::string& dir) {
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 2;
  o.save_dir = dir + "/run";
  train(o);
  return o.save_dir;
}

TEST(TrainState, CorruptFileIsRefused) {
  const std::string dir = temp_dir("corrupt");
  const std::string run = saved_run(dir);
  const std::string file = run + "/state.bin";
  {
    // One byte in the middle, inverted: a fixed value could be the byte already there.
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const auto middle = static_cast<std::streamoff>(std::filesystem::file_size(file) / 2);
    f.seekg(middle);
    const int byte = f.get();
    f.seekp(middle);
    f.put(static_cast<char>(byte ^ 0xff));
  }
  try {
    load_train_state(run);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is corrupt or truncated"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(TrainState, TruncatedFileIsRefused) {
  const std::string dir = temp_dir("truncated");
  const std::string run = saved_run(dir);
  const std::string file = run + "/state.bin";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 100);
  EXPECT_THROW(load_train_state(run), Error);
  std::filesystem::resize_file(file, 10);
  EXPECT_THROW(load_train_state(run), Error);
  std::filesystem::remove_all(dir);
}

// A forger can recompute FNV-1a: every header field is checked as untrusted input. Rewrites the
// header of `file` with `edit` and a valid checksum.
void forge(const std::string& file, const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(file, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto u64 = [&](size_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data[at + i])) << (8 * i);
    return v;
  };
  const uint64_t len = u64(8);
  nlohmann::json h = nlohmann::json::parse(data.substr(16, len));
  edit(h);
  const std::string json = h.dump();
  std::string out = data.substr(0, 8);
  for (int i = 0; i < 8; ++i) out += static_cast<char>((json.size() >> (8 * i)) & 0xff);
  out += json + data.substr(16 + len, data.size() - 8 - 16 - len);
  const uint64_t f = detail::fnv1a(out.data(), out.size());
  for (int i = 0; i < 8; ++i) out += static_cast<char>((f >> (8 * i)) & 0xff);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << out;
}

// A state of an earlier release lacks the flags added since: they held their defaults then, and a
// resume that gives another value is refused naming that default.
TEST(Train, AResumeComparesAFlagTheSavedRunPredatesWithItsDefault) {
  const std::string dir = temp_dir("older");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 4, o.save_dir = dir + "/run", o.save_every = 2;
  crash_after(o, 3);  // saved at step 2 of 4
  forge(o.save_dir + "/state.bin", [](nlohmann::json& h) { h["options"].erase("expert-weights"); });
  TrainOptions other = o;
  other.model.expert_weights = ExpertWeights::Activation;
  try {
    train(other, o.save_dir, {"expert-weights"});
    FAIL() << "accepted --expert-weights activation for a run saved before the flag";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--expert-weights \"activation\" differs from the run saved in"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("(\"combine\")"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(train(o, o.save_dir, {"expert-weights"}));  // the default it had: the same run
  std::filesystem::remove_all(dir);
}

std::string load_error(const std::string& run) {
  try {
    load_train_state(run);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A sigmoid-routed run with a balancing loss saved before the router's arithmetic changed would go
// on with other arithmetic: it is refused, naming the change. The same run saved now resumes, and
// so do earlier runs the change left alone: softmax routing, or sigmoid without a balancing loss.
TEST(Train, AResumeRefusesASigmoidRunOfTheEarlierRouterArithmetic) {
  const std::string dir = temp_dir("router_arithmetic");
  auto refusal = [&](Router router, double aux, bool forged) {
    std::filesystem::remove_all(dir + "/run");
    TrainOptions o = tiny_moe(corpus_file(dir));
    o.model.router = router, o.model.aux_loss = aux;
    o.steps = 4, o.save_dir = dir + "/run", o.save_every = 2;
    crash_after(o, 3);
    if (forged) forge(o.save_dir + "/state.bin", [](nlohmann::json& h) { h["options"].erase("router-arithmetic"); });
    return testing::error_of([&] { train(o, o.save_dir); });
  };
  EXPECT_TRUE(contains(refusal(Router::Sigmoid, 0.05, true), "the sigmoid router's earlier arithmetic"));
  EXPECT_EQ(refusal(Router::Sigmoid, 0.05, false), "");
  EXPECT_EQ(refusal(Router::Softmax, 0.05, true), "");
  EXPECT_EQ(refusal(Router::Sigmoid, 0.0, true), "");
  std::filesystem::remove_all(dir);
}

TEST(TrainState, ForgedHeadersAreRefused) {
  const std::string dir = temp_dir("forged");
  const std::string run = saved_run(dir);
  const std::string file = run + "/state.bin", good = dir + "/good.bin";
  std::filesystem::copy_file(file, good);
  auto again = [&](const std::function<void(nlohmann::json&)>& edit) {
    std::filesystem::copy_file(good, file, std::filesystem::copy_options::overwrite_existing);
    forge(file, edit);
    return load_error(run);
  };
  EXPECT_EQ(again([](nlohmann::json&) {}), "");  // the forger's checksum is valid
  EXPECT_TRUE(contains(again([](nlohmann::json& h) { h["tensors"][0]["offset"] = -8; }), "negative or non-integer"));
  EXPECT_TRUE(contains(again([](nlohmann::json& h) { h["tensors"][0]["offset"] = 1ULL << 62; }), "past the end"));
  EXPECT_TRUE(contains(again([](nlohmann::json& h) {
                         h["tensors"][0]["shape"] = {1 << 30, 1 << 30};
                       }),
                       "shape dimension"));
  EXPECT_TRUE(contains(again([](nlohmann::json& h) { h["tensors"][0]["shape"] = {-1}; }), "shape dimension"));
  EXPECT_TRUE(contains(again([](nlohmann::json& h) { h["tensors"][0]["name"] = 7; }), "malformed tensor list"));
  EXPECT_TRUE(contains(again([](nlohmann::json& h) { h.erase("tensors"); }), "no tensor list"));
  std::filesystem::remove_all(dir);
}

TEST(TrainState, AnotherFormatIsRefused) {
  const std::string dir = temp_dir("format");
  const std::string run = saved_run(dir);
  forge(run + "/state.bin", [](nlohmann::json& h) { h["format"] = "remat train state 2"; });
  EXPECT_TRUE(contains(load_error(run), "has format 'remat train state 2'")) << load_error(run);
  std::filesystem::remove_all(dir);
}

// An earlier release's file (magic REMATTS1, another checksum) is named as such, not as corrupt.
TEST(TrainState, AnEarlierReleasesFileIsNamed) {
  const std::string dir = temp_dir("earlier");
  const std::string run = saved_run(dir);
  std::fstream f(run + "/state.bin", std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(7);
  f.put('1');
  f.close();
  EXPECT_TRUE(contains(load_error(run), "written by an earlier remat (format REMATTS1)")) << load_error(run);
  std::filesystem::remove_all(dir);
}

// A forged header whose fields have the wrong type, read only once the resume needs them.
TEST(Train, AResumeRefusesAMalformedHeader) {
  const std::string dir = temp_dir("malformed");
  const std::string run = saved_run(dir);
  forge(run + "/state.bin", [](nlohmann::json& h) { h["step"] = "two"; });
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 4;
  try {
    train(o, run, {});
    FAIL() << "resumed a state whose step is text";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "is corrupt: malformed header")) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Adam's moments are checked as the weights are: the bytes fit, the shape does not.
TEST(Train, AResumeRefusesMomentsOfAnotherShape) {
  const std::string dir = temp_dir("moments");
  const std::string run = saved_run(dir);
  std::string name;
  forge(run + "/state.bin", [&](nlohmann::json& h) {
    h["step"] = h["adam_steps"] = 1;  // a run not yet finished
    for (auto& t : h["tensors"])
      if (t["name"].get<std::string>().rfind("adam.v:", 0) == 0 && t["shape"].size() == 2) {
        name = t["name"].get<std::string>();
        t["shape"] = {t["shape"][0].get<int64_t>() * t["shape"][1].get<int64_t>()};
        return;
      }
  });
  ASSERT_FALSE(name.empty());
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 4;
  try {
    train(o, run, {});
    FAIL() << "resumed with " << name << " flattened";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "'" + name + "' is (")) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(TrainState, NonRegularFilesAreRefused) {
  const std::string dir = temp_dir("fifo");
  ASSERT_EQ(::mkfifo((dir + "/state.bin").c_str(), 0600), 0);
  EXPECT_TRUE(contains(load_error(dir), "is a FIFO"));  // and does not block in open()
  std::filesystem::remove_all(dir);
}

TEST(TrainState, MissingFolderNamesTheFile) {
  try {
    load_train_state("/nonexistent/run");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot read train state '/nonexistent/run/state.bin'"), std::string::npos);
  }
}

// The norm train() clips at and checks before each update: an overflowed gradient gives an
// infinite norm (the step is stopped), not a finite one that an update would spread.
TEST(Train, TheGradientNormSeesAnOverflowedGradient) {
  std::vector<at::Tensor> grads = {at::tensor({3.0f, 0.0f}), at::tensor({4.0f})};
  EXPECT_DOUBLE_EQ(gradient_norm(grads), 5.0);
  grads[1][0] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(gradient_norm(grads)));
  grads[1][0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(std::isfinite(gradient_norm(grads)));
}

TEST(Train, NanLossStopsAndKeepsTheLastGoodState) {
  const std::string dir = temp_dir("nan");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 30;
  o.warmup = 0;
  o.lr = 1e30;
  o.min_lr = 1e30;
  o.clip = 0;
  o.save_dir = dir + "/run";
  o.save_every = 1;
  try {
    train(o);
    FAIL() << "a 1e30 learning rate trained without a NaN";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::Runtime);
    EXPECT_NE(std::string(e.what()).find("stopped before the update"), std::string::npos) << e.what();
  }
  // The last good state still loads, and holds only finite numbers.
  const TrainState kept = load_train_state(o.save_dir);
  ASSERT_FALSE(kept.tensors.empty());
  for (const auto& [name, t] : kept.tensors) {
    if (!t.is_floating_point() || name == "metrics") continue;  // (metrics: NaN where no validation ran)
    EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name;
  }
  std::filesystem::remove_all(dir);
}

TEST(Sample, ContinuesThePromptDeterministically) {
  const std::string dir = temp_dir("sample");
  TrainOptions o = tiny(corpus_file(dir));
  o.steps = 20;
  o.save_dir = dir + "/run";
  train(o);
  SampleOptions s;
  s.prompt = "the quick";
  s.tokens = 40;
  const std::string a = sample(o.save_dir, s), b = sample(o.save_dir, s);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), s.prompt.size() + 40);
  EXPECT_EQ(a.substr(0, s.prompt.size()), s.prompt);
  std::filesystem::remove_all(dir);
}

// Each refusal names its own value (not whatever check happened to come first).
TEST(Train, BadOptionsAreRefused) {
  TrainOptions o = tiny("");
  o.steps = 0;
  EXPECT_NE(testing::error_of([&] { train(o); }).find("--steps must be >= 1, got 0"), std::string::npos);
  o = tiny("/nonexistent/text.txt");
  EXPECT_NE(testing::error_of([&] { train(o); }).find("cannot read --data '/nonexistent/text.txt'"), std::string::npos);
  o = tiny("");
  o.policy = "attn+";
  EXPECT_NE(testing::error_of([&] { train(o); }).find("empty term in 'attn+'"), std::string::npos);
}

// check_train_options, which the CLI calls before any work, refuses a policy that does not parse
// and a float-data arch without reading the corpus (here a file that does not exist).
TEST(Train, CheckRefusesAPolicyAndAnArchBeforeReadingData) {
  auto refusal = [](const TrainOptions& o) {
    try {
      check_train_options(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  TrainOptions o = tiny("/nonexistent/text.txt");
  EXPECT_EQ(refusal(o), "(accepted)");
  o.policy = "attn+";
  EXPECT_NE(refusal(o).find("attn+"), std::string::npos) << refusal(o);
  o = tiny("/nonexistent/text.txt");
  o.model.arch = "seed";
  o.model.dropout = 0;
  EXPECT_NE(refusal(o).find("token models"), std::string::npos) << refusal(o);
}

// none's exact bytes for one step of `o`.
StepMemory none_step(const TrainOptions& o) {
  const ResolvedPolicy none = Policy::parse("none").resolve(make_block(o.model), o.model.layers);
  return simulate_memory(o.model, none, o.threads);
}

// A step that runs out of memory stops with a report: the policy, the peak predicted for it, the
// limit. The steps fit exactly; what runs them out is memory taken after the check (here, between
// the first step and the second).
TEST(TrainMemory, OutOfMemoryDuringAStepNamesThePolicyAndItsPrediction) {
  TrainOptions o = tiny(corpus_file(temp_dir("oom")));
  o.steps = 2;
  o.policy = "uniform:2";
  const int64_t peak =
      simulate_memory(o.model, Policy::parse(o.policy).resolve(make_block(o.model), o.model.layers), o.threads)
          .total_peak();
  o.memory_limit = MemoryTracker::live() + peak;
  at::Tensor taken;
  o.progress = [&](const TrainProgress&) {
    if (!taken.defined()) taken = at::empty({1 << 16});  // 256 KiB
  };
  try {
    train(o);
    FAIL() << "memory taken between the steps did not stop the second";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.kind(), Error::Kind::Runtime);
    EXPECT_TRUE(contains(m, "out of memory in step 2 under policy 'uniform:2'")) << m;
    EXPECT_TRUE(contains(m, "predicted to peak at " + bytes_str(peak))) << m;
    EXPECT_TRUE(contains(m, "the limit is " + bytes_str(o.memory_limit))) << m;
  }
  EXPECT_EQ(MemoryTracker::limit(), 0);  // the run's limit is lifted again
}

// A policy whose exact prediction is over the limit is refused before the first step.
TEST(TrainMemory, PredictionOverTheLimitIsRefusedFirst) {
  TrainOptions o = tiny(corpus_file(temp_dir("oom_first")));
  o.steps = 2;
  const int64_t peak = none_step(o).total_peak();
  o.memory_limit = MemoryTracker::live() + peak - 1;  // one byte short of none's exact peak
  o.progress = [](const TrainProgress&) { FAIL() << "a step ran"; };
  try {
    train(o);
    FAIL() << "none over the limit was not refused";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.kind(), Error::Kind::Usage);
    EXPECT_TRUE(contains(m, "policy 'none' peaks at " + bytes_str(peak))) << m;
    EXPECT_TRUE(contains(m, "--policy budget:")) << m;  // and the plan that fits
  }
  o.memory_limit += 1;  // at the exact peak it trains
  o.progress = nullptr;
  EXPECT_NO_THROW(train(o));
}

}  // namespace
}  // namespace remat
