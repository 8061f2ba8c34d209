// Models as people have them: a named preset, or a Hugging Face config.json.
//
//   remat::ModelConfig c = remat::read_model_config("Llama-3.1-8B/config.json");  // llama kind, GQA, untied
//   c.seq = 8192;                                   // the training length is the run's, not the file's
//   const remat::NamedModel& m = remat::named_model("llama3.1-405b");
//   m.global_batch                                  // 2048 sequences: the published run's
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/config.h"

namespace remat {

struct NamedModel {
  std::string name;          // "llama3.1-8b"
  ModelConfig config;        // bf16, batch 1, seq the length it was trained at
  int64_t global_batch = 0;  // sequences per optimizer step of the published run; 0: none published
  int64_t params = 0;        // its published parameter count (each parameter once)
  std::string source;        // the paper or model card the figures come from
};

// The presets, in the order --model lists them.
const std::vector<NamedModel>& named_models();
// The preset named `name`. Throws remat::Error listing the names otherwise.
const NamedModel& named_model(std::string_view name);

// A Hugging Face config.json as a ModelConfig (batch 1, bf16, seq the file's context length, which
// a plan replaces with its run's): LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
// Qwen3ForCausalLM become the llama kind (biased q/k/v for Qwen2, per-head q/k norms for Qwen3; a
// head_dim other than hidden / heads becomes ModelConfig.head_size), MixtralForCausalLM and
// Qwen3MoeForCausalLM the moe kind, GPT2LMHeadModel the gpt2 kind, GPTNeoXForCausalLM gpt2 with
// rotary positions on a share of each head and the parallel residual. Any other architecture is
// refused by name, with what is missing; so are fields that change the model and are not
// modelled (biases on o_proj or the MLP alone). Throws remat::Error naming the file and field.
ModelConfig read_model_config(const std::string& path);

}  // namespace remat
