#include "remat/models.h"

#include <nlohmann/json.hpp>

#include "remat/error.h"
#include "util/paths.h"

namespace remat {

namespace {

using Json = nlohmann::json;

ModelConfig shape(const char* arch, int64_t layers, int64_t dim, int64_t heads, int64_t kv, int64_t ffn, int64_t seq,
                  int64_t vocab, double dropout) {
  ModelConfig c;
  c.arch = arch, c.layers = layers, c.dim = dim, c.heads = heads, c.kv_heads = kv, c.ffn = ffn, c.seq = seq;
  c.vocab = vocab, c.dropout = dropout, c.batch = 1, c.dtype = DType::BF16;
  return c;
}

std::vector<NamedModel> presets() {
  std::vector<NamedModel> m;
  auto add = [&](const char* name, ModelConfig c, int64_t batch, int64_t params, const char* source) {
    m.push_back({name, c, batch, params, source});
  };
  ModelConfig gpt2 = shape("gpt2", 12, 768, 12, 0, 0, 1024, 50257, 0.1);
  gpt2.dtype = DType::F32;
  add("gpt2-small", gpt2, 512, 124439808, "Radford et al. 2019; openai-community/gpt2 config.json");
  add("gpt3-175b", shape("gpt2", 96, 12288, 96, 0, 0, 2048, 50257, 0.1), 1536, 0,
      "Brown et al. 2020, Table 2.1: 96 layers of 12288, 96 heads, 1536 sequences of 2048 (3.2M tokens)");
  ModelConfig llama2 = shape("llama", 32, 4096, 32, 0, 11008, 4096, 32000, 0.0);
  add("llama2-7b", llama2, 1024, 6738415616,
      "Touvron et al. 2023 (Llama 2): 4M tokens per step; meta-llama/Llama-2-7b-hf");
  llama2.layers = 40, llama2.dim = 5120, llama2.heads = 40, llama2.ffn = 13824;
  add("llama2-13b", llama2, 1024, 13015864320, "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-13b-hf");
  llama2.layers = 80, llama2.dim = 8192, llama2.heads = 64, llama2.kv_heads = 8, llama2.ffn = 28672;
  add("llama2-70b", llama2, 1024, 68976648192, "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-70b-hf");
  ModelConfig llama3 = shape("llama", 32, 4096, 32, 8, 14336, 8192, 128256, 0.0);
  llama3.rope_theta = 500000;
  add("llama3.1-8b", llama3, 0, 8030261248, "meta-llama/Llama-3.1-8B config.json; trained at 8192 tokens");
  llama3.layers = 80, llama3.dim = 8192, llama3.heads = 64, llama3.ffn = 28672;
  add("llama3.1-70b", llama3, 0, 70553706496, "meta-llama/Llama-3.1-70B config.json; trained at 8192 tokens");
  llama3.layers = 126, llama3.dim = 16384, llama3.heads = 128, llama3.ffn = 53248;
  add("llama3.1-405b", llama3, 2048, 405853388800,
      "Dubey et al. 2024 (The Llama 3 Herd of Models): 126 layers of 16384, 128 heads, 8 KV heads; 2048 sequences "
      "of 8192 (16M tokens) in its main training");
  ModelConfig mistral = shape("llama", 32, 4096, 32, 8, 14336, 4096, 32000, 0.0);
  add("mistral-7b", mistral, 0, 7241732096, "mistralai/Mistral-7B-v0.1 config.json (sliding window 4096)");
  ModelConfig qwen = shape("llama", 28, 3584, 28, 4, 18944, 4096, 152064, 0.0);
  qwen.qkv_bias = true, qwen.rope_theta = 1000000, qwen.norm_eps = 1e-6;
  add("qwen2.5-7b", qwen, 0, 7615616512, "Qwen/Qwen2.5-7B config.json (biased q, k, v)");
  ModelConfig qwen3 = shape("llama", 36, 4096, 32, 8, 12288, 4096, 151936, 0.0);
  qwen3.qk_norm = true, qwen3.rope_theta = 1000000, qwen3.norm_eps = 1e-6;
  add("qwen3-8b", qwen3, 0, 8190735360, "Qwen/Qwen3-8B config.json (q and k normalised per head)");
  ModelConfig neox = shape("gpt2", 44, 6144, 64, 0, 24576, 2048, 50432, 0.0);
  neox.positions = Positions::Rope, neox.rotary_fraction = 0.25, neox.parallel_residual = true, neox.tied = Switch::Off;
  add("gpt-neox-20b", neox, 1538, 20554567680,
      "Black et al. 2022 (GPT-NeoX-20B): 1538 sequences of 2048; EleutherAI/gpt-neox-20b config.json");
  neox.layers = 32, neox.dim = 4096, neox.heads = 32, neox.ffn = 16384;
  add("pythia-6.9b", neox, 1024, 6857302016, "Biderman et al. 2023 (Pythia): 1024 sequences of 2048");
  ModelConfig mixtral = shape("moe", 32, 4096, 32, 8, 14336, 4096, 32000, 0.0);
  mixtral.rope_theta = 1000000, mixtral.experts = 8, mixtral.top_k = 2, mixtral.aux_loss = 0.02;
  add("mixtral-8x7b", mixtral, 0, 46702792704,
      "Jiang et al. 2024 (Mixtral of Experts); mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, 2 per token");
  ModelConfig qwen3_moe = shape("moe", 48, 2048, 32, 4, 768, 4096, 151936, 0.0);
  qwen3_moe.head_size = 128, qwen3_moe.qk_norm = true, qwen3_moe.rope_theta = 1000000, qwen3_moe.norm_eps = 1e-6;
  qwen3_moe.experts = 128, qwen3_moe.top_k = 8, qwen3_moe.aux_loss = 0.001;
  add("qwen3-30b-a3b", qwen3_moe, 0, 30532122624,
      "Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, 8 per token, heads 128 wide");
  for (auto [name, layers, dim, heads, batch] :
       {std::tuple<const char*, int64_t, int64_t, int64_t, int64_t>{"megatron-22b", 48, 6144, 64, 4},
        {"megatron-175b", 96, 12288, 96, 64},
        {"megatron-530b", 105, 20480, 128, 280},
        {"megatron-1t", 128, 25600, 160, 512}})
    add(name, shape("gpt2", layers, dim, heads, 0, 0, 2048, 51200, 0.1), batch, 0,
        "Korthikanti et al. 2022, Table 3 (vocabulary 51200, their global batch)");
  return m;
}

std::string names() {
  std::string s;
  for (const NamedModel& m : named_models()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

// A field of a config.json: its value, or `fallback` when it is absent or null.
template <typename T>
T field(const Json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

}  // namespace

const std::vector<NamedModel>& named_models() {
  static const std::vector<NamedModel> m = presets();
  return m;
}

const NamedModel& named_model(std::string_view name) {
  for (const NamedModel& m : named_models())
    if (m.name == name) return m;
  if (name == "deepseek-v3" || name == "deepseek-v3-671b")
    fail(
        "model '{}' is not modelled: its multi-head latent attention (keys and values compressed to a 512-wide "
        "latent) and its first 3 dense layers are not a remat block kind; the moe block has LLaMA's attention and "
        "every layer routed. The presets are: {}",
        name, names());
  fail("unknown model '{}'; the presets are: {}", name, names());
}

namespace {

// A Hugging Face config.json read into a ModelConfig, one architecture family per method.
class ConfigReader {
 public:
  ConfigReader(const Json& j, const std::string& path, const std::string& arch) : j_(j), path_(path), arch_(arch) {
    c.batch = 1, c.dtype = DType::BF16, c.dropout = 0;
  }

  // LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.
  void llama() {
    c.arch = "llama";
    llama_fields(10000.0);
    c.ffn = get<int64_t>("intermediate_size", 0);
    if (get<std::string>("hidden_act", "silu") != "silu")
      refuse("hidden_act '" + get<std::string>("hidden_act", "") + "': the llama block's MLP is SwiGLU (silu)");
    if (get<bool>("mlp_bias", false)) refuse("mlp_bias: biases on the MLP alone are not modelled");
    if (arch_ == "Qwen2ForCausalLM")
      c.qkv_bias = true;  // modeling_qwen2.py: q/k/v biased, o_proj not
    else if (get<bool>("attention_bias", false))
      refuse("attention_bias: biases on o_proj too are not modelled (q/k/v biases alone are: Qwen2)");
    if (arch_ == "Qwen3ForCausalLM") c.qk_norm = true;
  }

  void gpt2() {
    c.arch = "gpt2";
    c.layers = get<int64_t>("n_layer", 0);
    c.dim = get<int64_t>("n_embd", 0);
    c.heads = get<int64_t>("n_head", 0);
    c.ffn = get<int64_t>("n_inner", 0);
    c.vocab = get<int64_t>("vocab_size", 0);
    c.seq = get<int64_t>("n_positions", 1024);
    c.norm_eps = get<double>("layer_norm_epsilon", 1e-5);
    c.dropout = get<double>("resid_pdrop", 0.0);
    const std::string act = get<std::string>("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu") refuse("activation_function '" + act + "': the gpt2 block's MLP is GELU");
  }

  void neox() {
    c.arch = "gpt2";
    c.positions = Positions::Rope;
    c.layers = get<int64_t>("num_hidden_layers", 0);
    c.dim = get<int64_t>("hidden_size", 0);
    c.heads = get<int64_t>("num_attention_heads", 0);
    c.ffn = get<int64_t>("intermediate_size", 0);
    c.vocab = get<int64_t>("vocab_size", 0);
    c.seq = get<int64_t>("max_position_embeddings", 2048);
    c.norm_eps = get<double>("layer_norm_eps", 1e-5);
    c.rope_theta = get<double>("rotary_emb_base", 10000.0);
    c.rotary_fraction = get<double>("rotary_pct", 0.25);  // GPTNeoXConfig's defaults
    c.parallel_residual = get<bool>("use_parallel_residual", true);
    c.tied = get<bool>("tie_word_embeddings", false) ? Switch::On : Switch::Off;
    const std::string act = get<std::string>("hidden_act", "gelu");
    if (act != "gelu" && act != "gelu_new") refuse("hidden_act '" + act + "': the gpt2 block's MLP is GELU");
  }

  // modeling_mixtral.py, modeling_qwen3_moe.py: LLaMA's attention (Qwen3's q/k norms), every layer
  // a softmax router over SwiGLU experts, no shared expert.
  void moe() {
    c.arch = "moe";
    llama_fields(1e6);
    // As given. Hugging Face's load-balancing loss is one term over every layer's tokens, its f
    // per token (not per copy): at one coefficient it pulls about k / L as hard as remat's per-layer
    // loss (Megatron-LM's). Only training feels it, and remat train reads no config.json.
    c.aux_loss = get<double>("router_aux_loss_coef", 0.001);
    c.top_k = get<int64_t>("num_experts_per_tok", 2);
    if (arch_ == "MixtralForCausalLM") {
      c.experts = get<int64_t>("num_local_experts", 8);
      c.ffn = get<int64_t>("intermediate_size", 0);
    } else {
      c.qk_norm = true;
      c.experts = get<int64_t>("num_experts", 0);
      c.ffn = get<int64_t>("moe_intermediate_size", 0);
      c.norm_topk = get<bool>("norm_topk_prob", false);
      if (get<int64_t>("decoder_sparse_step", 1) != 1 ||
          (j_.contains("mlp_only_layers") && j_.at("mlp_only_layers").is_array() && !j_.at("mlp_only_layers").empty()))
        refuse(
            "dense layers among the experts' (decoder_sparse_step, mlp_only_layers): every layer of a model is one "
            "block kind");
    }
    if (get<std::string>("hidden_act", "silu") != "silu")
      refuse("hidden_act '" + get<std::string>("hidden_act", "") + "': the moe block's experts are SwiGLU (silu)");
  }

  // head_dim, where it is not the width over the heads (Qwen3: 128 whatever the width).
  void head_dim() {
    const int64_t head_dim = get<int64_t>("head_dim", c.heads > 0 ? c.dim / c.heads : 0);
    if (c.heads > 0 && head_dim != c.dim / c.heads) c.head_size = head_dim;
  }

  [[noreturn]] void refuse(const std::string& why) const { fail("--model-config '{}' ({}): {}", path_, arch_, why); }

  ModelConfig c;

 private:
  template <typename T>
  T get(const char* key, T fallback) const {
    return field<T>(j_, key, fallback);
  }

  // The fields Hugging Face's LLaMA-like configs share (modeling_llama.py and its descendants).
  void llama_fields(double rope_theta) {
    c.layers = get<int64_t>("num_hidden_layers", 0);
    c.dim = get<int64_t>("hidden_size", 0);
    c.heads = get<int64_t>("num_attention_heads", 0);
    c.kv_heads = get<int64_t>("num_key_value_heads", c.heads);
    c.vocab = get<int64_t>("vocab_size", 0);
    c.seq = get<int64_t>("max_position_embeddings", 4096);
    c.rope_theta = get<double>("rope_theta", rope_theta);
    c.norm_eps = get<double>("rms_norm_eps", 1e-6);
    c.tied = get<bool>("tie_word_embeddings", false) ? Switch::On : Switch::Off;
    c.dropout = get<double>("attention_dropout", 0.0);
  }

  const Json& j_;
  const std::string& path_;
  const std::string& arch_;
};

void read_architecture(ConfigReader& r, const std::string& path, const std::string& arch) {
  if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM" || arch == "Qwen2ForCausalLM" ||
      arch == "Qwen3ForCausalLM")
    r.llama();
  else if (arch == "GPT2LMHeadModel")
    r.gpt2();
  else if (arch == "GPTNeoXForCausalLM")
    r.neox();
  else if (arch == "MixtralForCausalLM" || arch == "Qwen3MoeForCausalLM")
    r.moe();
  else if (arch == "DeepseekV3ForCausalLM" || arch == "DeepseekV2ForCausalLM" || arch == "Qwen2MoeForCausalLM")
    r.refuse(arch == "Qwen2MoeForCausalLM"
                 ? "a gated shared expert (shared_expert_gate) and q/k/v biases are not modelled"
                 : "multi-head latent attention (q_lora_rank, kv_lora_rank: compressed keys and values) and its "
                   "first_k_dense_replace dense layers are not modelled; the moe block has LLaMA's attention and "
                   "every layer routed");
  else
    fail(
        "--model-config '{}': architecture '{}' is not modelled; remat reads LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, GPT2LMHeadModel and "
        "GPTNeoXForCausalLM",
        path, arch.empty() ? "(none named)" : arch);
}

}  // namespace

ModelConfig read_model_config(const std::string& path) {
  const std::string text = read_regular_file("--model-config", path, int64_t{4} << 20);
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    fail("--model-config '{}' is not JSON: {}", path, e.what());
  }
  if (!j.is_object()) fail("--model-config '{}' must hold one JSON object (a Hugging Face config.json)", path);
  std::string arch;
  try {
    arch = j.contains("architectures") && j.at("architectures").is_array() && !j.at("architectures").empty()
               ? j.at("architectures")[0].get<std::string>()
               : field<std::string>(j, "model_type", "");
  } catch (const nlohmann::json::exception& e) {
    fail("--model-config '{}': \"architectures\" and \"model_type\" hold strings ({})", path, e.what());
  }
  ConfigReader r(j, path, arch);
  try {
    read_architecture(r, path, arch);
    r.head_dim();
  } catch (const nlohmann::json::exception& e) {
    fail("--model-config '{}': a field has the wrong type ({})", path, e.what());
  }
  validate(r.c);
  return r.c;
}

}  // namespace remat
