// remat sample: text from a trained model's saved weights.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include <ATen/ATen.h>

#include "app/corpus.h"
#include "app/train.h"
#include "app/train_state.h"
#include "remat/error.h"
#include "remat/model.h"

namespace remat {

void check_sample_options(const SampleOptions& o) {
  // Below it the logits over the temperature overflow a double, and the distribution is NaN.
  constexpr double kLowestTemperature = 1e-6;
  if (!(o.temperature >= kLowestTemperature) || !std::isfinite(o.temperature))
    fail("--temperature must be finite and at least {}, got {}", kLowestTemperature, o.temperature);
  if (o.top_k < 0 || o.top_k > 256) fail("--top-k must be in 0..256 (0 = all), got {}", o.top_k);
  if (o.tokens < 0 || o.tokens > kMaxSampleTokens)
    fail("--tokens must be in 0..{} (bytes to generate), got {}", kMaxSampleTokens, o.tokens);
}

std::string sample(const std::string& dir, const SampleOptions& o) {
  check_sample_options(o);
  const TrainState s = load_train_state(dir);
  const TrainOptions defaults;
  TrainOptions t;
  try {
    t = options_from(s.header.at("options"), defaults);
  } catch (const nlohmann::json::exception& e) {
    fail("train state in '{}' is corrupt: malformed options ({})", dir, e.what());
  }
  t.model.vocab = kByteVocab;
  t.model.batch = 1;
  GPT model(t.model, Policy::parse("none"));
  {
    at::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& w = s.tensor_like("param:" + item.key(), item.value(), dir);
      if (!at::isfinite(w).all().item<bool>())
        fail("train state in '{}' holds non-finite weights in '{}'; resume from an earlier copy", dir, item.key());
      item.value().copy_(w);
    }
  }
  model->eval();
  std::mt19937_64 rng(o.seed);
  std::string text = o.prompt.empty() ? std::string("\n") : o.prompt;
  const int64_t seq = t.model.seq;
  using Clock = std::chrono::steady_clock;
  Clock::time_point next = Clock::now() + std::chrono::seconds(1);
  for (int64_t n = 0; n < o.tokens; ++n) {
    // The last `seq` bytes, left-aligned; causal attention makes the padding after them irrelevant.
    const int64_t len = std::min<int64_t>(seq, static_cast<int64_t>(text.size()));
    at::Tensor x = at::zeros({1, seq}, at::kLong);
    for (int64_t i = 0; i < len; ++i)
      x[0][i] = static_cast<int64_t>(static_cast<unsigned char>(text[text.size() - len + i]));
    const at::Tensor logits = model->logits(x)[0][len - 1].to(at::kDouble) / o.temperature;
    const at::Tensor row = logits.contiguous();
    std::vector<double> w(row.data_ptr<double>(), row.data_ptr<double>() + 256);
    if (o.top_k > 0) {
      std::vector<double> sorted = w;
      std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(), std::greater<double>());
      const double cut = sorted[o.top_k - 1];
      for (double& v : w)
        if (v < cut) v = -std::numeric_limits<double>::infinity();
    }
    const double mx = *std::max_element(w.begin(), w.end());
    for (double& v : w) v = std::exp(v - mx);
    std::discrete_distribution<int> pick(w.begin(), w.end());
    text += static_cast<char>(pick(rng));
    if (o.progress && Clock::now() >= next) {
      o.progress(n + 1, o.tokens);
      next = Clock::now() + std::chrono::seconds(1);
    }
  }
  return text;
}

}  // namespace remat
