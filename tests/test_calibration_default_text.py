"""The default calibration text: shipped compressed with its provenance and licence, long enough for "auto" to
learn, tokenized with the model's own tokenizer, and used by `quantize` when no text is given."""

import pytest
from transformers import AutoTokenizer

from quantmla_hf.calibration import calibrate
from quantmla_hf.calibration.defaults import (
    DEFAULT_SOURCE,
    DEFAULT_TEXT,
    MIN_LEARNED_TOKENS,
    default_calibration_text,
    resolve_transform,
)
from quantmla_hf.config import TRANSFORMS, QuantMLAConfig
from quantmla_hf.embedded import REFERENCE_MODEL
from quantmla_hf.tiny_models import tiny_mla_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


def test_the_text_is_small_public_domain_and_documented():
    assert DEFAULT_TEXT.suffixes[-2:] == [".txt", ".xz"] and DEFAULT_TEXT.stat().st_size < 300_000
    text = default_calibration_text()
    assert len(text) > 700_000 and "DEVIL'S DICTIONARY" not in text[:100]  # the title page is dropped
    assert "ABASEMENT, n." in text and "kluge" in text  # both works are in it
    readme = (DEFAULT_TEXT.parent / "README.md").read_text()
    notice = (DEFAULT_TEXT.parent / "NOTICE").read_text()
    for words in ("public domain", "dict-devil", "dict-jargon", "When to bring your own text"):
        assert words in readme
    assert "Jargon File, version 4.4.7" in notice and "public domain" in notice


def test_auto_learns_from_the_default_text_with_the_models_tokenizer(tokenizer):
    transform, why = resolve_transform("auto", None, tokenizer)
    assert transform == "learned" and "default calibration text" in why
    n = int(why.split(":")[1].split()[0])
    assert n >= 64 * 512 >= MIN_LEARNED_TOKENS  # the default 64 windows of 512 tokens are all distinct text
    assert resolve_transform("auto", None, None)[0] == "none"  # nothing can count text without a tokenizer


def test_quantize_without_text_calibrates_on_the_default_text(tokenizer):
    model = tiny_mla_model("deepseek_v3", seed=3, vocab_size=len(tokenizer))
    cfg = QuantMLAConfig(transform="learned",
                         advanced={"calibration_samples": 4, "calibration_seq_len": 64, "calibration_steps": 2})
    calibrate(model, cfg, tokenizer=tokenizer, progress=False)
    record = cfg.extra["calibration"]
    assert record["transform"] == "learned" and record["windows"] == [4, 64]
    assert cfg.extra["calibration_source"] == DEFAULT_SOURCE
    with pytest.raises(ValueError, match="needs calibration_data"):
        calibrate(tiny_mla_model("deepseek_v3"), QuantMLAConfig(transform="learned"), progress=False)


@pytest.mark.skipif("auto" not in TRANSFORMS, reason="this QuantMLAConfig does not take transform='auto'")
def test_auto_config_resolves_to_learned_on_the_default_text(tokenizer):
    cfg = QuantMLAConfig(transform="auto",
                         advanced={"calibration_samples": 4, "calibration_seq_len": 64, "calibration_steps": 2})
    calibrate(tiny_mla_model("deepseek_v3", seed=3, vocab_size=len(tokenizer)), cfg, tokenizer=tokenizer,
             progress=False)
    assert cfg.transform == "learned" and "default calibration text" in cfg.extra["transform_choice"]


def test_from_pretrained_with_the_default_config_learns_on_the_default_text(tokenizer, tmp_path):
    """`from_pretrained(path, quantization_config=QuantMLAConfig())` on a checkpoint with a tokenizer and no text of
    the user's: learned transforms calibrated on the default text (calibration sizes shrunk to keep the test short),
    recorded in the saved config."""
    from transformers import AutoModelForCausalLM

    tiny_mla_model("deepseek_v3", seed=4, vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = QuantMLAConfig(advanced={"calibration_samples": 4, "calibration_seq_len": 64, "calibration_steps": 2})
    assert config.transform == "auto"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    saved = model.config.quantization_config
    assert saved.transform == "learned" and saved.calibrated
    assert saved.extra["calibration_source"] == DEFAULT_SOURCE
