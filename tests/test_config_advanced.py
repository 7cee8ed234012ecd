"""QuantMLAConfig's two levels: the options most users set up front, the rarely needed ones in the `advanced` group;
old flat spellings refused with the new one; saved configs of format_version 1 (flat) migrated on load."""

from __future__ import annotations

import copy
import json
import pickle
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla_hf import AdvancedOptions, QuantMLAConfig, apply_quantmla
from quantmla_hf.config import ADVANCED_FIELDS, FORMAT_VERSION
from quantmla_hf.tiny_models import tiny_mla_model

# config.json's quantization_config as the flat layout (format_version 1) wrote it, saved by that code for a tiny
# deepseek_v3 (seed 6) quantized with QuantMLAConfig(content_bits=2, recent_tokens=16, group_size=16,
# transform="hadamard", kernel="torch", cache_block_size=64, static_cache=False, decode_graphs=False,
# calibration_steps=7, seed=3, calibration_lr=0.01).
VERSION_1 = {
    "cache_block_size": 64,
    "calibrated": True,
    "calibration": {"layers": [], "transform": "hadamard"},
    "calibration_data": None,
    "calibration_lr": 0.01,
    "calibration_samples": 64,
    "calibration_seq_len": 512,
    "calibration_steps": 7,
    "content_bits": 2,
    "decode_graphs": False,
    "format_version": 1,
    "group_size": 16,
    "kernel": "torch",
    "quant_method": "quantmla",
    "recent_tokens": 16,
    "rope_bits": 4,
    "seed": 3,
    "sink_tokens": 4,
    "static_cache": False,
    "transform": "hadamard",
}
MIGRATED_ADVANCED = {"kernel": "torch", "cache_block_size": 64, "static_cache": False, "decode_graphs": False,
                     "calibration_samples": 64, "calibration_seq_len": 512, "calibration_steps": 7,
                     "calibration_lr": 0.01, "seed": 3}


def test_the_advanced_options_are_one_nested_group_read_back_by_name():
    cfg = QuantMLAConfig(content_bits=2, advanced={"kernel": "torch", "calibration_steps": 50})
    assert (cfg.advanced.kernel, cfg.advanced.calibration_steps, cfg.advanced.seed) == ("torch", 50, 0)
    assert cfg.advanced == AdvancedOptions(kernel="torch", calibration_steps=50)
    assert QuantMLAConfig(advanced=AdvancedOptions(seed=3)).advanced.seed == 3
    assert set(ADVANCED_FIELDS) == {"kernel", "cache_block_size", "static_cache", "decode_graphs", "calibration_samples",
                                    "calibration_seq_len", "calibration_steps", "calibration_lr", "seed",
                                    "calibration_checkpoint_dir"}


@pytest.mark.parametrize("name,value", [("calibration_steps", 3), ("kernel", "torch"), ("seed", 1),
                                        ("static_cache", False), ("calibration_checkpoint_dir", "ckpt")])
def test_a_flat_advanced_keyword_is_refused_with_the_nested_spelling(name, value):
    fix = f"advanced={{{name!r}: {value!r}}}"
    with pytest.raises(ValueError, match=re.escape(f"QuantMLAConfig({fix})")):
        QuantMLAConfig(**{name: value})
    cfg = QuantMLAConfig()
    with pytest.raises(ValueError, match=re.escape(f"config.update({fix})")):
        cfg.update(**{name: value})
    with pytest.raises(AttributeError, match=re.escape(f"config.advanced = {{{name!r}: {value!r}}}")):
        setattr(cfg, name, value)
    with pytest.raises(AttributeError, match=re.escape(f"read config.advanced.{name}")):
        getattr(cfg, name)
    with pytest.raises(ValueError, match=re.escape(f"{name} is an advanced option")):
        QuantMLAConfig.from_dict({"quant_method": "quantmla", "format_version": FORMAT_VERSION, name: value})
    assert cfg.advanced == AdvancedOptions() and cfg.explicit_options == frozenset()


def test_a_misspelled_advanced_option_gets_the_closest_name_in_its_spelling():
    with pytest.raises(ValueError, match=re.escape("no option 'calibration_step'; did you mean "
                                                   "advanced={'calibration_steps': ...}?")):
        QuantMLAConfig(calibration_step=3)
    with pytest.raises(ValueError, match="advanced options have no 'kernl'; did you mean advanced=\\{'kernel'"):
        QuantMLAConfig(advanced={"kernl": "torch"})
    with pytest.raises(ValueError, match="advanced must be a dict of advanced options"):
        QuantMLAConfig(advanced=["kernel"])


def test_the_group_is_read_only_and_every_change_through_the_config_is_validated():
    cfg = QuantMLAConfig(recent_tokens=0, advanced={"calibration_steps": 7})
    with pytest.raises(AttributeError, match=re.escape("config.advanced = {'kernel': 'torch'}")):
        cfg.advanced.kernel = "torch"
    cfg.advanced = {"kernel": "torch"}  # a dict sets the options it names, the others keep their values
    assert (cfg.advanced.kernel, cfg.advanced.calibration_steps) == ("torch", 7)
    with pytest.raises(ValueError, match="advanced.cache_block_size must be an integer >= 1, got 0"):
        cfg.advanced = {"cache_block_size": 0, "seed": 5}
    with pytest.raises(ValueError, match="advanced.kernel must be one of"):
        setattr(cfg, "advanced.kernel", "cuda")
    with pytest.raises(ValueError, match="advanced static_cache=True needs recent_tokens >= 1"):
        cfg.update(advanced={"static_cache": True})  # checked against the top-level options too
    assert cfg.advanced == AdvancedOptions(kernel="torch", calibration_steps=7)  # refused changes changed nothing
    assert cfg.explicit_options == {"recent_tokens", "advanced.calibration_steps", "advanced.kernel"}
    cfg.update(recent_tokens=4, advanced={"static_cache": True})
    assert cfg.advanced.static_cache is True and cfg.advanced.kernel == "torch"
    cfg.advanced = AdvancedOptions(seed=2)  # a whole group replaces the group
    assert cfg.advanced == AdvancedOptions(seed=2) and "advanced.seed" in cfg.explicit_options


def test_options_given_in_the_group_count_as_given_and_cache_ones_are_loading_attributes():
    cfg = QuantMLAConfig(content_bits=4, advanced={"kernel": "auto", "calibration_steps": 100})
    assert cfg.explicit_options == {"content_bits", "advanced.kernel", "advanced.calibration_steps"}
    assert cfg.get_loading_attributes() == {"content_bits": 4, "advanced.kernel": "auto"}
    given = QuantMLAConfig(advanced=AdvancedOptions(decode_graphs=False))  # only the options the group was given
    assert given.explicit_options == {"advanced.decode_graphs"}
    assert given.get_loading_attributes() == {"advanced.decode_graphs": False}


def test_copy_pickle_and_repr_keep_the_group():
    cfg = QuantMLAConfig(content_bits=2, advanced={"kernel": "torch", "calibration_checkpoint_dir": "ckpt"})
    other = cfg.copy()
    other.advanced = {"kernel": "triton"}
    assert cfg.advanced.kernel == "torch" and other.advanced.calibration_checkpoint_dir == "ckpt"
    for again in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert again.advanced == cfg.advanced and again.explicit_options == cfg.explicit_options
    assert repr(cfg) == ("QuantMLAConfig(C2R4, transform='auto', advanced={'kernel': 'torch', "
                         "'calibration_checkpoint_dir': 'ckpt'})")


def test_the_saved_config_nests_the_group_and_leaves_the_checkpoint_folder_out():
    cfg = QuantMLAConfig(transform="none", advanced={"seed": 4, "calibration_checkpoint_dir": "ckpt"})
    saved = cfg.to_dict()
    assert saved["format_version"] == FORMAT_VERSION == 2
    assert saved["advanced"] == AdvancedOptions(seed=4).to_dict() and saved["advanced"]["seed"] == 4
    assert not set(saved) & set(ADVANCED_FIELDS) and "calibration_checkpoint_dir" not in saved["advanced"]
    again = QuantMLAConfig.from_dict(json.loads(json.dumps(saved)))
    assert again.to_dict() == saved and again.advanced.calibration_checkpoint_dir is None


@pytest.mark.parametrize("version", [1, None])
def test_a_version_1_config_is_migrated_into_the_group(version):
    saved = {k: v for k, v in VERSION_1.items() if not (k == "format_version" and version is None)}
    cfg = QuantMLAConfig.from_dict(saved)
    assert cfg.advanced == AdvancedOptions(**MIGRATED_ADVANCED)
    assert (cfg.name, cfg.group_size, cfg.recent_tokens, cfg.transform, cfg.calibrated) == ("C2R4", 16, 16,
                                                                                         "hadamard", True)
    assert cfg.extra == {"calibration": {"layers": [], "transform": "hadamard"}}
    assert {f"advanced.{k}" for k in MIGRATED_ADVANCED} <= cfg.explicit_options
    written = cfg.to_dict()
    assert written["format_version"] == 2 and written["advanced"] == MIGRATED_ADVANCED
    assert {k: v for k, v in written.items() if k not in ("advanced", "format_version")} == \
        {k: v for k, v in VERSION_1.items() if k not in MIGRATED_ADVANCED and k != "format_version"}


def test_a_version_1_config_holding_an_advanced_group_is_refused():
    with pytest.raises(ValueError, match="format_version 1 but holds both 'advanced' and"):
        QuantMLAConfig.from_dict({**VERSION_1, "advanced": {"kernel": "torch"}})


@pytest.fixture(scope="module")
def version_1_checkpoint(tmp_path_factory):
    """The checkpoint VERSION_1 was saved with: the same weights, its config.json holding the flat config."""
    path = tmp_path_factory.mktemp("version_1")
    config = QuantMLAConfig(content_bits=2, recent_tokens=16, group_size=16, transform="hadamard")
    apply_quantmla(tiny_mla_model("deepseek_v3", seed=6), config).save_pretrained(path)
    full = json.loads((path / "config.json").read_text())
    current = full["quantization_config"]
    full["quantization_config"] = VERSION_1
    (path / "config.json").write_text(json.dumps(full))
    return path, current


def test_a_version_1_checkpoint_loads_with_from_pretrained_and_saves_as_version_2(version_1_checkpoint, tmp_path):
    path, current = version_1_checkpoint
    model = AutoModelForCausalLM.from_pretrained(path)
    qconfig = model.config.quantization_config
    assert qconfig.advanced == AdvancedOptions(**MIGRATED_ADVANCED) and qconfig.calibrated
    assert current["advanced"]["kernel"] == "auto"  # the checkpoint as saved by this library differed: migrated
    prompt = torch.arange(3, 30)[None]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape[1] == prompt.shape[1] + 4
    assert out.past_key_values.layers[0].kernel == "torch"  # the migrated kernel choice is the cache's
    model.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert saved["format_version"] == 2 and saved["advanced"] == MIGRATED_ADVANCED
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        again = reloaded.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(again, out.sequences)


def test_options_passed_beside_a_version_1_checkpoint_apply_to_the_migrated_config(version_1_checkpoint):
    path, _ = version_1_checkpoint
    requested = QuantMLAConfig(content_bits=4, advanced={"kernel": "auto", "cache_block_size": 32})
    with pytest.warns(UserWarning, match=re.escape("advanced.kernel")):  # transformers' note names what it sets
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=requested)
    qconfig = model.config.quantization_config
    assert (qconfig.name, qconfig.advanced.kernel, qconfig.advanced.cache_block_size) == ("C4R4", "auto", 32)
    assert (qconfig.advanced.calibration_steps, qconfig.advanced.seed) == (7, 3)  # the checkpoint's recipe stays
