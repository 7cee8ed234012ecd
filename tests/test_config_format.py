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
        (dict(transform="gptq"), "transform must be one of 'auto', 'learned', 'hadamard', 'smooth', 'none', got 'gptq'"),
        (dict(advanced={"kernel": "cuda"}), "advanced.kernel must be one of 'auto', 'triton', 'torch', got 'cuda'"),
        (dict(sink_tokens=-1), "sink_tokens must be an integer >= 0, got -1"),
        (dict(calibration_data=3), "calibration_data must be a path to a text file or a list of strings"),
        (dict(advanced={"calibration_lr": 0}), "advanced.calibration_lr must be a positive number"),
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


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(nbits=2), "no option 'nbits'; did you mean 'content_bits'"),
        (dict(contnet_bits=2), "no option 'contnet_bits'; did you mean 'content_bits'"),
        (dict(recent=64), "no option 'recent'"),
        (dict(content_bits=4.0), "content_bits must be one of 2, 4, 8, 16, got 4.0"),
        (dict(rope_bits=True), "rope_bits must be one of 4, 8, 16, got True"),
        (dict(group_size=64.0), "group_size must be an integer >= 1, got 64.0"),
        (dict(advanced={"calibration_lr": True}), "advanced.calibration_lr must be a positive number"),
        (dict(calibrated="yes"), "calibrated must be True or False"),
    ],
)
def test_typos_and_wrong_number_types_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantMLAConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        QuantMLAConfig.from_dict({"quant_method": "quantmla", **kwargs})


def test_a_saved_config_reloads_with_the_keys_the_library_writes():
    cfg = QuantMLAConfig(transform="none", calibration_source="calib.txt", base_model="org/model", eval={"ppl": 1.0})
    assert QuantMLAConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


def test_every_way_of_changing_a_field_validates():
    cfg = QuantMLAConfig()
    with pytest.raises(ValueError, match="content_bits must be one of"):
        cfg.content_bits = 3
    with pytest.raises(ValueError, match="content_bits must be one of"):
        cfg.content_bits = 4.0
    with pytest.raises(AttributeError, match="did you mean 'content_bits'"):
        cfg.contnet_bits = 2
    with pytest.raises(ValueError, match="group_size must be a power of two"):
        cfg.update(content_bits=2, group_size=3)
    assert (cfg.content_bits, cfg.group_size) == (4, 64)  # a refused update changes nothing
    with pytest.raises(ValueError, match="no option 'bits'"):
        cfg.update(bits=2)
    assert cfg.update(content_bits=2, recent_tokens=64) == {}
    cfg.sink_tokens = 8
    assert (cfg.name, cfg.recent_tokens, cfg.sink_tokens) == ("C2R4", 64, 8)


def test_copy_is_independent():
    cfg = QuantMLAConfig(calibration_data=["a text"], measured_bytes_per_token=3)
    other = cfg.copy()
    other.calibrated = True
    other.extra["calibration"] = {"layers": []}
    other.calibration_data.append("another")
    assert not cfg.calibrated and "calibration" not in cfg.extra and cfg.calibration_data == ["a text"]


def test_repr_is_short():
    cfg = QuantMLAConfig(content_bits=2, calibration_data=["x" * 10_000] * 50, calibration={"layers": [{}] * 60})
    text = repr(cfg)
    assert len(text) < 200 and text.startswith("QuantMLAConfig(C2R4, transform='auto'")
    assert "<50 texts>" in text and "extra=[calibration]" in text


def test_static_cache_option_is_validated_and_round_trips():
    from quantmla_hf import QuantMLAConfig

    for choice in ("auto", True, False):
        saved = QuantMLAConfig(advanced={"static_cache": choice}).to_dict()
        assert QuantMLAConfig.from_dict(saved).advanced.static_cache == choice
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="advanced.static_cache must be 'auto', True or False"):
            QuantMLAConfig(advanced={"static_cache": bad})
