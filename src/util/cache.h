// Where remat keeps what it measured about this machine, and what a cached measurement is keyed on
// (internal).
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "remat/blas_kernel.h"

namespace remat::detail {

// `given` when set, else $REMAT_CACHE, $XDG_CACHE_HOME/remat, ~/.cache/remat, or ./.remat-cache.
std::string cache_folder(const std::string& given);

// The JSON cached at `path`, or nothing when there is none to use: missing, not a regular file (a
// FIFO planted in the folder would block a read), over 16 MiB, or not JSON; `why` (when given)
// then says what was wrong with a file that is there. Nothing, too (and `why` untouched), while
// set_remeasure is on. The caller measures again, and replaces a file it can write over
// (write_file_atomic writes into a FIFO or device, never replacing it).
std::optional<nlohmann::json> read_cached_json(const std::string& path, std::string* why = nullptr);

// The running executable's path, size and modification time: a rebuilt remat measures afresh
// instead of trusting what an older build measured.
std::string build_identity();

// The CPU: the model name, family, model and stepping of the first processor in /proc/cpuinfo,
// and the vector units `cpu` has (CPUID's, with the OS's register state: blas::cpu_features)
// ("AMD EPYC (family 25, model 17, stepping 1; avx2 fma)"); without a cpu family (not x86), the
// model name (or "unknown cpu") with the CPU's implementer, part, variant and revision when given;
// "unknown cpu" when there is no such file. The key of every calibration cached for this machine.
std::string cpu_model(const std::string& cpuinfo = "/proc/cpuinfo",
                      const blas::CpuFeatures& cpu = blas::cpu_features());

// The machine's architecture as uname gives it ("x86_64", "aarch64").
std::string machine_architecture();

// The kind of CPU, from the same first processor, as a folder name (letters, digits, '-', '_'):
// where it gives a cpu family (x86) the vendor, family, model and the widest vector unit `cpu` has
// ("intel-6-167-avx512", "amd-25-17-avx2"); elsewhere the architecture, the CPU's implementer and
// part ("aarch64-0x41-0xd0c"); "x" for a field the file lacks or leaves empty. Throws
// remat::Error when the file cannot be read.
std::string cpu_kind(const std::string& cpuinfo = "/proc/cpuinfo", const blas::CpuFeatures& cpu = blas::cpu_features(),
                     const std::string& arch = machine_architecture());

}  // namespace remat::detail
