"""Protection-aware calibration objectives (quantmla_hf/calibration/protection.py) and the default transform.

The content objective with sink/recent protection must equal, query by query, the attention output the cache would
give (the quantized latent for the keys it holds quantized, the exact one for sink and recent keys); the RoPE
objective must count exactly the quantized pairs; learning with it must lower the error on data it never saw, on a
tiny model with planted outliers, and beat RTN through the real cache with the same protection.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CACHE_KWARG
from test_calibration import ids, planted

from quantmla_hf import QuantMLACache, QuantMLAConfig
from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.calibration import calibrate
from quantmla_hf.calibration.capture import AttentionRunner, LatentHook, capture_inputs
from quantmla_hf.calibration.defaults import MIN_LEARNED_TOKENS, resolve_transform
from quantmla_hf.calibration.fusion import content_weights
from quantmla_hf.calibration.learn import ContentLearner, reference_streams
from quantmla_hf.calibration.objectives import positional_qk_nmse, quantize_dequantize
from quantmla_hf.calibration.pipeline import protection_to_model
from quantmla_hf.calibration.protection import dual_history_mask, quantized_fraction, quantized_pairs
from quantmla_hf.calibration.transforms import rope_kind
from quantmla_hf.format import PathFormat

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quantized_pairs_follow_the_cache_rule():
    q = quantized_pairs(9, sink=2, recent=3)
    for t in range(9):
        for j in range(9):
            assert bool(q[t, j]) == (j <= t and j >= 2 and t - j >= 3), (t, j)
    assert quantized_pairs(6, 0, 0).equal(torch.ones(6, 6, dtype=torch.bool).tril())
    mask = dual_history_mask(9, 2, 3, torch.float32)
    assert mask.shape == (1, 1, 9, 18)
    seen = mask[0, 0] == 0
    # every causal pair is seen exactly once: through the quantized copy or the exact one
    assert torch.equal(seen[:, :9].int() + seen[:, 9:].int(), torch.ones(9, 9, dtype=torch.int).tril())
    assert quantized_fraction(512, 4, 128) == pytest.approx((380 * 381 / 2) / (512 * 513 / 2))


def test_protected_content_objective_equals_the_per_query_history():
    model = planted()
    m = mla_attention_modules(model)[0]
    x = ids(2, seed=7, t=20)
    inputs = capture_inputs(model, m, x, 2)
    runner = AttentionRunner(m, inputs)
    streams = reference_streams(runner, rope_kind(model.config))
    teacher = streams.outputs
    fmt = PathFormat(m.kv_a_layernorm.weight.numel(), 2, 64)
    sink, recent = 2, 5
    learner = ContentLearner(runner, streams, fmt, sink, recent)
    gen = torch.Generator().manual_seed(0)
    rotation, _ = torch.linalg.qr(torch.randn(fmt.dim, fmt.dim, generator=gen))
    scale = torch.rand(fmt.dim, generator=gen) + 0.5
    num, den = learner.loss_sums(rotation, scale, torch.arange(2))
    # Brute force: one replay per query t, whose history holds the quantized latent exactly where the cache would.
    overrides = content_weights(m, rotation, scale, learner.base)
    pairs = quantized_pairs(20, sink, recent)
    expected = 0.0
    with torch.no_grad():
        for t in range(20):
            def history(latent, k_rot, t=t):
                mixed = torch.where(pairs[t][None, None, :, None], quantize_dequantize(latent, fmt), latent)
                return mixed, k_rot
            out = runner(inputs.hidden, overrides, LatentHook(history))
            expected += float((out[:, t] - teacher[:, t]).pow(2).sum())
    assert float(num) == pytest.approx(expected, rel=1e-4)
    assert float(den) == pytest.approx(float(teacher.pow(2).sum()), rel=1e-6)


def test_protected_rope_objective_counts_only_quantized_pairs():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 10, 8, generator=gen), torch.randn(2, 10, 8, generator=gen)
    k_hat = k + 0.1 * torch.randn(2, 10, 8, generator=gen)
    pairs = quantized_pairs(10, 1, 4)
    num, den = positional_qk_nmse(q, k, k_hat, sums=True, error_pairs=pairs)
    err = torch.einsum("bhtr,bjr->bhtj", q, k - k_hat).pow(2)
    ref = torch.einsum("bhtr,bjr->bhtj", q, k).pow(2)
    assert float(num) == pytest.approx(float(err[..., pairs].sum()), rel=1e-5)
    assert float(den) == pytest.approx(float(ref[..., torch.ones(10, 10, dtype=torch.bool).tril()].sum()), rel=1e-5)


def test_protection_setting():
    assert protection_to_model("auto", 512, 4, 128)[:2] == (4, 128)
    assert protection_to_model("auto", 256, 4, 128)[:2] == (0, 0)  # 24% of pairs quantized: too few
    assert protection_to_model("off", 512, 4, 128)[:2] == (0, 0)
    assert protection_to_model("on", 256, 4, 128)[:2] == (4, 128)
    with pytest.raises(ValueError, match="leaves no quantized pair"):
        protection_to_model("on", 100, 4, 128)
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        protection_to_model("yes", 512, 4, 128)


def _protected_decode_error(model, x, cfg, prompt):
    """Relative logits error of decoding `x[:, prompt:]` token by token through the real QuantMLACache."""
    with torch.no_grad():
        ref = model(x).logits[:, prompt:]
        cache = QuantMLACache(config=model.config, quantization_config=cfg)
        model(x[:, :prompt], **{CACHE_KWARG: cache})
        out = torch.cat([model(x[:, t : t + 1], **{CACHE_KWARG: cache}).logits for t in range(prompt, x.shape[1])], 1)
    return float((out - ref).norm() / ref.norm())


def _heldout_objective(model, x, fmt, sink, recent):
    """Mean over layers of the protected content objective of the model's own (fused) latent on windows `x`."""
    values = []
    for m in mla_attention_modules(model):
        runner = AttentionRunner(m, capture_inputs(model, m, x, x.shape[0]))
        learner = ContentLearner(runner, reference_streams(runner, rope_kind(model.config)), fmt, sink, recent)
        w = m.kv_a_layernorm.weight.detach().float()
        values.append(learner.objective(torch.diag(torch.sign(w)), w.abs(), torch.arange(x.shape[0])))
    return sum(values) / len(values)


def test_learning_with_protection_lowers_the_error_on_unseen_windows_and_beats_rtn_in_the_cache():
    base = planted()
    model = copy.deepcopy(base)
    sink, recent = 2, 6
    cfg = QuantMLAConfig(transform="learned", content_bits=2, rope_bits=4, sink_tokens=sink, recent_tokens=recent,
                         advanced={"calibration_steps": 30, "calibration_lr": 1e-2})
    calibrate(model, cfg, ids(12, seed=0, t=40), batch_size=4, progress=False, calibration_protection="on")
    record = cfg.extra["calibration"]
    assert record["protection_modelled"] == [sink, recent]
    for layer in record["layers"]:
        for path in ("content", "rope"):
            assert layer[path]["heldout_best"] < layer[path]["heldout_rtn"], (path, layer[path])
    fmt = PathFormat(base.config.kv_lora_rank, 2, 64)
    unseen = ids(6, seed=11, t=40)
    assert _heldout_objective(model, unseen, fmt, sink, recent) < 0.8 * _heldout_objective(base, unseen, fmt, sink,
                                                                                          recent)
    decode = ids(3, seed=12, t=40)
    rtn_cfg = QuantMLAConfig(content_bits=2, rope_bits=4, sink_tokens=sink, recent_tokens=recent, transform="none")
    assert _protected_decode_error(model, decode, cfg, 16) < 0.8 * _protected_decode_error(base, decode, rtn_cfg, 16)


def test_auto_transform_falls_back_to_rtn_on_small_data():
    tok = lambda text, add_special_tokens=False: {"input_ids": text.split()}  # noqa: E731  (one token per word)
    small = ["word " * 100]
    transform, why = resolve_transform("auto", small, tok)
    assert transform == "none" and "only 100 calibration tokens" in why and str(MIN_LEARNED_TOKENS) in why
    transform, why = resolve_transform("auto", ["word " * MIN_LEARNED_TOKENS], tok)
    assert transform == "learned" and f"{MIN_LEARNED_TOKENS} calibration tokens" in why
    assert resolve_transform("auto", None, None)[0] == "none"
    assert resolve_transform("learned", small, tok)[0] == "learned"  # an explicit choice is kept
    assert resolve_transform("auto", torch.zeros(2, 4096, dtype=torch.long), None)[0] == "learned"


def test_demo_and_cli_default_say_rtn_for_the_embedded_text(tmp_path, capsys):
    import json

    from transformers import AutoTokenizer

    from quantmla_hf.cli.demo import build_parser
    from quantmla_hf.cli.main import main
    from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL
    from quantmla_hf.tiny_models import tiny_mla_model

    assert build_parser().parse_args([]).transform == "auto"
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    transform, why = resolve_transform("auto", str(CALIBRATION_TEXT), tokenizer)
    assert transform == "none" and "RTN" in why and "calibration tokens" in why
    base = tmp_path / "base"
    tiny_mla_model("deepseek_v3", seed=6, vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "q"
    assert main(["quantize", str(base), "--out", str(out), "--calibration", str(CALIBRATION_TEXT),
                 "--group-size", "16"]) == 0
    assert "transform='none' (RTN)" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["transform"] == "none"
