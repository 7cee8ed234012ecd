"""What an MLA model looks like to QuantMLA: its cached widths and the quirks of each transformers family."""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> cache layers per decoder layer (LongCat-Flash has two MLA modules in every decoder layer).
MLA_MODEL_TYPES = {
    "deepseek_v2": 1,
    "deepseek_v3": 1,  # also Kimi/Moonlight and DeepSeek-R1 checkpoints
    "glm4_moe_lite": 1,
    "longcat_flash": 2,
    "minicpm3": 1,
}


@dataclass(frozen=True)
class MLADims:
    """Widths of one MLA attention module and how many cache layers the model has.

    Attributes:
        model_type: the transformers `model_type` of the text model.
        kv_lora_rank: d_c, width of the cached content latent.
        rope_dim: d_R, width of the cached post-RoPE key.
        num_heads: attention heads.
        qk_nope_head_dim: per-head width of the content part of query and key.
        v_head_dim: per-head width of the value.
        q_lora_rank: rank of the query down-projection, or None when the model uses a plain q_proj.
        num_cache_layers: number of `layer_idx` values the model passes to `cache.update`.
    """

    model_type: str
    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    num_cache_layers: int


def text_config(config):
    """The decoder config of `config` (the config itself for plain causal LMs)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def mla_dims(config) -> MLADims:
    """Read the MLA widths from a transformers config, or explain why the model is not supported."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", type(cfg).__name__)
    missing = [a for a in ("kv_lora_rank", "qk_rope_head_dim") if getattr(cfg, a, None) is None]
    if missing:
        raise ValueError(
            f"QuantMLA needs a Multi-head Latent Attention model (one that caches a content latent and a RoPE key), "
            f"but this {model_type!r} config has no {' or '.join(missing)}. Supported model types: "
            f"{', '.join(sorted(MLA_MODEL_TYPES))}."
        )
    if model_type not in MLA_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} has MLA widths but is not one of the supported families "
            f"({', '.join(sorted(MLA_MODEL_TYPES))}); its attention may not cache through cache.update(latent, k_rot)."
        )
    per_layer = MLA_MODEL_TYPES[model_type]
    # LongCat-Flash counts decoder layers in `num_layers`; its attention modules use layer_idx*2 and layer_idx*2+1.
    n_layers = cfg.num_layers if per_layer == 2 else cfg.num_hidden_layers
    return MLADims(
        model_type=model_type,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        num_heads=cfg.num_attention_heads,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        q_lora_rank=getattr(cfg, "q_lora_rank", None),
        num_cache_layers=n_layers * per_layer,
    )
