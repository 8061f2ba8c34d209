// Data parallelism on PyTorch's own distributed engine, c10d: Gloo between CPU processes (the only
// process group remat builds). remat adds no transport of its own.
//
//   remat::DistConfig d = remat::dist_config_from_env();      // RANK, WORLD_SIZE, MASTER_ADDR, ...
//   remat::Communicator comm(d);                               // rendezvous through a c10d TCPStore
//   remat::GradientBuckets buckets(model->compiled_step(), model->parameters(), 2 << 20, /*micro=*/1, comm);
//   model->set_grad_sink(buckets.sink());                      // the engine hands gradients over
//   ... forward, backward: each bucket's all-reduce starts when its last gradient arrives ...
//   buckets.wait();                                            // only what is still in flight
//
// Every collective has a timeout (DistConfig::timeout); a lost rank makes the others fail with an
// error instead of waiting. See docs/design.md, NOTE [Data parallelism].
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "remat/memory_model.h"
#include "remat/schedule.h"

namespace remat {

struct DistConfig {
  int rank = 0;                           // this process, 0 <= rank < world
  int world = 1;                          // processes in the group
  int local_rank = 0;                     // on this host (the launcher's numbering)
  std::string master_addr = "127.0.0.1";  // where rank 0 serves the c10d TCPStore
  int master_port = 29500;                // its port, 1..65535
  std::chrono::seconds timeout{60};       // rendezvous and every collective
};

// From torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (world 1 when
// none is set). Throws remat::Error naming a variable that does not parse or is out of range.
DistConfig dist_config_from_env();
// Throws remat::Error unless 0 <= rank < world, world >= 1, 0 < port < 65536, timeout > 0.
void validate(const DistConfig& d);

// A c10d process group of the configured ranks (Gloo). Collectives on CPU tensors work in place.
class Communicator {
 public:
  explicit Communicator(const DistConfig& config);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return config_.rank; }
  int world() const { return config_.world; }
  const DistConfig& config() const { return config_; }

  // An all-reduce (sum) of `t`, in place, started now; wait() it before reading `t`.
  class Pending {
   public:
    // Blocks until done; throws remat::Error (runtime) naming the operation when a rank is lost or
    // the timeout passes.
    void wait();
    // Whether the operation has finished, without waiting.
    bool done() const;
    // Seconds since the communicator started at which it was launched and finished (when done).
    double launched_at = 0, finished_at = -1;

   private:
    friend class Communicator;
    struct State;
    std::shared_ptr<State> state_;
  };
  Pending all_reduce(at::Tensor& t, const std::string& what);
  // Blocking collectives.
  void broadcast(at::Tensor& t, int root, const std::string& what);
  void send(at::Tensor& t, int to, int tag, const std::string& what);
  void recv(at::Tensor& t, int from, int tag, const std::string& what);
  void barrier(const std::string& what);
  // Seconds since construction (the clock of Pending's timestamps).
  double now() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  DistConfig config_;
};

// The model's parameter gradients in flat buckets, in reverse layer order: the order the backward
// produces them. A parameter belongs to the bucket of the stage that gives its last gradient (a
// tied weight: the stem's), so it is reduced once. A bucket's all-reduce starts as soon as all its
// gradients of the step have arrived; wait() waits only for what is still in flight. The buckets
// are the gradients: each parameter's is a view into one (grad(i)).
class GradientBuckets {
 public:
  // `bucket_bytes`: a bucket closes at the first stage boundary at or past this size. `micro`:
  // backward passes per step (gradient accumulation) before the all-reduce. REQUIRES: `params`
  // are the plan's parameters, in its order.
  GradientBuckets(const CompiledStep& plan, const std::vector<at::Tensor>& params, int64_t bucket_bytes, int micro,
                  Communicator& comm);

  // What the engine calls with each parameter gradient (model parameter id); see GPT::set_grad_sink.
  std::function<void(int, at::Tensor)> sink();
  // Waits for every bucket's all-reduce of this step; then grad(i) holds the sum over ranks.
  void wait();
  // The gradient of parameter i, a view into its bucket.
  const at::Tensor& grad(int i) const { return views_[i]; }
  const std::vector<at::Tensor>& grads() const { return views_; }
  // Bytes of all buckets (the persistent gradient memory of a rank).
  int64_t bytes() const;
  int buckets() const { return static_cast<int>(flat_.size()); }
  // The bucket of parameter i, and the parameters of bucket b in their flat order.
  int bucket_of(int i) const { return bucket_of_[i]; }
  const std::vector<int>& params_of(int b) const { return members_[b]; }
  // The last step's all-reduces: launch and finish times (Communicator::now()), per bucket.
  struct Timing {
    double launched = 0, finished = 0;
  };
  const std::vector<Timing>& timings() const { return timings_; }

 private:
  void take(int param, at::Tensor grad);
  void launch(int b);

  Communicator& comm_;
  int micro_;
  std::vector<at::Tensor> flat_;           // per bucket
  std::vector<std::vector<int>> members_;  // per bucket
  std::vector<int> bucket_of_, expected_, arrived_, remaining_;
  std::vector<at::Tensor> views_;               // per parameter
  std::vector<Communicator::Pending> pending_;  // per bucket
  std::vector<Timing> timings_;
};

// ZeRO-1's exchange: after each rank has updated the parameter elements it owns (a ShardedAdam over
// [shard_first(r), shard_first(r + 1)), src/core/shard.h), every element is broadcast from its owner,
// in place.
void exchange_owned(const std::vector<at::Tensor>& params, Communicator& comm);

}  // namespace remat
