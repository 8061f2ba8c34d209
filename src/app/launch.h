// `remat train --nproc N`: N local ranks of one data-parallel run (internal).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace remat {

// Starts `args` (this executable's arguments, without --nproc) `nproc` times, as ranks 0..N-1 of a
// c10d group that meets at 127.0.0.1 on a free port: each child gets RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT, as torchrun sets them. Waits for all. When one dies or fails, says
// so on `say` (naming the rank, its pid and the signal or exit code), stops the others (SIGTERM,
// then SIGKILL after `grace`), and returns non-zero: the failed rank's exit code, or 1 for a
// signal. Returns 0 when every rank succeeds.
int launch_local(int nproc, const std::vector<std::string>& args, std::chrono::seconds grace,
                 const std::function<void(const std::string&)>& say);

}  // namespace remat
