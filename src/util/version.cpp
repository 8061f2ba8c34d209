#include "remat/version.h"

namespace remat {

std::string_view version() { return REMAT_VERSION; }

}  // namespace remat
