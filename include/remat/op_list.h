// The op registry: one row per op kind, REMAT_OP(Kind, name), in OpKind order (ops.h). Adding an op
// is its own file under src/ops/, which defines `const OpDef k<Kind>` (forward, backward, what the
// backward reads, FLOPs, scratch, a reference for the tests), and one row here. The names are
// tested against each definition (OpRegistry.NamesMatchKinds).
// No include guard: ops.h and src/ops/registry.cpp include it with their own REMAT_OP.
REMAT_OP(Linear, linear)
REMAT_OP(LayerNorm, layer_norm)
REMAT_OP(Gelu, gelu)
REMAT_OP(Relu, relu)
REMAT_OP(DropoutMask, dropout_mask)
REMAT_OP(Dropout, dropout)
REMAT_OP(Scores, scores)
REMAT_OP(Softmax, softmax)
REMAT_OP(AttnValues, attn_values)
REMAT_OP(Add, add)
REMAT_OP(Embedding, embedding)
REMAT_OP(CrossEntropy, cross_entropy)
REMAT_OP(MseLoss, mse_loss)
REMAT_OP(FlashAttention, flash_attention)
REMAT_OP(RmsNorm, rms_norm)
REMAT_OP(Rope, rope)
REMAT_OP(Swiglu, swiglu)
REMAT_OP(ChunkedCrossEntropy, chunked_cross_entropy)
REMAT_OP(Route, route)
REMAT_OP(Dispatch, dispatch)
REMAT_OP(ExpertLinear, expert_linear)
REMAT_OP(Combine, combine)
REMAT_OP(Weigh, weigh)
REMAT_OP(Unpermute, unpermute)
