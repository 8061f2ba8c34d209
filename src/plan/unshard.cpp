#include "plan/unshard.h"

namespace remat::detail {

std::vector<UnshardRequest> unshard_requests(const std::vector<int64_t>& params, int ranks, bool casts,
                                             int all_gather_stream) {
  std::vector<UnshardRequest> out;
  if (ranks > 1) {
    int64_t flat = 0;
    for (int64_t n : params) flat += n;
    out.push_back({flat, all_gather_stream, -1});
  }
  int cast = -1;
  for (int64_t n : params) {
    if (ranks == 1 && casts) {
      const int next = static_cast<int>(out.size());
      out.push_back({n, 0, -1});
      if (cast >= 0) out.push_back({0, 0, cast});
      cast = next;
    }
    out.push_back({n, 0, -1});
  }
  if (cast >= 0) out.push_back({0, 0, cast});
  return out;
}

}  // namespace remat::detail
