"""The tiny DeepSeek-V2-architecture model the MLA end-to-end tests serve (test_pd_lynx_mla.py,
test_pd_lynx_mla_tp.py): random weights (`--load-format dummy`: the same seeded weights in every
server of one TP size), its config written by `write_model`, the tokenizer the embedded
SmolLM2's; and the prompts they send.

Why qk_nope_head_dim = kv_lora_rank and v_head_dim = kv_lora_rank: SGLang 0.5.23 on CPU runs
DeepSeek's attention with `--attention-backend torch_native` (intel_amx needs AMX, which this box
lacks), and that backend runs the prompt's MHA-form attention against the pool's latent rows
(`torch_native_backend._run_sdpa_forward_extend`); with DeepSeek's own shapes (q/k 64 + 64, v 64,
latent 128 + 64) it fails with "RuntimeError: Expected size for first two dimensions of batch2
tensor to be: [4, 128] but got: [4, 192]". With these widths the shapes meet, so the prompt's
attention is not DeepSeek's computation, but every server computes the same thing, and the decode
attends over the latent rows Lynx moved (absorbed MLA).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

KV_LORA_RANK, ROPE_DIM = 128, 64
TINY_DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    # Dense layers only (first_k_dense_replace = the layer count): the MoE is not what is tested.
    "first_k_dense_replace": 2, "moe_layer_freq": 1, "moe_intermediate_size": 128,
    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False,
    "kv_lora_rank": KV_LORA_RANK, "q_lora_rank": None, "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": KV_LORA_RANK, "v_head_dim": KV_LORA_RANK,
    # SGLang's CPU rotary embedding takes DeepSeek's YaRN only (get_rope_cpu asserts a
    # rope_scaling); factor 1 leaves the positions unscaled.
    "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "initializer_range": 0.02, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "use_cache": True,
}
DUMMY = ("--load-format", "dummy")
CONTEXT = " ".join(f"Item {i}: the value of key k{i} is {i * 37 % 101}." for i in range(24))
PROMPTS = (
    "The capital of France is",
    CONTEXT + " Question: what is the value of key k17? Answer:",
    CONTEXT + " Question: what is the value of key k5? Answer:",
)
MAX_NEW_TOKENS = 16


def write_model(folder: Path, tokenizer_dir: str) -> str:
    """The model folder: config.json and the embedded model's tokenizer files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, folder / name)
    (folder / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V2))
    return str(folder)
