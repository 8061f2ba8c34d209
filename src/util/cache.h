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

// The CPU as /proc/cpuinfo names it: its model name, family, model, stepping and the vector units
// it shows ("AMD EPYC (family 25, model 17, stepping 1; avx2 fma)"); "unknown cpu" when there is
// no such file. The key of every calibration cached for this machine.
std::string cpu_model(const std::string& cpuinfo = "/proc/cpuinfo");

}  // namespace remat::detail
