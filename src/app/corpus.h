// The training text of `remat train` (internal): a corpus of bytes and the batches drawn from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/config.h"

namespace remat {

// The vocabulary of a model trained on a corpus: its tokens are bytes.
inline constexpr int64_t kByteVocab = 256;

struct Corpus {
  std::string train, val;
  std::string id;  // source, size and hash: a resumed run must see the same bytes
};

// The text of `path` ("" = Debian's English fortunes), its last `val_fraction` held out. Throws
// remat::Error for a missing or unreadable file, one too short for windows of `seq` bytes, or
// val_fraction outside (0, 0.5).
Corpus load_corpus(const std::string& path, double val_fraction, int64_t seq);

// A Corpus::id ("PATH:SIZE:HASH") split into its source and its content ("SIZE:HASH"), at its last
// two colons (a path may hold colons); nullopt when it has fewer.
std::optional<std::pair<std::string, std::string>> split_corpus_id(const std::string& id);

// (B, T) inputs and next-byte targets from windows of `text` starting at `starts`.
std::pair<at::Tensor, at::Tensor> windows(const std::string& text, const std::vector<int64_t>& starts, int64_t seq);

// The training batch of (step, micro): a pure function of the seed, so a resumed run draws the same.
std::pair<at::Tensor, at::Tensor> train_batch(const Corpus& c, const ModelConfig& m, uint64_t seed, int64_t step,
                                              int64_t micro);

}  // namespace remat
