#include "remat/error.h"
