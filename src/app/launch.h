// `remat train --nproc N`: N local ranks of one data-parallel run (internal).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace remat {

// The variable that gives a rank its launcher's pid: a stop signal from the launcher repeats one the
// rank may have had already (the terminal's Ctrl-C reaches every process of its group; a scheduler
// may signal each process), so the rank takes it as the same stop.
inline constexpr const char* kLauncherPidVariable = "REMAT_LAUNCHER_PID";
// The launcher's pid from kLauncherPidVariable, or 0 when this process is no rank of launch_local.
pid_t launcher_pid();
// Unblocks SIGINT, SIGTERM and SIGHUP, which launch_local's ranks start with blocked.
void unblock_stop_signals();

// Starts `args` (this executable's arguments, without --nproc) `nproc` times, as ranks 0..N-1 of a
// c10d group that meets at 127.0.0.1 on a free port: each child gets RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT, as torchrun sets them. Waits for all. The ranks' stderr passes
// through the launcher; their error lines are held back. A rank never outlives the launcher (a
// parent-death signal, SIGKILL). Each rank gets kLauncherPidVariable, and SIGINT, SIGTERM and SIGHUP
// blocked until it unblocks them (unblock_stop_signals, once its handler is in place). A stop signal
// to the launcher is passed on to every rank once: they finish the step under way, save and exit
// with 128 + the signal; a second signal to the launcher kills them. A rank that exits so of itself
// (a signal sent to it alone) is followed by the others after the same step. When one rank dies or
// fails, the others are stopped (SIGTERM, then SIGKILL after `grace`) and `say` gets one line: the
// rank that caused it (one killed by a signal before one that failed after it), how it ended and
// its error. Returns its exit code (1 for a signal), 128 + the signal of a stop, 0 when every rank
// succeeds.
int launch_local(int nproc, const std::vector<std::string>& args, std::chrono::seconds grace,
                 const std::function<void(const std::string&)>& say);

}  // namespace remat
