// Output files that are either the old version or the new one, never a part (internal).
#pragma once

#include <string>
#include <string_view>

namespace remat {

// Writes `content` to `path`. A regular file (or a new one) is written through a temporary file in
// the same folder, fsync and rename: readers see the old file or the new one; the folder is then
// synced, so that where the file system allows it the new one survives a crash once this returns. A symbolic link is
// followed, and its target replaced that way. A device or FIFO (/dev/null, /dev/stdout) is written
// to directly, never replaced. Throws remat::Error (runtime) naming the path and the reason.
void write_file_atomic(const std::string& path, std::string_view content);

// Throws a usage remat::Error ("cannot write 'x/y.json': No such file or directory") unless
// write_file_atomic(path, ...) could succeed: the folder takes a new file, or the device opens for
// writing. Creates nothing that outlives the call.
void check_writable(const std::string& path);

}  // namespace remat
