// GradientBuckets: gradients in flat buckets, reverse layer order, each reduced as soon as it is
// complete (NOTE [Data parallelism]).
#include <ATen/ATen.h>

#include "core/shard.h"
#include "remat/data_parallel.h"
#include "remat/error.h"

namespace remat {

GradientBuckets::GradientBuckets(const CompiledStep& plan, const std::vector<at::Tensor>& params, int64_t bucket_bytes,
                                 int micro, Communicator& comm)
    : comm_(comm), micro_(micro) {
  if (params.size() != plan.params.size())
    fail("gradient buckets: {} parameters for a step of {}; give the model's parameters, in its order", params.size(),
         plan.params.size());
  if (bucket_bytes <= 0) fail("GradientBuckets bucket_bytes must be positive, got {}", bucket_bytes);
  if (micro < 1) fail("gradient buckets need at least one backward per step, got {}", micro);
  const int n = static_cast<int>(params.size());
  // The stage that gives each parameter its last gradient: the first one (in forward order) to use it.
  std::vector<int> last_stage(n, -1);
  for (size_t s = 0; s < plan.stages.size(); ++s)
    for (int id : plan.stages[s].params)
      if (last_stage[id] < 0) last_stage[id] = static_cast<int>(s);
  bucket_of_.assign(n, -1);
  std::vector<std::vector<int>> members(1);
  int64_t size = 0;
  for (size_t s = plan.stages.size(); s-- > 0;) {
    const std::vector<int>& ids = plan.stages[s].params;
    for (size_t k = ids.size(); k-- > 0;) {
      const int id = ids[k];
      if (last_stage[id] != static_cast<int>(s) || bucket_of_[id] >= 0) continue;
      bucket_of_[id] = static_cast<int>(members.size()) - 1;
      members.back().push_back(id);
      size += params[id].nbytes();
    }
    if (size >= bucket_bytes && s > 0) {  // close at the stage boundary
      members.emplace_back();
      size = 0;
    }
  }
  if (members.back().empty()) members.pop_back();
  members_ = members;
  views_.assign(n, at::Tensor());
  for (size_t b = 0; b < members_.size(); ++b) {
    int64_t numel = 0;
    for (int id : members_[b]) numel += params[id].numel();
    flat_.push_back(at::zeros({numel}, params[0].options()));
    int64_t at = 0;
    for (int id : members_[b]) {
      views_[id] = flat_[b].narrow(0, at, params[id].numel()).view(params[id].sizes());
      at += params[id].numel();
    }
  }
  expected_.assign(n, 0);
  for (const ModelParam& p : plan.params) expected_[&p - plan.params.data()] = p.uses * micro_;
  arrived_.assign(n, 0);
  remaining_.assign(members_.size(), 0);
  for (size_t b = 0; b < members_.size(); ++b) remaining_[b] = static_cast<int>(members_[b].size());
  pending_.resize(members_.size());
  timings_.resize(members_.size());
}

std::function<void(int, at::Tensor)> GradientBuckets::sink() {
  return [this](int param, at::Tensor grad) { take(param, std::move(grad)); };
}

void GradientBuckets::take(int param, at::Tensor grad) {
  // One more would be summed into a bucket whose all-reduce may already run.
  if (arrived_[param] >= expected_[param])
    fail(
        "gradient buckets: parameter {} got more gradients than the {} backward pass(es) of a step; wait() ends a "
        "step before the next one's backward",
        param, expected_[param]);
  at::Tensor& view = views_[param];
  if (arrived_[param] == 0)
    view.copy_(grad);  // the first of the step: what autograd would steal
  else
    view.add_(grad);  // then summed in arrival order, as autograd does
  grad = at::Tensor();
  if (++arrived_[param] < expected_[param]) return;
  if (--remaining_[bucket_of_[param]] == 0) launch(bucket_of_[param]);
}

void GradientBuckets::launch(int b) {
  pending_[b] = comm_.all_reduce(flat_[b], fmt::format("the gradient all-reduce of bucket {}", b));
  timings_[b].launched = pending_[b].launched_at;
}

void GradientBuckets::wait() {
  for (size_t b = 0; b < pending_.size(); ++b) {
    if (remaining_[b] != 0) REMAT_INTERNAL("bucket {} is waiting for {} gradient(s) that never came", b, remaining_[b]);
    pending_[b].wait();
    timings_[b].finished = pending_[b].finished_at;
    pending_[b] = Communicator::Pending();
  }
  std::fill(arrived_.begin(), arrived_.end(), 0);
  for (size_t b = 0; b < members_.size(); ++b) remaining_[b] = static_cast<int>(members_[b].size());
}

int64_t GradientBuckets::bytes() const {
  int64_t n = 0;
  for (const at::Tensor& f : flat_) n += f.nbytes();
  return n;
}

void exchange_owned(const std::vector<at::Tensor>& params, Communicator& comm) {
  int64_t total = 0;
  for (const at::Tensor& p : params) total += p.numel();
  int64_t flat = 0;
  for (const at::Tensor& p : params) {
    at::Tensor whole = p.detach().view({-1});
    for (int r = 0; r < comm.world(); ++r) {
      const int64_t begin = std::max(flat, shard_first(total, r, comm.world()));
      const int64_t end = std::min(flat + p.numel(), shard_first(total, r + 1, comm.world()));
      if (begin >= end) continue;
      at::Tensor part = whole.narrow(0, begin - flat, end - begin);
      comm.broadcast(part, r, "the exchange of updated weights");
    }
    flat += p.numel();
  }
}

}  // namespace remat
