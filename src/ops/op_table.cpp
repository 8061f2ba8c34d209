// One adapter pair per OpKind, in enum order.
#include <iterator>

#include "ops/op_env.h"

namespace remat::detail {

extern const OpImpl kLinearImpl, kLayerNormImpl, kGeluImpl, kReluImpl, kDropoutMaskImpl, kDropoutImpl, kScoresImpl, kSoftmaxImpl,
    kAttnValuesImpl, kAddImpl, kEmbeddingImpl, kCrossEntropyImpl, kMseImpl, kFlashAttentionImpl;

namespace {
const OpImpl* const kTable[] = {
    &kLinearImpl,  &kLayerNormImpl,  &kGeluImpl, &kReluImpl,      &kDropoutMaskImpl,  &kDropoutImpl, &kScoresImpl,
    &kSoftmaxImpl, &kAttnValuesImpl, &kAddImpl, &kEmbeddingImpl, &kCrossEntropyImpl, &kMseImpl, &kFlashAttentionImpl,
};
static_assert(std::size(kTable) == static_cast<size_t>(OpKind::Count), "kTable needs one entry per OpKind");
}  // namespace

const OpImpl& op_impl(OpKind kind) { return *kTable[static_cast<size_t>(kind)]; }

}  // namespace remat::detail
