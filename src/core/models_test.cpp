// Models as people have them: the presets hold their published parameter counts, and Hugging Face
// config.json files become the block they describe, or are refused by name.
#include "remat/models.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "remat/block.h"
#include "remat/error.h"

namespace remat {
namespace {

TEST(Models, PresetsHoldTheirPublishedParameterCounts) {
  int checked = 0;
  for (const NamedModel& m : named_models()) {
    if (m.params == 0) continue;
    EXPECT_EQ(make_model(m.config).param_numel(), m.params) << m.name;
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

class ConfigFile : public ::testing::Test {
 protected:
  std::string write(const std::string& json) {
    path_ =
        (std::filesystem::temp_directory_path() / ("remat-config-" + std::to_string(::getpid()) + ".json")).string();
    std::ofstream(path_) << json;
    return path_;
  }
  void TearDown() override { std::filesystem::remove(path_); }
  std::string path_;
};

// Llama 3.1 8B's config.json (meta-llama/Llama-3.1-8B): the llama preset's model, 8,030,261,248 parameters.
TEST_F(ConfigFile, LlamaBecomesTheLlamaBlock) {
  const ModelConfig c = read_model_config(write(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false, "vocab_size": 128256,
    "max_position_embeddings": 131072, "hidden_act": "silu", "attention_bias": false, "mlp_bias": false})"));
  EXPECT_EQ(c.arch, "llama");
  EXPECT_EQ(c.kv(), 8);
  EXPECT_EQ(make_model(c).param_numel(), named_model("llama3.1-8b").params);
}

TEST_F(ConfigFile, Qwen2BiasesQkvAndQwen3NormalisesTheirHeads) {
  const std::string shape = R"("hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32)";
  const ModelConfig q2 = read_model_config(write(R"({"architectures": ["Qwen2ForCausalLM"], )" + shape + "}"));
  EXPECT_TRUE(q2.qkv_bias);
  EXPECT_GE(make_block(q2).find("q"), 0);
  const ModelConfig q3 =
      read_model_config(write(R"({"architectures": ["Qwen3ForCausalLM"], "head_dim": 16, )" + shape + "}"));
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_GE(make_block(q3).find("q_norm"), 0);
}

TEST_F(ConfigFile, GptNeoxTurnsAQuarterOfEachHeadWithAParallelResidual) {
  const ModelConfig c = read_model_config(write(R"({"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 6144,
    "intermediate_size": 24576, "num_attention_heads": 64, "num_hidden_layers": 44, "rotary_pct": 0.25,
    "rotary_emb_base": 10000, "vocab_size": 50432, "tie_word_embeddings": false, "max_position_embeddings": 2048})"));
  EXPECT_EQ(c.positions, Positions::Rope);
  EXPECT_EQ(c.rotary_fraction, 0.25);
  EXPECT_TRUE(c.parallel_residual);
  EXPECT_EQ(make_model(c).param_numel(), named_model("gpt-neox-20b").params);
}

TEST_F(ConfigFile, Gpt2IsTheGpt2Block) {
  const ModelConfig c = read_model_config(write(R"({"architectures": ["GPT2LMHeadModel"], "n_embd": 768,
    "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"})"));
  EXPECT_EQ(make_model(c).param_numel(), named_model("gpt2-small").params);
}

// The mixtures of experts: their published parameter counts from their config.json fields.
TEST_F(ConfigFile, MixtralAndQwen3MoeBecomeTheMoeBlock) {
  const ModelConfig mixtral = read_model_config(write(R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "rope_theta": 1e6})"));
  EXPECT_EQ(mixtral.arch, "moe");
  EXPECT_EQ(make_model(mixtral).param_numel(), named_model("mixtral-8x7b").params);
  const ModelConfig qwen = read_model_config(write(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": false})"));
  EXPECT_EQ(qwen.head_dim(), 128);
  EXPECT_TRUE(qwen.qk_norm);
  EXPECT_EQ(make_model(qwen).param_numel(), named_model("qwen3-30b-a3b").params);
}

TEST_F(ConfigFile, WhatIsNotModelledIsRefusedByName) {
  auto message = [&](const std::string& json) {
    try {
      read_model_config(write(json));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message(R"({"architectures": ["DeepseekV3ForCausalLM"]})").find("multi-head latent attention"),
            std::string::npos);
  EXPECT_NE(message(R"({"architectures": ["FalconForCausalLM"]})").find("'FalconForCausalLM' is not modelled"),
            std::string::npos);
  EXPECT_NE(message(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8, "attention_bias": true})")
                .find("o_proj"),
            std::string::npos);
  EXPECT_NE(message("{ not json").find("is not JSON"), std::string::npos);
}

}  // namespace
}  // namespace remat
