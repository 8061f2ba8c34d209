// remat's release, as CMake's project() states it.
#pragma once

#include <string_view>

namespace remat {

// "0.19.0": the release this library was built from (CHANGELOG.md lists what each one changed).
std::string_view version();

}  // namespace remat
