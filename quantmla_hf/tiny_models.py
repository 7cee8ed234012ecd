"""Tiny random MLA models of every supported family, built from configs (no download).

Used by the tests, the examples and the demo's fallback; real checkpoints load with `from_pretrained` instead.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=1024,
)
_MOE = dict(n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1)

TINY_FAMILIES: dict[str, dict] = {
    "deepseek_v2": dict(num_hidden_layers=2, q_lora_rank=None, first_k_dense_replace=1, **_MOE),
    "deepseek_v3": dict(num_hidden_layers=2, q_lora_rank=32, first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE),
    "glm4_moe_lite": dict(num_hidden_layers=2, q_lora_rank=32, first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE),
    "longcat_flash": dict(  # two attention modules per decoder layer; older releases do not derive the module count
        num_layers=2, num_hidden_layers=4, q_lora_rank=32, n_routed_experts=4, moe_topk=2, expert_ffn_hidden_size=32,
        ffn_hidden_size=96, head_dim=16,
    ),
    "minicpm3": dict(num_hidden_layers=2, q_lora_rank=32),
}


def tiny_config(model_type: str, **overrides):
    """Config of a tiny random `model_type` MLA model (d_c = 64, d_R = 16, 4 heads)."""
    if model_type not in TINY_FAMILIES:
        raise ValueError(f"no tiny config for {model_type!r}; choose one of {', '.join(TINY_FAMILIES)}")
    kwargs = {**_COMMON, **TINY_FAMILIES[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_mla_model(model_type: str = "deepseek_v3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random model of `model_type`, in eval mode, with deterministic weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.eval()
