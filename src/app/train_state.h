// A training run on disk (`remat train --save DIR` / `--resume DIR`). "Train state" here, so as not
// to be confused with remat::checkpoint, which is activation checkpointing.
//
// One file, DIR/state.bin: the magic "REMATTS2", a JSON header (model config, training options,
// step, data identity, tensor directory), the raw tensor bytes (weights and Adam moments; dropout
// needs no generator state, its masks are seeded by step and micro-batch), and an FNV-1a 64-bit
// checksum of everything before it (util/hash.h). A "REMATTS1" file, an earlier release's, is
// refused. Written through a temporary file, fsync and rename: a crash mid-write leaves the
// previous state intact.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

namespace remat {

// The header's "format", which load_train_state requires.
inline constexpr const char* kTrainStateFormat = "remat train state";

struct TrainState {
  nlohmann::json header;                                    // config, options, step, data, digest
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // name -> CPU tensor

  // The tensor named `name`; throws remat::Error naming the file when missing.
  const at::Tensor& tensor(const std::string& name) const;
  // The same, refused unless it has `like`'s shape and dtype: remat::Error naming `dir`, the tensor
  // and both shapes and dtypes.
  const at::Tensor& tensor_like(const std::string& name, const at::Tensor& like, const std::string& dir) const;
};

// Writes DIR/state.bin atomically, creating DIR if needed. Throws remat::Error on I/O failure.
void save_train_state(const std::string& dir, const TrainState& state);

// Throws a usage remat::Error naming `dir` unless save_train_state(dir, ...) could write there: the
// folder exists and takes a new file, or it can be created. A folder that already holds a saved
// run is refused unless that run is the one being resumed (`resume_dir` names the same folder):
// a new run never writes over an unfinished one. Creates nothing that outlives the call.
void check_state_dir(const std::string& dir, const std::string& resume_dir = "");

// While alive, this process is the one writer of the run folder `dir` (created if missing): an
// advisory lock (flock) that a second `remat train` saving there is refused by, naming the folder.
// Temporary files a killed writer left in the folder are removed once the lock is held.
class RunLock {
 public:
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

// Reads DIR/state.bin. Throws remat::Error (usage kind) for a missing, truncated or corrupt file,
// or an unknown format version, naming the file and what is wrong.
TrainState load_train_state(const std::string& dir);

// FNV-1a 64 of the bytes of `tensors` in order, as 16 hex digits: equal iff the weights are.
std::string digest(const std::vector<at::Tensor>& tensors);

}  // namespace remat
