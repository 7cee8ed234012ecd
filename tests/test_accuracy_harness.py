"""The accuracy harness (benchmarks/accuracy.py) computes its metrics correctly, on a tiny random model."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import CACHE_KWARG
from transformers import AutoTokenizer, DynamicCache

from quantmla_hf import QuantMLACache, QuantMLAConfig
from quantmla_hf.tiny_models import tiny_mla_model

HARNESS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy.py"
TOKENIZER = Path(__file__).resolve().parent.parent / "quantmla_hf" / "assets" / "reference_model"


@pytest.fixture(scope="module")
def acc():
    spec = importlib.util.spec_from_file_location("accuracy_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    return tiny_mla_model("deepseek_v3", seed=3)


def _ids(model, n, seed=0):
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _dynamic(model):
    return lambda: DynamicCache(config=model.config)


def test_scored_decode_matches_a_manual_full_forward(acc, model):
    # window 45, prefill 11, chunk 16: the decoded part (33 tokens) is not a multiple of the chunk.
    window, prefill, chunk, windows = 45, 11, 16, 2
    ids = _ids(model, 100)
    res, logprobs = acc.scored_decode(model, ids, _dynamic(model), window, prefill, chunk, windows)
    manual_lp, nll = [], 0.0
    with torch.no_grad():
        for w in range(windows):
            seq = ids[w * window : (w + 1) * window]
            lp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)[prefill - 1 : window - 1]
            manual_lp.append(lp)
            nll -= lp.gather(1, seq[prefill:window, None]).sum().item()
    manual_lp = torch.cat(manual_lp)
    assert res.tokens == windows * (window - prefill) == logprobs.shape[0]
    torch.testing.assert_close(logprobs, manual_lp, rtol=1e-4, atol=1e-4)
    assert math.isclose(res.perplexity, math.exp(nll / res.tokens), rel_tol=1e-4)


def test_kl_and_agreement_of_identical_and_different_caches(acc, model):
    ids = _ids(model, 96, seed=1)
    _, ref = acc.scored_decode(model, ids, _dynamic(model), 48, 16, 16, 2)
    _, same = acc.scored_decode(model, ids, _dynamic(model), 48, 16, 16, 2)
    assert float(acc.kl_divergence(ref, same).abs().max()) == 0.0
    rtn = QuantMLAConfig(content_bits=2, rope_bits=4, transform="none", sink_tokens=0, recent_tokens=0)
    _, quant = acc.scored_decode(model, ids, lambda: QuantMLACache(config=model.config, quantization_config=rtn),
                                 48, 16, 16, 2)
    kl = acc.kl_divergence(ref, quant)
    # Against torch's own KL: kl_div(input=log q, target=log p, log_target) sums p (log p - log q).
    expected = torch.nn.functional.kl_div(quant, ref, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=1e-7)
    assert float(kl.mean()) > 1e-4 and float(kl.min()) >= -1e-6
    with pytest.raises(ValueError, match="disagree in shape"):
        acc.kl_divergence(ref, quant[:-1])


def test_greedy_tokens_and_agreement(acc, model):
    prompts = torch.stack([_ids(model, 20, seed=s) for s in (2, 3)])
    toks = acc.greedy_tokens(model, prompts, 7, _dynamic(model))
    # Reference: recompute every step without a cache.
    seq = prompts.clone()
    with torch.no_grad():
        for _ in range(7):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(toks, seq[:, 20:])
    assert acc.agreement(toks, toks) == (1.0, 7.0)
    other = toks.clone()
    other[0, 2] = (other[0, 2] + 1) % model.config.vocab_size
    frac, prefix = acc.agreement(toks, other)
    assert frac == pytest.approx(13 / 14) and prefix == pytest.approx((2 + 7) / 2)


def test_needle_prompts_and_scoring(acc):
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    filler = acc.token_ids(tok, "The river flows through the valley. It is long and wide. " * 80)
    trials = acc.needle_trials(tok, filler, 300, depths=[0.1, 0.9], keys=[1, 3], seed=0)
    assert len(trials) == 4 and all(t.ids.numel() == 300 for t in trials)
    for t in trials:
        text = tok.decode(t.ids)
        assert f" is {t.answer}." in text and text.count("The secret number of") == t.keys + 1
        assert text.rstrip().endswith(" is")
    assert acc.exact_match("12345", " 12345.\n") and not acc.exact_match("12345", " 1234 5")
    assert not acc.exact_match("12345", " the number")


def test_batched_window_scores_match_the_one_window_decode(acc, model):
    # 3 windows in batches of 2 (the last batch has one window), decoded part 19 tokens with chunk 8 (not a multiple).
    window, prefill, chunk, n = 30, 11, 8, 3
    ids = _ids(model, 100, seed=4)
    cfg = QuantMLAConfig(content_bits=2, rope_bits=4, transform="none", sink_tokens=2, recent_tokens=9)
    make = lambda: QuantMLACache(config=model.config, quantization_config=cfg)  # noqa: E731
    ref_scores, ref_lp = acc.window_scores(model, ids, _dynamic(model), window, prefill, chunk, n, 2)
    scores, _ = acc.window_scores(model, ids, make, window, prefill, chunk, n, 2, ref=ref_lp)
    res_ref, lp_ref = acc.scored_decode(model, ids, _dynamic(model), window, prefill, chunk, n)
    res_q, lp_q = acc.scored_decode(model, ids, make, window, prefill, chunk, n)
    per = window - prefill
    torch.testing.assert_close(torch.cat(ref_lp).reshape(-1, lp_ref.shape[-1]), lp_ref, rtol=1e-4, atol=1e-4)
    assert math.isclose(float(ref_scores["nll"].mean()), res_ref.nll, rel_tol=1e-5)
    assert math.isclose(float(scores["nll"].mean()), res_q.nll, rel_tol=1e-5)
    kl = acc.kl_divergence(lp_ref, lp_q).view(n, per).mean(1).double()
    torch.testing.assert_close(scores["kl"], kl, rtol=1e-4, atol=1e-7)
    assert scores["kl"].shape == (n,) and float(scores["kl"].min()) > 0 and float(scores["top1"].max()) <= 1


def _row(acc, family, kl, nll, c=2, seed=None):
    spec = acc.asdict(acc.Method(family, c, 4, True, seed)) if family != "bf16" else acc.asdict(acc.Method("bf16"))
    row = {"method": acc.Method(**spec).name, "spec": spec, "nll": nll.tolist(), "seconds": 0.0}
    if kl is not None:
        row.update(kl=kl.tolist(), top1=[1.0] * len(kl))
    return row


def test_summary_calls_ties_and_resolved_differences(acc):
    gen = torch.Generator().manual_seed(0)
    nll = torch.rand(64, generator=gen, dtype=torch.float64) + 3
    rtn = torch.rand(64, generator=gen, dtype=torch.float64) * 0.02 + 0.005
    noise = lambda: 1 + 0.3 * (torch.rand(64, generator=gen, dtype=torch.float64) - 0.5)  # noqa: E731
    rows = [_row(acc, "bf16", None, nll), _row(acc, "rtn", rtn, nll + 0.01),
            *[_row(acc, "quantmla", rtn * 0.6 * noise(), nll + 0.004, seed=s) for s in (0, 1)],
            _row(acc, "quarot", rtn * noise(), nll + 0.01)]
    summary = acc.summarize(rows)
    by = {c["method"]: c for c in summary["vs_rtn"] + summary["seed_mean"]}
    assert by["QuantMLA C2R4 (seed 0)"]["verdict"] == "better" and by["QuaRot† C2R4"]["verdict"] == "tie"
    assert by["QuantMLA C2R4 (seed 0)"]["kl_ratio"].value == pytest.approx(0.6, abs=0.05)
    mean = by["QuantMLA C2R4 (mean of 2 seeds)"]
    assert len(mean["seed_ratios"]) == 2 and mean["verdict"] == "better"
    row = next(e for e in summary["rows"] if e["method"] == "RTN C2R4")
    assert row["dppl"].value == pytest.approx(math.expm1(0.01)) and row["dppl"].low == pytest.approx(math.expm1(0.01))
    text = acc.markdown({"command": "x", "settings": {}, "texts": {"t": rows}})
    assert "| tie |" in text and "| better |" in text and "seeds 0." in text


def test_calibrated_dir_is_keyed_by_the_whole_recipe(acc, model, tmp_path):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    recipe = acc.CalibrationRecipe(ids=ids, steps=1, lr=5e-3, seed=0, batch_size=2, protection="off")
    first, info = acc.calibrate_variant(model, "learned-C2R4-seed0", recipe, tmp_path)
    assert not info["loaded"] and len(list(tmp_path.glob("*.pt"))) == 1
    again, info2 = acc.calibrate_variant(model, "learned-C2R4-seed0", recipe, tmp_path)
    assert info2["loaded"] and info2["seconds"] == info["seconds"]
    for a, b in zip(first.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    # every ingredient that changes the model changes the key (so a new entry is made, never the stored one reused)
    digest = acc.model_digest(model)
    key = acc.calibration_key(digest, "learned-C2R4-seed0", recipe)
    other_model = copy.deepcopy(model)
    with torch.no_grad():
        next(other_model.parameters()).add_(1e-3)
    others = [acc.calibration_key(digest, "learned-C2R4-seed0", acc.replace(recipe, **change))
              for change in ({"steps": 2}, {"ids": ids.flip(0)}, {"lr": 1e-2}, {"seed": 1}, {"batch_size": 1},
                             {"protection": "on"})]
    others += [acc.calibration_key(acc.model_digest(other_model), "learned-C2R4-seed0", recipe),
               acc.calibration_key(digest, "learned-C4R4-seed0", recipe)]
    assert all(o != key for o in others) and len({str(sorted(o.items())) for o in others}) == len(others)
    _, info3 = acc.calibrate_variant(model, "learned-C2R4-seed0", acc.replace(recipe, steps=2), tmp_path)
    assert not info3["loaded"] and len(list(tmp_path.glob("*.pt"))) == 2
    # a stored file whose recorded key does not match is refused, not used
    path = next(p for p in tmp_path.glob("*.pt") if torch.load(p, weights_only=False)["key"] == info["key"])
    saved = torch.load(path, weights_only=False)
    saved["key"] = {**saved["key"], "steps": 30}
    torch.save(saved, path)
    with pytest.raises(ValueError, match="delete it or use another --calibrated-dir"):
        acc.calibrate_variant(model, "learned-C2R4-seed0", recipe, tmp_path)


def test_methods_and_bits(acc):
    rows = acc.expand_methods(["bf16", "rtn", "quanto"], acc.parse_bits("C4R4,C2R4"), [True, False])
    assert [m.name for m in rows] == ["BF16 cache", "RTN C4R4", "RTN C4R4, no protection", "RTN C2R4",
                                      "RTN C2R4, no protection", "QuantizedCache (quanto) int4",
                                      "QuantizedCache (quanto) int2"]
    with pytest.raises(ValueError, match="C<content bits>R<rope bits>"):
        acc.parse_bits("4x4")
    with pytest.raises(ValueError, match="unknown method 'gptq'"):
        acc.expand_methods(["gptq"], [(4, 4)], [True])
    rows = acc.expand_methods(["rtn", "quantmla"], [(2, 4)], [True], seeds=[0, 1])
    assert [m.name for m in rows] == ["RTN C2R4", "QuantMLA C2R4 (seed 0)", "QuantMLA C2R4 (seed 1)"]
    assert [m.variant for m in rows] == ["base", "learned-C2R4-seed0", "learned-C2R4-seed1"]


def test_content_only_variant_keeps_the_function_and_the_rope_key(acc, model):
    from quantmla_hf.attention.state import mla_attention_modules
    from quantmla_hf.calibration.fusion import fuse_content, fuse_rope
    from quantmla_hf.calibration.transforms import rope_layout

    fused = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    for m in mla_attention_modules(fused):
        d_c, d_r = m.kv_a_layernorm.weight.numel(), m.qk_rope_head_dim
        rot, _ = torch.linalg.qr(torch.randn(d_c, d_c, generator=gen, dtype=torch.float64))
        fuse_content(m, rot, torch.rand(d_c, generator=gen, dtype=torch.float64) + 0.5)
        fuse_rope(m, rope_layout(model.config, d_r), torch.randn(d_r // 2, generator=gen),
                  torch.rand(d_r // 2, generator=gen) + 0.5)
    content_only = acc.restore_rope_rows(fused, model)
    ids = _ids(model, 24, seed=5)[None]
    caches = {}
    with torch.no_grad():
        for name, mdl in (("base", model), ("fused", fused), ("content", content_only)):
            caches[name] = DynamicCache(config=model.config)
            logits = mdl(ids, **{CACHE_KWARG: caches[name]}).logits
            torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    base_layer, fused_layer, content_layer = (caches[n].layers[0] for n in ("base", "fused", "content"))
    # DynamicCache keys = latent, values = post-RoPE k_R for MLA models.
    torch.testing.assert_close(content_layer.values, base_layer.values)
    assert not torch.allclose(fused_layer.values, base_layer.values, atol=1e-3)
    torch.testing.assert_close(content_layer.keys, fused_layer.keys)
    # The mirror image (`rope` method): RoPE transform kept, content rows put back.
    rope_only = acc.restore_content_rows(fused, model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        torch.testing.assert_close(rope_only(ids, **{CACHE_KWARG: cache}).logits, model(ids).logits,
                                   rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.layers[0].keys, base_layer.keys)
    torch.testing.assert_close(cache.layers[0].values, fused_layer.values)
    assert [m.variant for m in acc.expand_methods(["rope"], [(4, 4)], [True])] == ["learned-C4R4-rope-seed0"]
