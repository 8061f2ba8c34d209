// Where remat keeps what it measured about this machine, and what a cached measurement is keyed on
// (internal).
#pragma once

#include <string>

namespace remat::detail {

// `given` when set, else $REMAT_CACHE, $XDG_CACHE_HOME/remat, ~/.cache/remat, or ./.remat-cache.
std::string cache_folder(const std::string& given);

// The running executable's path, size and modification time: a rebuilt remat measures afresh
// instead of trusting what an older build measured.
std::string build_identity();

// The CPU's model name from /proc/cpuinfo ("AMD EPYC 7B13"), "unknown cpu" when there is none.
std::string cpu_model();

}  // namespace remat::detail
