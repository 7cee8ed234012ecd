"""QuantMLAConfig validation and the byte accounting of the cache formats."""

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat, QuantMLAConfig, mla_dims
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_config


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(content_bits=3), "content_bits must be one of 2, 4, 8, 16, got 3"),
        (dict(rope_bits=2), "rope_bits must be one of 4, 8, 16, got 2"),
        (dict(group_size=48), "group_size must be a power of two"),
        (dict(transform="gptq"), "transform must be one of 'learned', 'hadamard', 'smooth', 'none', got 'gptq'"),
        (dict(kernel="cuda"), "kernel must be one of 'auto', 'triton', 'torch', got 'cuda'"),
        (dict(sink_tokens=-1), "sink_tokens must be an integer >= 0, got -1"),
        (dict(calibration_data=3), "calibration_data must be a path to a text file or a list of strings"),
        (dict(calibration_lr=0), "calibration_lr must be a positive number"),
    ],
)
def test_config_errors_name_value_and_choices(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        QuantMLAConfig(**kwargs)


def test_config_round_trips_through_dict():
    cfg = QuantMLAConfig(content_bits=2, rope_bits=4, transform="none", calibrated=True, measured_bytes_per_token=187)
    again = QuantMLAConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert again.name == "C2R4" and again.quant_method == "quantmla"
    assert again.extra == {"measured_bytes_per_token": 187}


def test_deepseek_bytes_per_token():
    c4r4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    c2r4 = CacheFormat(PathFormat(512, 2, 64), PathFormat(64, 4, 64))
    c16 = CacheFormat(PathFormat(512, 16, 64), PathFormat(64, 16, 64))
    assert c4r4.packed_bytes_per_token() == 256 + 32 + 3 * 9 == 315
    assert c2r4.packed_bytes_per_token() == 128 + 32 + 3 * 9 == 187
    assert c16.packed_bytes_per_token(torch.bfloat16) == c16.dense_bytes_per_token() == 1152


def test_narrow_rope_path_is_one_group():
    fmt = PathFormat(32, 4, 64)  # MiniCPM3's d_R
    assert fmt.group == 32 and fmt.n_groups == 1 and fmt.bytes_per_token() == 16 + 3


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_mla_dims_of_every_family(model_type):
    dims = mla_dims(tiny_config(model_type))
    assert (dims.kv_lora_rank, dims.rope_dim, dims.num_heads) == (64, 16, 4)
    assert dims.num_cache_layers == (4 if model_type == "longcat_flash" else 2)


def test_non_mla_model_is_refused_with_reason():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="has no kv_lora_rank or qk_rope_head_dim"):
        mla_dims(LlamaConfig())
