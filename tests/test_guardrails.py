"""Small traps with a clear error or the expected behaviour: static cache length, triton on CPU, advice, progress."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils import logging

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla
from quantmla_hf.cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from quantmla_hf.calibration.checks import check_calibration_inputs
from quantmla_hf.embedded import REFERENCE_MODEL
from quantmla_hf.tiny_models import tiny_mla_model


def _model(**options):
    config = QuantMLAConfig(transform="none", group_size=16, sink_tokens=1, recent_tokens=4, **options)
    return apply_quantmla(tiny_mla_model("deepseek_v3", seed=2, num_hidden_layers=1), config)


def test_static_cache_past_max_position_embeddings_is_refused_before_allocating():
    model = _model(advanced={"static_cache": True})
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"more than this model's max_position_embeddings={limit}") as err:
        model.generate(torch.arange(3, 10)[None], max_new_tokens=10**7, do_sample=False)
    assert "advanced={'static_cache': False}" in str(err.value)
    assert getattr(model, "_quantmla_static_cache", None) is None  # nothing was preallocated


def test_static_cache_with_no_recent_window_is_refused_at_construction():
    with pytest.raises(ValueError, match="advanced static_cache=True needs recent_tokens >= 1"):
        QuantMLAConfig(recent_tokens=0, advanced={"static_cache": True})
    config = QuantMLAConfig(advanced={"static_cache": True})
    with pytest.raises(ValueError, match="recent_tokens >= 1"):
        config.recent_tokens = 0
    assert config.recent_tokens == 128


def test_triton_kernel_on_cpu_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _model(advanced={"kernel": "triton"})
    cache = QuantMLACache(config=model.config, quantization_config=model.config.quantization_config)
    with pytest.raises(ValueError, match="kernel='triton' runs the Triton kernels, which need a CUDA GPU") as err:
        model(torch.arange(3, 10)[None], **{GENERATE_CACHE_KWARG: cache})
    assert "kernel='auto'" in str(err.value)


def test_sequence_length_advice_at_the_minimum_asks_for_more_text():
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    at_minimum = QuantMLAConfig(transform="learned", calibration_data=["a short text"],
                                advanced={"calibration_seq_len": 8})
    too_short = re.escape("fewer than 2 windows of advanced={'calibration_seq_len': 8}")
    with pytest.raises(ValueError, match=too_short) as err:
        check_calibration_inputs(at_minimum, tokenizer=tokenizer)
    assert "pass a longer text (at least 16 tokens" in str(err.value)
    assert str(err.value).count("'calibration_seq_len':") == 1  # no advice to set what is already set
    text = " ".join(["the city of the river"] * 8)
    long_windows = QuantMLAConfig(transform="learned", calibration_data=[text], advanced={"calibration_seq_len": 512})
    with pytest.raises(ValueError, match=r"pass a longer text or advanced=\{'calibration_seq_len': \d+\} or less"):
        check_calibration_inputs(long_windows, tokenizer=tokenizer)


@pytest.mark.parametrize("enabled", [True, False])
def test_calibration_progress_bar_follows_transformers_switch(enabled, capsys):
    (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()
    try:
        ids = (torch.arange(4 * 16) * 7 % 120 + 3).reshape(4, 16)
        config = QuantMLAConfig(transform="learned", group_size=16,
                                advanced={"calibration_steps": 1, "calibration_samples": 4, "calibration_seq_len": 16})
        apply_quantmla(tiny_mla_model("deepseek_v3", seed=2, num_hidden_layers=1), config, calibration_data=ids)
    finally:
        logging.enable_progress_bar()
    assert ("QuantMLA learned" in capsys.readouterr().err) is enabled
