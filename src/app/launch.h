// `remat train --nproc N`: N local ranks of one data-parallel run (internal).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace remat {

// Starts `args` (this executable's arguments, without --nproc) `nproc` times, as ranks 0..N-1 of a
// c10d group that meets at 127.0.0.1 on a free port: each child gets RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT, as torchrun sets them. Waits for all. The ranks' stderr passes
// through the launcher; their error lines are held back. The ranks run in a process group of their
// own, and a rank never outlives the launcher (a parent-death signal, SIGKILL). SIGINT, SIGTERM or
// SIGHUP to the launcher is passed on to every rank once: they finish the step under way, save
// and exit with 128 + the signal (a second signal kills them). A rank that exits so of itself (a
// signal sent to it alone) is followed by the others after the same step. When one rank dies or
// fails, the others are stopped (SIGTERM, then SIGKILL after `grace`) and `say` gets one line: the
// rank that caused it (one killed by a signal before one that failed after it), how it ended and
// its error. Returns its exit code (1 for a signal), 128 + the signal of a stop, 0 when every rank
// succeeds.
int launch_local(int nproc, const std::vector<std::string>& args, std::chrono::seconds grace,
                 const std::function<void(const std::string&)>& say);

}  // namespace remat
