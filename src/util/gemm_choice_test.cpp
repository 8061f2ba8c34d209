// --gemm auto and the records a run keeps: choose_gemm, gemm_record / restore_gemm and the floor's
// fastest GEMM.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "remat/runtime.h"
#include "test_util.h"
#include "util/gemm.h"
#include "util/gemm_testing.h"

namespace remat {
namespace {

// A fresh cache folder per test, removed after.
class CacheFolder {
 public:
  CacheFolder() : path_(std::filesystem::temp_directory_path() / ("remat-gemm-test-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path_);
  }
  ~CacheFolder() { std::filesystem::remove_all(path_); }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

bool has_blas() { return detail::available(detail::GemmImpl::Blas); }

TEST(GemmRecord, RoundTripsAMixedTable) {
  if (!has_blas() || !detail::available(detail::GemmImpl::OneDnn)) GTEST_SKIP() << "needs oneDNN and a cblas_sgemm";
  const detail::GemmTableScope scope;
  const std::string mixed = "linear=blas-threads,onednn,blas;head=onednn,blas,onednn";
  restore_gemm(mixed);
  EXPECT_EQ(gemm_record(), mixed);
  EXPECT_EQ(detail::gemm_table()[2], detail::GemmImpl::Blas);
}

// Saved runs before per-class records name the GEMM "onednn" or "blas": the tables they ran.
TEST(GemmRecord, OldNamesAreTheUniformTables) {
  EXPECT_EQ(detail::to_string(detail::parse_gemm_table("onednn")),
            "linear=onednn,onednn,onednn;head=onednn,onednn,onednn");
  EXPECT_EQ(detail::to_string(detail::parse_gemm_table("blas")),
            "linear=blas-threads,blas-threads,blas-threads;head=blas,blas,blas");
}

TEST(GemmRecord, RefusesWhatItDidNotWrite) {
  for (const char* bad :
       {"linear=blas,blas;head=blas,blas,blas", "linear=blas,blas,blas,blas;head=blas,blas,blas",
        "linear=mkl,blas,blas;head=blas,blas,blas", "linear=blas,blas,blas;head=blas-threads,blas,blas",
        "head=blas,blas,blas;linear=blas,blas,blas", "auto", ""}) {
    try {
      detail::parse_gemm_table(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

// Each class keeps the BLAS unless another GEMM on remat's kernel threads beat it (then at a
// higher rate), or (linears only, all three at once) moves to the BLAS's threads when a pass of
// every class ran faster on them.
TEST(GemmChoice, SetsEachClassByItsRounds) {
  if (!has_blas()) GTEST_SKIP() << "one GEMM only: nothing to choose";
  const detail::GemmTableScope scope;
  const CacheFolder cache;
  const ThreadConfig one{1, 1};
  const GemmMeasurement m = choose_gemm(one, cache.str());
  ASSERT_EQ(m.classes.size(), static_cast<size_t>(detail::kGemmClasses));
  EXPECT_NE(m.source.find("measured now"), std::string::npos) << m.source;
  ASSERT_EQ(m.pass_ms.size(), 2u);
  const bool threaded = m.classes[0].chosen == "blas-threads";
  if (threaded) {
    EXPECT_LT(m.pass_ms[1].second, m.pass_ms[0].second);
  }
  const detail::GemmTable chosen = detail::gemm_table();
  for (int c = 0; c < detail::kGemmClasses; ++c) {
    const GemmClassRates& r = m.classes[static_cast<size_t>(c)];
    EXPECT_EQ(r.product, detail::to_string(static_cast<detail::GemmClass>(c)));
    EXPECT_EQ(detail::to_string(chosen[static_cast<size_t>(c)]), r.chosen) << r.product;
    if (threaded && c < 3) {
      EXPECT_EQ(r.chosen, "blas-threads") << r.product;
      continue;
    }
    double blas = 0, rate = 0;
    for (const auto& [name, g] : r.gflops) {
      if (name == "blas") blas = g;
      if (name == r.chosen) rate = g;
    }
    EXPECT_NE(r.chosen, "blas-threads") << r.product;
    if (r.chosen != "blas") {
      EXPECT_GT(rate, blas) << r.product;
    }
  }
}

// A second call reads the cached choice instead of timing again, and sets it over whatever table
// is in place.
TEST(GemmChoice, ASecondCallSetsTheCachedChoice) {
  if (!has_blas()) GTEST_SKIP() << "one GEMM only: nothing to choose";
  const detail::GemmTableScope scope;
  const CacheFolder cache;
  const GemmMeasurement m = choose_gemm({1, 1}, cache.str());
  const detail::GemmTable chosen = detail::gemm_table();
  detail::set_gemm_table(detail::parse_gemm_table(chosen == detail::parse_gemm_table("blas") ? "onednn" : "blas"));
  const GemmMeasurement again = choose_gemm({1, 1}, cache.str());
  EXPECT_NE(again.source.find("cached"), std::string::npos) << again.source;
  EXPECT_EQ(detail::gemm_table(), chosen);
  EXPECT_EQ(again.pass_ms, m.pass_ms);
}

// With set_remeasure on (--remeasure) the cached choice is neither read nor kept: it is timed
// again and the entry replaced (a marker put into its pass times is gone).
TEST(GemmChoice, RemeasuringReplacesTheCachedChoice) {
  if (!has_blas()) GTEST_SKIP() << "one GEMM only: nothing to choose";
  const detail::GemmTableScope scope;
  const CacheFolder cache;
  if (choose_gemm({1, 1}, cache.str()).pass_ms.empty()) GTEST_SKIP() << "no threaded BLAS: no pass times to mark";
  constexpr double kMarker = 12345.0;  // a plausible pass time, so the entry stays usable
  for (const auto& entry : std::filesystem::directory_iterator(cache.str())) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(entry.path()));
    for (auto& p : j.at("pass_ms")) p[1] = kMarker;
    std::ofstream(entry.path()) << j.dump();
  }
  ASSERT_NE(choose_gemm({1, 1}, cache.str()).source.find("cached"), std::string::npos);  // the marked entry is used
  const GemmMeasurement m = [&] {
    const testing::Remeasuring on;
    return choose_gemm({1, 1}, cache.str());
  }();
  EXPECT_NE(m.source.find("measured now"), std::string::npos) << m.source;
  for (const auto& [name, ms] : m.pass_ms) EXPECT_NE(ms, kMarker) << name;
  std::vector<nlohmann::json> entries;
  for (const auto& entry : std::filesystem::directory_iterator(cache.str()))
    entries.push_back(nlohmann::json::parse(std::ifstream(entry.path())));
  ASSERT_EQ(entries.size(), 1u);
  for (const auto& p : entries[0].at("pass_ms")) EXPECT_NE(p[1].get<double>(), kMarker);
}

// An entry edited by hand, or of an older format (no pass times), is measured again, never trusted.
TEST(GemmChoice, AnUnreadableCacheEntryIsMeasuredAgain) {
  if (!has_blas()) GTEST_SKIP() << "one GEMM only: nothing to choose";
  const detail::GemmTableScope scope;
  const CacheFolder cache;
  choose_gemm({1, 1}, cache.str());
  for (const auto& entry : std::filesystem::directory_iterator(cache.str())) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(entry.path()));
    j.erase("pass_ms");
    std::ofstream(entry.path()) << j.dump();
  }
  EXPECT_NE(choose_gemm({1, 1}, cache.str()).source.find("measured now"), std::string::npos);
  for (const auto& entry : std::filesystem::directory_iterator(cache.str()))
    std::ofstream(entry.path()) << "{ not json";
  EXPECT_NE(choose_gemm({1, 1}, cache.str()).source.find("measured now"), std::string::npos);
}

// A challenger replaces the incumbent only when it was faster in every round but `lost`: a better
// median with one round more lost keeps the incumbent, as does a tie; of two that won, the lower
// median; and never on a minority of rounds, whatever `lost` allows.
TEST(GemmChoice, AChallengerMustBeFasterInAllRoundsButOne) {
  const std::vector<double> held = {10, 11, 12, 10, 11, 10, 11, 12, 10, 11};
  const std::vector<double> faster = {9, 10, 11, 9, 10, 9, 10, 11, 9, 10};
  std::vector<double> one_lost = faster, two_lost = faster;
  one_lost[3] = 13;
  two_lost[3] = two_lost[7] = 13;
  EXPECT_EQ(detail::winner_of_rounds({held, faster}, 0), 1u);
  EXPECT_EQ(detail::winner_of_rounds({faster, held}, 1), 0u);
  EXPECT_EQ(detail::winner_of_rounds({held, one_lost}, 0), 1u) << "one busy round forgiven";
  EXPECT_EQ(detail::winner_of_rounds({held, one_lost}, 0, 0), 0u) << "unless none may be lost";
  EXPECT_EQ(detail::winner_of_rounds({held, two_lost}, 0), 0u);
  EXPECT_EQ(detail::winner_of_rounds({held, held}, 0), 0u);
  EXPECT_EQ(detail::winner_of_rounds({held, {9, 10}}, 0), 0u);
  EXPECT_EQ(detail::winner_of_rounds({{}, {}}, 0), 0u);
  EXPECT_EQ(detail::winner_of_rounds({{10, 11}, {9, 12}}, 0), 0u) << "1 of 2 rounds is no majority";
  std::vector<double> fastest = faster;
  for (double& t : fastest) t -= 1;
  EXPECT_EQ(detail::winner_of_rounds({fastest, held, faster}, 1), 0u);
  EXPECT_EQ(detail::winner_of_rounds({faster, held, fastest}, 1), 2u);
}

// A challenger that won most rounds by a clear lead takes the class whatever a busy spell cost it
// (here 1.32x, three rounds of ten lost); a small lead with those losses does not, nor a clear
// lead in too few rounds.
TEST(GemmChoice, AChallengerWithAClearLeadInMostRoundsTakesTheClass) {
  const std::vector<double> held(10, 10.0);
  auto challenger = [](double won_ms, std::initializer_list<int> lost) {
    std::vector<double> t(10, won_ms);
    for (int r : lost) t[static_cast<size_t>(r)] = 13.0;
    return t;
  };
  EXPECT_EQ(detail::winner_of_rounds({held, challenger(7.6, {1, 4, 8})}, 0), 1u) << "1.32x in its middle round";
  EXPECT_EQ(detail::winner_of_rounds({held, challenger(8.6, {1, 4, 8})}, 0), 1u) << "1.16x";
  EXPECT_EQ(detail::winner_of_rounds({held, challenger(8.8, {1, 4, 8})}, 0), 0u) << "1.14x: not clear";
  EXPECT_FALSE(detail::undecided({held, challenger(7.6, {1, 4, 8})}, 0)) << "decided by its lead";
  EXPECT_TRUE(detail::undecided({held, challenger(8.8, {1, 4, 8})}, 0)) << "timed in ten rounds more";
  EXPECT_EQ(detail::winner_of_rounds({held, challenger(5.0, {1, 3, 5, 7, 9})}, 0), 0u) << "5 of 10 is no majority";
  EXPECT_EQ(detail::winner_of_rounds({challenger(7.6, {1, 4, 8}), held}, 0), 0u) << "a slower challenger";
}

// A challenger that won most of the first ten rounds but lost two (a busy spell) is timed in ten
// more, and takes the class if it lost at most three of the twenty; a decided first ten (won 9,
// or no majority) ends there.
TEST(GemmChoice, AnUndecidedChallengerIsTimedInTenRoundsMore) {
  const std::vector<double> held(20, 10.0);
  // Rounds a challenger loses (12 ms against 10), the rest it wins (9 ms).
  auto challenger = [](std::initializer_list<int> lost) {
    std::vector<double> t(20, 9.0);
    for (int r : lost) t[static_cast<size_t>(r)] = 12.0;
    return t;
  };
  // decide_by_rounds over these samples: the choice, and how many rounds it took.
  auto decide = [&](const std::vector<double>& c) {
    std::vector<std::vector<double>> ms(2);
    int rounds = 0;
    const size_t chosen = detail::decide_by_rounds(
        [&](int r) {
          ms[0].push_back(held[static_cast<size_t>(r - 1)]);
          ms[1].push_back(c[static_cast<size_t>(r - 1)]);
          rounds = r;
        },
        [&] { return ms; }, 0);
    return std::pair<size_t, int>{chosen, rounds};
  };
  EXPECT_EQ(decide(challenger({3})), (std::pair<size_t, int>{1, 10})) << "9 of 10 decides at once";
  EXPECT_EQ(decide(challenger({0, 2, 4, 6, 8})), (std::pair<size_t, int>{0, 10})) << "5 of 10 is no majority";
  EXPECT_EQ(decide(challenger({3, 4})), (std::pair<size_t, int>{1, 20})) << "8 of 10, then 9 of 10 more";
  EXPECT_EQ(decide(challenger({3, 4, 15})), (std::pair<size_t, int>{1, 20})) << "17 of 20";
  EXPECT_EQ(decide(challenger({3, 4, 15, 16})), (std::pair<size_t, int>{0, 20})) << "16 of 20 keeps the incumbent";
  EXPECT_EQ(decide(challenger({1, 3, 5, 7})), (std::pair<size_t, int>{0, 20})) << "6 of 10, then 10 of 10 more";
  // A challenger that won the first ten takes the class then, beside an undecided one.
  std::vector<std::vector<double>> three(3);
  int rounds = 0;
  const std::vector<double> won = challenger({3}), unsure = challenger({3, 4});
  const size_t chosen = detail::decide_by_rounds(
      [&](int r) {
        const auto at = static_cast<size_t>(r - 1);
        three[0].push_back(held[at]), three[1].push_back(unsure[at]), three[2].push_back(won[at]);
        rounds = r;
      },
      [&] { return three; }, 0);
  EXPECT_EQ(chosen, 2u);
  EXPECT_EQ(rounds, 10);
}

// The floor's rate is the best of every GEMM the build has, whatever the engine runs now.
TEST(FastestMatmul, IsTheBestOfEveryGemm) {
  const detail::GemmTableScope scope;
  detail::set_gemm_table(detail::parse_gemm_table(detail::available(detail::GemmImpl::OneDnn) ? "onednn" : "blas"));
  const detail::GemmTable before = detail::gemm_table();
  const FastestMatmul f = fastest_matmul_gflops(128, 3);
  size_t available = 0;
  for (detail::GemmImpl i : {detail::GemmImpl::OneDnn, detail::GemmImpl::Blas, detail::GemmImpl::BlasThreads})
    available += detail::available(i) ? 1 : 0;
  ASSERT_EQ(f.rates.size(), available);
  const auto best = std::max_element(f.rates.begin(), f.rates.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  EXPECT_EQ(f.gemm, best->first);
  EXPECT_EQ(f.gflops, best->second);
  EXPECT_GT(f.gflops, 0);
  EXPECT_EQ(detail::gemm_table(), before) << "the engine's choice was not put back";
}

}  // namespace
}  // namespace remat
