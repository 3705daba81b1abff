"""Tiny configs of the transformers families users train (random weights come from the model,
never from a hub), shared by the layout and sink tests."""

from __future__ import annotations

import transformers

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
MOE = dict(num_experts_per_tok=2)


def config(family: str, **over):
    """A tiny config of ``family``."""
    if family == "llama":
        return transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True, **over})
    if family == "qwen3":
        return transformers.Qwen3Config(**{**COMMON, **over})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**COMMON, **MOE, "moe_intermediate_size": 16, "num_experts": 4, **over})
    if family == "mixtral":
        return transformers.MixtralConfig(**{**COMMON, **MOE, "num_local_experts": 4, **over})
    if family == "gpt_oss":
        return transformers.GptOssConfig(**{**COMMON, **MOE, "num_local_experts": 4, **over})
    if family == "deepseek_v3":  # Kimi-K2 is this class too
        c = dict(COMMON, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, n_group=2)
        c.update(topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8)
        c.update(qk_nope_head_dim=8, v_head_dim=8, **MOE)
        c.pop("head_dim")
        return transformers.DeepseekV3Config(**{**c, **over})
    raise ValueError(family)
