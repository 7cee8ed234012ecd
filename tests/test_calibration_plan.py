"""Calibration sized for the machine: text tokenized in bounded pieces, the RoPE objective through query Gram matrices,
the cost line in the log before learning, the thread count, and resuming a `from_pretrained` calibration."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla_hf import QuantMLAConfig
from quantmla_hf.calibration import calibrate, checkpoint, plan, threads
from quantmla_hf.calibration.defaults import default_calibration_text, resolve_transform
from quantmla_hf.calibration.objectives import positional_qk_nmse, positional_qk_sums, query_grams
from quantmla_hf.calibration.protection import quantized_pairs
from quantmla_hf.calibration.threads import cpu_threads
from quantmla_hf.calibration.tokens import piece_chars, split_text, text_token_ids, token_stream
from quantmla_hf.embedded import REFERENCE_MODEL
from quantmla_hf.tiny_models import tiny_mla_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


class _Recording:
    """The reference tokenizer, recording the length of every text it is called on and of what it returns."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.model_max_length = inner.model_max_length

    def __call__(self, text, **kwargs):
        out = self.inner(text, **kwargs)
        self.calls.append((len(text), len(out["input_ids"])))
        return out


def test_default_text_is_tokenized_in_bounded_pieces_with_the_whole_texts_ids(tokenizer, caplog):
    text = default_calibration_text()
    recording = _Recording(tokenizer)
    with caplog.at_level(logging.WARNING):
        ids = token_stream([text], recording)
    assert "".join(split_text(text, piece_chars(tokenizer))) == text  # the pieces are the text, cut
    assert len(recording.calls) > 50
    assert max(chars for chars, _ in recording.calls) <= piece_chars(tokenizer) <= tokenizer.model_max_length
    assert max(tokens for _, tokens in recording.calls) < tokenizer.model_max_length
    assert "Token indices sequence length" not in caplog.text
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]  # the length warning fires here, not above
    assert torch.equal(ids, torch.tensor(whole))
    calls = len(recording.calls)
    assert torch.equal(token_stream([text], recording), ids) and len(recording.calls) == calls  # counted once, kept


def test_eval_text_is_tokenized_as_the_tokenizer_does_and_only_as_far_as_needed(tokenizer, caplog):
    text = default_calibration_text()
    recording = _Recording(tokenizer)
    with caplog.at_level(logging.WARNING):
        ids = text_token_ids(text, recording)
        before = len(recording.calls)
        first = text_token_ids(text, recording, needed=1000)
        read = sum(chars for chars, _ in recording.calls[before:])
    assert "Token indices sequence length" not in caplog.text
    whole = tokenizer(text)["input_ids"]  # special tokens included, as `quantmla eval` reads a text
    assert torch.equal(ids, torch.tensor(whole))
    assert 1000 <= first.numel() < 1000 + tokenizer.model_max_length and torch.equal(first, ids[: first.numel()])
    assert read < 4 * piece_chars(tokenizer) + 1000 < len(text) // 100  # a few pieces read, not the text


def test_a_stretch_without_a_word_start_is_cut_at_the_piece_size():
    assert split_text("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_text("ab cd\nef gh", 7) == ["ab cd\n", "ef gh"]


@pytest.mark.parametrize("T,sink,recent", [(37, 0, 0), (37, 4, 8), (64, 4, 128), (64, 0, 5), (10, 12, 0)])
def test_gram_form_of_the_rope_objective_equals_the_pairwise_sums(T, sink, recent):
    g = torch.Generator().manual_seed(T + sink + recent)
    q = torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, T, 8, generator=g, dtype=torch.float64)
    k_hat = k + 0.1 * torch.randn(2, T, 8, generator=g, dtype=torch.float64)
    pairs = quantized_pairs(T, sink, recent) if sink or recent else None
    num, den = positional_qk_nmse(q, k, k_hat, sums=True, error_pairs=pairs)
    grams, causal = query_grams(q, sink, recent)
    num_g, den_g = positional_qk_sums(k - k_hat, k, grams, causal)
    torch.testing.assert_close(num_g.double(), num.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(den_g.double(), den.double(), rtol=1e-5, atol=1e-6)


def test_default_text_makes_auto_learned(tokenizer):
    transform, why = resolve_transform("auto", None, tokenizer)
    assert transform == "learned" and "237210 calibration tokens" in why


def _texts(chars: int = 60_000):
    return [default_calibration_text()[:chars]]


def _tiny():
    return tiny_mla_model("deepseek_v3", seed=3, vocab_size=8192)


def _pipeline_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "quantmla_hf.calibration.pipeline"]


def test_library_recipe_learns_and_says_its_cost_and_a_shorter_recipe_before_starting(tokenizer, caplog):
    model, cfg = _tiny(), QuantMLAConfig(transform="learned", content_bits=2)
    with caplog.at_level(logging.WARNING, logger="quantmla_hf.calibration.pipeline"):
        calibrate(model, cfg, _texts(30_000), tokenizer=tokenizer, progress=False)
    record = cfg.extra["calibration"]
    n = record["windows"][0]
    assert record["windows"] == [n, 512] and 10 < n < 64 and record["steps"] == 100  # the library's recipe
    lines = _pipeline_lines(caplog)
    assert len(lines) == 1, lines
    assert (f"calibrating 2 of 2 decoder layers (learned): {n} windows of 512 tokens ({n * 512:,} tokens), 100 Adam "
            "steps per layer and path at learning rate 0.005") in lines[0]
    assert "estimated" in lines[0] and "s per layer" in lines[0] and record["estimated_seconds"] > 0
    assert ("advanced={'calibration_samples': 32, 'calibration_seq_len': 256, 'calibration_steps': 50, "
            "'calibration_lr': 0.01} would take about") in lines[0]
    assert record["batch_size"] == plan.CPU_BATCH  # sized for the CPU: no batch_size given
    assert all(layer["threads"] >= 1 for layer in record["layers"])
    for path in ("content", "rope"):  # it learned: below RTN on its held-out windows in every layer
        assert all(layer[path]["heldout_best"] < layer[path]["heldout_rtn"] for layer in record["layers"])


def test_recipe_options_given_are_used_and_no_shorter_recipe_is_offered(tokenizer, caplog):
    model = _tiny()
    cfg = QuantMLAConfig(transform="learned",
                         advanced={"calibration_steps": 3, "calibration_samples": 8, "calibration_seq_len": 64})
    with caplog.at_level(logging.WARNING, logger="quantmla_hf.calibration.pipeline"):
        calibrate(model, cfg, _texts(), tokenizer=tokenizer, progress=False)
    record = cfg.extra["calibration"]
    assert record["windows"] == [8, 64] and record["steps"] == 3 and record["lr"] == 5e-3
    assert "'calibration_samples': 32" not in _pipeline_lines(caplog)[0]
    assert plan.short_recipe_hint(QuantMLAConfig(), torch.device("cpu")) is not None
    assert plan.short_recipe_hint(QuantMLAConfig(advanced={"calibration_lr": 5e-3}), torch.device("cpu")) is None
    assert plan.short_recipe_hint(QuantMLAConfig(), torch.device("cuda")) is None
    assert plan.default_batch("cpu") == 4 and plan.default_batch(torch.device("cuda", 0)) == 8


def test_estimate_counts_the_recipe():
    one = plan.estimate_seconds(0.1, windows=32, held=3, batch=8, steps=50, modules=1, layers=1)
    assert plan.estimate_seconds(0.1, 32, 3, 8, 50, 1, 6) == pytest.approx(6 * one)
    assert plan.estimate_seconds(0.2, 32, 3, 8, 50, 1, 1) == pytest.approx(2 * one)
    assert plan.estimate_seconds(0.1, 32, 3, 8, 100, 1, 1) > 1.5 * one  # the steps are most of the work


def test_a_fixed_thread_count_is_left_alone(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    with cpu_threads("cpu") as n:
        assert n == before == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with cpu_threads("cpu") as n:
        assert n in (1, before) and torch.get_num_threads() == n
    assert torch.get_num_threads() == before


def test_this_process_own_threads_are_not_counted_as_other_load(monkeypatch):
    # The previous sample and now, one second apart: the allowed CPUs were busy 2.0 s, 1.7 s of it this process's.
    t0 = time.perf_counter()
    monkeypatch.setattr(threads, "_last_sample", (t0, 100.0, 5.0))
    monkeypatch.setattr(threads, "_cpu_sample", lambda: (t0 + 1.0, 102.0, 6.7))
    assert threads.other_load() == pytest.approx(0.3)
    monkeypatch.setattr(threads, "_cpu_sample", lambda: (t0 + 2.0, 104.0, 8.7))  # all of it this process's
    assert threads.other_load() == pytest.approx(0.0, abs=1e-9)


def test_a_little_load_of_others_keeps_every_core_and_the_count_can_go_back_up(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "MIN_GAIN", 0.0)  # the probe always prefers the most threads: the count is the cap
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "other_load", lambda: 0.01)  # a daemon's share of a core
        with threads.cpu_threads("cpu") as n:
            assert n == 2
            monkeypatch.setattr(threads, "other_load", lambda: 0.9)  # another process on one core
            assert threads.retune("cpu") == 1
            monkeypatch.setattr(threads, "other_load", lambda: 0.0)  # gone again
            assert threads.retune("cpu") == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


class _Killed(Exception):
    pass


def test_from_pretrained_calibration_resumes_from_its_checkpoint_dir(tmp_path, tokenizer, monkeypatch):
    base = _tiny()
    base.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = tmp_path / "calib.txt"
    text.write_text(_texts()[0])
    recipe = dict(calibration_samples=8, calibration_seq_len=64, calibration_steps=4)

    def load(**advanced):
        cfg = QuantMLAConfig(transform="learned", calibration_data=str(text), advanced={**recipe, **advanced})
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", quantization_config=cfg)

    whole = load()
    ckpt = str(tmp_path / "ckpt")
    real = checkpoint.CalibrationCheckpoint.save

    def killed_after_first_layer(self, index, modules):
        real(self, index, modules)
        raise _Killed  # the process dies once layer 0 is on disk

    monkeypatch.setattr(checkpoint.CalibrationCheckpoint, "save", killed_after_first_layer)
    with pytest.raises(_Killed):
        load(calibration_checkpoint_dir=ckpt)
    assert sorted(os.listdir(ckpt)) == ["layer_00000.pt", "manifest.json"]
    monkeypatch.setattr(checkpoint.CalibrationCheckpoint, "save", real)
    resumed = load(calibration_checkpoint_dir=ckpt)
    layers = resumed.config.quantization_config.extra["calibration"]["layers"]
    assert [layer.get("resumed", False) for layer in layers] == [True, False]
    saved = resumed.config.quantization_config.to_dict()
    assert "calibration_checkpoint_dir" not in {**saved, **saved["advanced"]}  # never in config.json
    expected = whole.state_dict()
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_checkpoint_dir_option_is_validated():
    with pytest.raises(ValueError, match="calibration_checkpoint_dir must be a folder path"):
        QuantMLAConfig(advanced={"calibration_checkpoint_dir": ""})
    with pytest.raises(ValueError, match="calibration_checkpoint_dir must be a folder path"):
        QuantMLAConfig(advanced={"calibration_checkpoint_dir": 3})
