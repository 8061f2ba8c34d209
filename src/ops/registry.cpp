// The op registry: op_list.h's rows, each pointing at the definition in its op's own file.
#include <iterator>

#include "remat/error.h"
#include "remat/ops.h"

namespace remat {

namespace ops {
#define REMAT_OP(kind, name) extern const OpDef k##kind;
#include "remat/op_list.h"
#undef REMAT_OP
}  // namespace ops

namespace {

const OpDef* const kTable[] = {
#define REMAT_OP(kind, name) &ops::k##kind,
#include "remat/op_list.h"
#undef REMAT_OP
};
static_assert(std::size(kTable) == static_cast<size_t>(OpKind::Count), "one registry row per OpKind");

const char* const kNames[] = {
#define REMAT_OP(kind, name) #name,
#include "remat/op_list.h"
#undef REMAT_OP
};

}  // namespace

const OpDef& op_def(OpKind kind) {
  if (kind >= OpKind::Count) REMAT_INTERNAL("op kind {} is not registered", static_cast<int>(kind));
  return *kTable[static_cast<size_t>(kind)];
}

std::string_view op_name(OpKind kind) { return kind < OpKind::Count ? kNames[static_cast<size_t>(kind)] : "?"; }

}  // namespace remat
