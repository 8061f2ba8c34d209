// Block kinds (internal): what each file in src/blocks/ defines, and the list of them (kinds.cpp).
//
// A block kind is one file: builders for its stem, its block and its head from a ModelConfig, and
// its own checks. Parameters carry their roles (block.h, ParamSpec: init, decay, tied_to) and
// tensors their tags, so nothing outside the kind's file knows its names.
#pragma once

#include "remat/block.h"
#include "remat/config.h"

namespace remat::blocks {

struct BlockKind {
  const char* name = "";
  const char* doc = "";
  BlockSpec (*stem)(const ModelConfig&) = nullptr;  // null: the data is the first block's input
  BlockSpec (*block)(const ModelConfig&) = nullptr;
  // The head; with loss = false it ends at the logits (sampling), or is null when the kind has none.
  BlockSpec (*head)(const ModelConfig&, bool loss) = nullptr;
  // What this kind supports beyond validate()'s generic checks; throws remat::Error. May be null.
  void (*validate)(const ModelConfig&) = nullptr;
  // Sets each decoder choice left Default in cfg (norm, positions, mlp, bias, tied, qkv) to the
  // one this kind builds. Null: the kind takes no choices (validate refuses them).
  void (*resolve_choices)(ModelConfig&) = nullptr;
  bool has_logits = false;  // head(cfg, false) is defined
  bool routes = false;      // a mixture of experts: ModelConfig.ep may split its experts
  bool causal = true;       // attends to earlier positions only: flash attention can run it
};

// The kind named cfg.arch. Throws remat::Error listing the kinds for an unknown name.
const BlockKind& block_kind(std::string_view name);

}  // namespace remat::blocks
