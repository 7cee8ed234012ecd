"""Options passed to `from_pretrained` beside a QuantMLA checkpoint: every cache option the user gave applies (one
equal to the default too), every weight option given that differs from the checkpoint is named in a warning, and
no private name reaches transformers' messages. The library's log follows transformers' verbosity."""

from __future__ import annotations

import importlib
import logging
import re
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture(scope="module")
def c2_checkpoint(tmp_path_factory):
    """A C2R4 checkpoint, group 16, recent 16, stock weights (transform none)."""
    path = tmp_path_factory.mktemp("c2r4")
    config = QuantMLAConfig(content_bits=2, recent_tokens=16, group_size=16, transform="none")
    apply_quantmla(tiny_mla_model("deepseek_v3", seed=6), config).save_pretrained(path)
    return path


@pytest.fixture
def transformers_log():
    """Every record of transformers' logger tree at INFO and above, whatever transformers' verbosity."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(logging.INFO)
    root = logging.getLogger("transformers")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield records
    root.removeHandler(handler)
    root.setLevel(level)


def load(path, config):
    """`from_pretrained(path, quantization_config=config)` and every warning it raised (messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    return model, [str(w.message) for w in caught]


def test_the_config_remembers_what_was_given_not_what_differs():
    cfg = QuantMLAConfig(content_bits=4, recent_tokens=128, transform="none")
    assert cfg.explicit_options == {"content_bits", "recent_tokens", "transform"}
    cfg.update(sink_tokens=4)
    cfg.advanced = {"kernel": "auto"}
    assert cfg.explicit_options == {"content_bits", "recent_tokens", "transform", "sink_tokens", "advanced.kernel"}
    assert cfg.get_loading_attributes() == {"content_bits": 4, "recent_tokens": 128, "sink_tokens": 4,
                                            "advanced.kernel": "auto"}
    assert QuantMLAConfig().explicit_options == frozenset() and QuantMLAConfig().get_loading_attributes() == {}
    assert QuantMLAConfig(4).explicit_options == {"content_bits"}  # positional too


def test_a_refused_value_is_not_remembered():
    cfg = QuantMLAConfig()
    with pytest.raises(ValueError, match="content_bits must be one of"):
        cfg.content_bits = 3
    with pytest.raises(ValueError, match="recent_tokens must be an integer"):
        cfg.update(sink_tokens=2, recent_tokens=-1)
    assert cfg.explicit_options == frozenset() and cfg.sink_tokens == 4


def test_copy_and_dict_round_trips_keep_the_options_and_no_private_field():
    cfg = QuantMLAConfig(content_bits=4, group_size=64)
    other = cfg.copy()
    other.recent_tokens = 32
    assert cfg.explicit_options == {"content_bits", "group_size"}
    assert other.explicit_options == {"content_bits", "group_size", "recent_tokens"}
    saved = cfg.to_dict()
    assert not [k for k in saved if k.startswith("_")] and not [k for k, _ in cfg if k.startswith("_")]
    again = QuantMLAConfig.from_dict(saved)
    assert again.to_dict() == saved and repr(again) == repr(cfg) == "QuantMLAConfig(C4R4, transform='auto')"


def test_cache_options_equal_to_the_defaults_apply_to_a_checkpoint(c2_checkpoint):
    requested = QuantMLAConfig(content_bits=4, recent_tokens=128, group_size=64, advanced={"decode_graphs": False})
    model, caught = load(c2_checkpoint, requested)
    assert not [m for m in caught if "QuantMLAConfig" in m], caught  # all run-time options: nothing is ignored
    qconfig = model.config.quantization_config
    assert (qconfig.name, qconfig.recent_tokens, qconfig.group_size, qconfig.advanced.decode_graphs) == \
        ("C4R4", 128, 64, False)
    with torch.no_grad():
        out = model.generate(torch.arange(3, 24)[None], max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    cache = generated_cache(out).quantization_config
    assert (cache.name, cache.recent_tokens, cache.group_size) == ("C4R4", 128, 64)


def test_a_weight_option_differing_from_the_checkpoint_is_named_and_private_names_stay_out(c2_checkpoint,
                                                                                           transformers_log):
    model, caught = load(c2_checkpoint, QuantMLAConfig(transform="hadamard", content_bits=4, advanced={"seed": 0}))
    ours = [m for m in caught if "already quantized" in m]
    assert len(ours) == 1 and "transform='hadamard' (the checkpoint has 'none')" in ours[0]
    assert "seed" not in ours[0]  # given, but equal to the checkpoint's
    theirs = [m for m in caught + transformers_log if "`quantization_config`" in m]  # the merge note
    assert theirs and not [m for m in theirs if re.search(r"['\"]_\w+", m) or "_requested" in m], theirs
    qconfig = model.config.quantization_config
    assert (qconfig.transform, qconfig.name) == ("none", "C4R4")


def test_a_weight_option_equal_to_the_checkpoint_says_nothing(c2_checkpoint):
    model, caught = load(c2_checkpoint, QuantMLAConfig(transform="none", calibrated=False))
    assert not [m for m in caught if "already quantized" in m], caught
    assert not [m for m in caught if "loading attributes" in m], caught  # transformers claims nothing overwritten
    assert model.config.quantization_config.name == "C2R4"  # no cache option given: the checkpoint's


@pytest.fixture
def verbosity():
    """Restores transformers' verbosity after the test."""
    before = transformers.logging.get_verbosity()
    yield transformers.logging
    transformers.logging.set_verbosity(before)


def test_the_rtn_message_follows_transformers_verbosity(verbosity, caplog):
    verbosity.set_verbosity_error()
    with caplog.at_level(logging.WARNING):
        apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(group_size=16))
    assert "RTN" not in caplog.text
    verbosity.set_verbosity_warning()
    with caplog.at_level(logging.WARNING):
        apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(group_size=16))
    assert "transform='none' (RTN)" in caplog.text


@pytest.mark.parametrize("module", ["quantmla_hf.integration", "quantmla_hf.generation.graphs", "quantmla_hf.serving.graphs"])
def test_every_library_logger_follows_transformers_verbosity(module, verbosity, caplog):
    logger = importlib.import_module(module).logger
    with caplog.at_level(logging.DEBUG):
        verbosity.set_verbosity_error()
        logger.warning("probe while silenced")
        verbosity.set_verbosity_warning()
        logger.warning("probe at the default verbosity")
        logger.info("info at the default verbosity")
    assert "probe at the default verbosity" in caplog.text
    assert "silenced" not in caplog.text and "info at" not in caplog.text
