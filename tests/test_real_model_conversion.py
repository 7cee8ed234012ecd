"""The Llama -> stock DeepSeek-V3 (MLA) conversion of benchmarks/real_model/convert.py, on tiny random Llamas.

What must hold (convert.py's docstring derives it):
- with one KV head, `d_c = 2 * head_dim` (no compression) and no dropped RoPE residual, the converted model computes
  the original function: logits equal up to the latent-norm factor (<= 1/sqrt(1 + norm_margin)) and float rounding;
- with several KV heads the RoPE residual moves to the position-free key, which is exact at relative distance 0:
  a one-token input gives the original logits; longer inputs do not (RoPE information of the residual is lost);
- every layer has the shapes and config of a stock `deepseek_v3` model with `q_lora_rank=None` and a dense MLP,
  the checkpoint loads with plain `from_pretrained` and generates through `QuantMLACache`.
"""

import inspect
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def convert():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import convert as module
    finally:
        sys.path.pop(0)
    return module


def tiny_llama(kv_heads: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights: the converter must carry them over
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(torch.float64)


def converted(convert, llama, d_c: int, tmp_path, interleave: bool = True, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    windows = torch.randint(3, llama.config.vocab_size, (4, 32))
    sigmas = convert.input_covariances(llama, windows)
    s = convert.ConversionSettings(kv_lora_rank=d_c, rope_interleave=interleave, **kw)
    cfg, state, stats = convert.convert(llama, sigmas, s, dtype=torch.float64)
    convert.save_checkpoint(tmp_path, cfg, state)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    return model, stats


@pytest.mark.parametrize("interleave", [True, False])
def test_one_kv_head_no_compression_equals_the_original(convert, tmp_path, interleave):
    llama = tiny_llama(kv_heads=1)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = llama(ids).logits
    # With a 1e-9 norm margin the latent RMSNorm is linear to rounding: the logits agree to the precision of
    # DeepSeek's RMSNorm, which computes in fp32 even in an fp64 model (~1e-7 relative, not fp64's 1e-16).
    tight, stats = converted(convert, llama, d_c=32, tmp_path=tmp_path / "tight", interleave=interleave,
                             norm_margin=1e-9)
    assert all(abs(st["rope_kept_energy_mean"] - 1) < 1e-9 for st in stats)
    with torch.no_grad():
        assert (tight(ids).logits - ref).abs().max() / ref.abs().max() < 2e-6
    if interleave:
        # The default margin 1e-3 leaves the factor 1/sqrt(1 + mean(c^2)/eps) >= 1/sqrt(1 + 1e-3) on the NoPE keys
        # and values: a small, bounded deviation.
        model, _ = converted(convert, llama, d_c=32, tmp_path=tmp_path / "default", interleave=interleave)
        with torch.no_grad():
            err = (model(ids).logits - ref).abs().max() / ref.abs().max()
        assert 1e-6 < err < 2e-3, err


def test_several_kv_heads_exact_at_distance_zero_only(convert, tmp_path):
    llama = tiny_llama(kv_heads=2)
    model, stats = converted(convert, llama, d_c=64, tmp_path=tmp_path, norm_margin=1e-9)
    assert all(st["rope_kept_energy_mean"] < 1 for st in stats)  # random keys: one shared key cannot hold both heads
    ids = torch.randint(3, 128, (3, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = llama(ids).logits
        assert (model(ids).logits - ref).abs().max() / ref.abs().max() < 2e-6
        longer = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(4))
        gap = (model(longer).logits - llama(longer).logits).abs().max()
    assert gap > 1e-3  # the residual lost its RoPE: not exact beyond distance 0 (else the test above proves nothing)


def test_shapes_config_and_generation_with_the_quantmla_cache(convert, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    from quantmla_hf import QuantMLACache, QuantMLAConfig

    llama = tiny_llama(kv_heads=2)
    model, _ = converted(convert, llama, d_c=40, tmp_path=tmp_path)
    cfg = model.config
    assert type(model) is DeepseekV3ForCausalLM and cfg.model_type == "deepseek_v3"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == \
        (None, 40, 16, 16, 16)
    assert cfg.first_k_dense_replace == cfg.num_hidden_layers == 2 and cfg.rope_interleave
    assert cfg.rope_parameters["rope_theta"] == 10000.0 and cfg.rms_norm_eps == llama.config.rms_norm_eps
    H, hidden = 4, 64
    for layer, src in zip(model.model.layers, llama.model.layers):
        a = layer.self_attn
        assert a.q_proj.weight.shape == (H * 32, hidden)
        assert a.kv_a_proj_with_mqa.weight.shape == (40 + 16, hidden)
        assert a.kv_a_layernorm.weight.shape == (40,)
        assert a.kv_b_proj.weight.shape == (H * 32, 40)
        assert torch.equal(a.o_proj.weight, src.self_attn.o_proj.weight)
        assert type(layer.mlp).__name__ == "DeepseekV3MLP"
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp, name).weight, getattr(src.mlp, name).weight)
        assert torch.equal(layer.input_layernorm.weight, src.input_layernorm.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, src.post_attention_layernorm.weight)
    assert torch.equal(model.model.embed_tokens.weight, llama.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the source

    model = model.to(torch.float32)
    qcfg = QuantMLAConfig(content_bits=4, rope_bits=4, sink_tokens=2, recent_tokens=4, advanced={"kernel": "torch"})
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    cache = QuantMLACache(config=model.config, quantization_config=qcfg)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **{name: cache})
    assert out.shape == (2, 26)
    assert cache.get_seq_length() == 25


def test_bad_rank_is_refused(convert):
    llama = tiny_llama(kv_heads=2)
    sig = [torch.eye(64, dtype=torch.float64)] * 2
    with pytest.raises(ValueError, match="kv_lora_rank must lie in"):
        convert.convert(llama, sig, convert.ConversionSettings(kv_lora_rank=65))


def test_norm_margin_bounds_every_input(convert):
    """The latent-norm scale holds for any input, not only the calibration tokens: adversarial direction."""
    llama = tiny_llama(kv_heads=2)
    sig = convert.input_covariances(llama, torch.randint(3, 128, (2, 16)))
    attn, norm = llama.model.layers[0].self_attn, llama.model.layers[0].input_layernorm.weight
    s = convert.ConversionSettings(kv_lora_rank=24, norm_margin=1e-3)
    w, st = convert.convert_layer(attn, sig[0], norm, 10000.0, 1e-5, s)
    down = w["kv_a_proj_with_mqa.weight"][:24]
    # worst unit-RMS input: top right singular vector of down diag(g), scaled to ||x/g|| = sqrt(hidden)
    _, _, vh = torch.linalg.svd(down * norm.to(torch.float64)[None])
    x = vh[0] * math.sqrt(64) * norm.to(torch.float64)
    c = down @ x
    assert float(c.detach().pow(2).mean()) <= 1e-3 * 1e-5 * (1 + 1e-9)


def test_one_pass_capture_serves_the_inputs_the_library_captures():
    """benchmarks/real_model/one_pass_capture.py: the analysis' per-layer capture, served from one pass, gives the
    inputs the library's own capture gives (hidden states, RoPE tables, batch)."""
    from quantmla_hf.attention.state import mla_attention_modules
    from quantmla_hf.calibration.capture import capture_inputs
    from quantmla_hf.evaluation import analysis
    from quantmla_hf.tiny_models import tiny_mla_model

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        from one_pass_capture import one_pass_capture
    finally:
        sys.path.pop(0)
    model = tiny_mla_model("deepseek_v3", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(6))
    modules = mla_attention_modules(model)
    assert len(modules) >= 2
    with one_pass_capture():
        served = [analysis.capture_inputs(model, m, ids, 2) for m in modules]
    assert analysis.capture_inputs is capture_inputs  # restored
    for m, got in zip(modules, served):
        want = capture_inputs(model, m, ids, 2)
        assert torch.equal(got.hidden, want.hidden) and got.batch_size == want.batch_size
        for a, b in zip(got.kwargs["position_embeddings"], want.kwargs["position_embeddings"]):
            assert torch.equal(a, b)


def test_exact_rows_score_what_chunked_decode_scores():
    """evaluate.py scores unquantized rows with one causal forward; for an exact cache that equals prefill + chunked
    decode (what the quantized rows get) up to float rounding."""
    from transformers import DynamicCache

    from quantmla_hf.tiny_models import tiny_mla_model

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import evaluate
    finally:
        sys.path.pop(0)
    model = tiny_mla_model("deepseek_v3", seed=1).eval()
    seq = torch.randint(0, model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    a = evaluate.window_logprobs_exact(model, seq, prefill=20)
    b = evaluate.window_logprobs(model, seq, lambda: DynamicCache(config=model.config), prefill=20, chunk=16)
    assert a.shape == b.shape == (25, model.config.vocab_size)
    assert torch.allclose(a, b, atol=1e-4)
    stats = evaluate.window_stats(b, seq[20:], a)
    assert stats["n"] == 25 and abs(stats["kl"]) < 1e-3 and stats["top1"] == 25


def test_paired_bootstrap_summary():
    """Intervals of evaluate.summarize: a row equal to BF16 has a zero interval; a uniformly worse row's interval
    excludes zero; the learned-RTN difference is paired (same resamples)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import evaluate
    finally:
        sys.path.pop(0)
    gen = torch.Generator().manual_seed(8)
    base = [{"nll": float(v), "n": 100, "kl": 0.0, "top1": 100} for v in 300 + 50 * torch.rand(40, generator=gen)]
    worse = [dict(w, nll=w["nll"] + 2.0, kl=1.0, top1=90) for w in base]
    rows = {"BF16 cache": {"windows": base}, "RTN C2R4": {"windows": worse},
            "QuantMLA C2R4": {"windows": [dict(w, nll=w["nll"] + 1.0, kl=0.5) for w in base]}}
    s = evaluate.summarize({"rows": rows}, draws=200)
    assert s["windows"] == 40
    assert s["rows"]["BF16 cache"]["dppl_ci"] == (0.0, 0.0)
    lo, hi = s["rows"]["RTN C2R4"]["dppl_ci"]
    assert 0 < lo <= s["rows"]["RTN C2R4"]["dppl"] <= hi
    assert abs(s["rows"]["RTN C2R4"]["dppl"] - (math.exp(2.0 / 100) - 1)) < 1e-9
    d = s["comparisons"]["QuantMLA C2R4 - RTN C2R4"]
    assert d["dppl_ci"][1] < 0 and abs(d["dkl"] + 0.005) < 1e-12
    assert "QuantMLA C2R4 - RTN C2R4" in evaluate.markdown({"command": "x", "texts": {"t": {"summary": s}}})
    # scored against another run's BF16 log-probabilities: perplexity and KL, no change against a BF16 row
    alone = evaluate.summarize({"rows": {k: v for k, v in rows.items() if k != "BF16 cache"}}, draws=200)
    assert alone["rows"]["RTN C2R4"]["kl"] == pytest.approx(0.01) and "dppl" not in alone["rows"]["RTN C2R4"]
    assert math.isfinite(alone["rows"]["QuantMLA C2R4"]["ppl"]) and not alone["comparisons"]
    assert "no BF16 row here" in evaluate.markdown({"command": "x", "texts": {"t": {"summary": alone}}})


def test_kl_ratio_comparisons_and_verdicts():
    """evaluate.summarize compares every non-RTN row with RTN at its setting, and QuantMLA with the other transforms
    there; the KL ratio is mean KL over mean KL with the interval of quantmla_hf.evaluation.intervals.bootstrap (paired)."""
    from quantmla_hf.evaluation.intervals import bootstrap, ratio_of_means

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import evaluate
    finally:
        sys.path.pop(0)
    gen = torch.Generator().manual_seed(9)
    base = [{"nll": float(v), "n": 128, "kl": 0.0, "top1": 128} for v in 300 + 50 * torch.rand(30, generator=gen)]
    rtn_kl = 100 + 40 * torch.rand(30, generator=gen)
    noise = 20 * torch.randn(30, generator=gen)
    rows = {"BF16 cache": {"windows": base},
            "RTN C2R4": {"windows": [dict(w, kl=float(k)) for w, k in zip(base, rtn_kl)]},
            "QuantMLA C2R4": {"windows": [dict(w, kl=float(0.5 * k)) for w, k in zip(base, rtn_kl)]},
            "QuaRot† C2R4": {"windows": [dict(w, kl=float(k + e)) for w, k, e in zip(base, rtn_kl, noise)]},
            "RTN C2R4, no protection": {"windows": [dict(w, kl=float(2 * k)) for w, k in zip(base, rtn_kl)]}}
    s = evaluate.summarize({"rows": rows}, draws=300)
    assert set(s["comparisons"]) == {"QuantMLA C2R4 - RTN C2R4", "QuaRot† C2R4 - RTN C2R4",
                                     "QuantMLA C2R4 - QuaRot† C2R4"}
    half = s["comparisons"]["QuantMLA C2R4 - RTN C2R4"]
    assert abs(half["kl_ratio"] - 0.5) < 1e-12 and half["kl_ratio_ci"][1] < 1 and half["verdict"] == "lower"
    assert half["kl_ratio_ci"][0] == pytest.approx(0.5) and half["kl_ratio_ci"][1] == pytest.approx(0.5)
    tie = s["comparisons"]["QuaRot† C2R4 - RTN C2R4"]
    ref = bootstrap(ratio_of_means, (rtn_kl + noise) / 128, rtn_kl / 128, resamples=300, seed=0)
    assert tie["kl_ratio"] == pytest.approx(ref.value) and tie["kl_ratio_ci"] == pytest.approx((ref.low, ref.high))
    assert tie["verdict"] == "tie" and tie["kl_ratio_ci"][0] < 1 < tie["kl_ratio_ci"][1]
    assert "| QuantMLA C2R4 - RTN C2R4 |" in evaluate.markdown({"command": "x", "texts": {"t": {"summary": s}}})
    assert evaluate.setting_of("RTN + content transform C2R4, no protection") == ("RTN + content transform",
                                                                                 "C2R4, no protection")
    assert evaluate.setting_of("BF16 cache") is None


def test_calibrated_variant_is_keyed_by_the_protection_it_models(tmp_path):
    """evaluate.calibrated_variant stores each calibration under its full key: a protected row's learned variant and
    an unprotected row's are different models; the same recipe is reused (not recalibrated), another is refused."""
    import json as _json

    from quantmla_hf.tiny_models import tiny_mla_model

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import evaluate
    finally:
        sys.path.pop(0)
    accuracy = evaluate.harness
    model = tiny_mla_model("deepseek_v3", seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 136), generator=torch.Generator().manual_seed(3))
    on, info_on = evaluate.calibrated_variant(model, "learned-C2R4-seed0", ids, 1, "on", tmp_path)
    off, info_off = evaluate.calibrated_variant(model, "learned-C2R4-seed0", ids, 1, "off", tmp_path)
    assert not info_on["loaded"] and not info_off["loaded"]
    assert info_on["record"]["protection_modelled"] == [4, 128] and info_off["record"]["protection_modelled"] == [0, 0]
    assert info_on["key"]["protection"] == "on" and len(list(tmp_path.glob("learned-C2R4-seed0-*.pt"))) == 2
    again, info = evaluate.calibrated_variant(model, "learned-C2R4-seed0", ids, 1, "on", tmp_path)
    assert info["loaded"] and info["seconds"] == info_on["seconds"]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), on.state_dict().values()))
    # a stored file whose recorded key differs from its name's is refused, not silently reused
    path = next(p for p in tmp_path.glob("learned-C2R4-seed0-*.pt")
                if torch.load(p, weights_only=False)["key"]["protection"] == "on")
    saved = torch.load(path, weights_only=False)
    saved["key"] = {**saved["key"], "steps": 99}
    torch.save(saved, path)
    with pytest.raises(ValueError, match="calibrated with"):
        evaluate.calibrated_variant(model, "learned-C2R4-seed0", ids, 1, "on", tmp_path)
    # which rows calibrate with which protection
    rows = {m.name: evaluate.calibration_protection_for(m, "on") for m in accuracy.expand_methods(
        ["rtn", "quarot", "smooth", "quantmla", "content"], [(2, 4)], [True, False], seeds=[None])}
    assert rows == {"RTN C2R4": "off", "RTN C2R4, no protection": "off", "QuaRot† C2R4": "off",
                    "QuaRot† C2R4, no protection": "off", "SmoothQuant† C2R4": "off",
                    "SmoothQuant† C2R4, no protection": "off", "QuantMLA C2R4": "on", "QuantMLA C2R4, no protection": "off",
                    "RTN + content transform C2R4": "on", "RTN + content transform C2R4, no protection": "off"}
    assert _json.dumps(info_on["key"])  # the key is plain data (written to the results json)


def test_pair_rows_pairs_two_outputs_window_by_window(tmp_path, capsys):
    """benchmarks/real_model/pair_rows.py: the KL ratio of two rows of two evaluate.py outputs, paired by window."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "real_model"))
    try:
        import pair_rows
    finally:
        sys.path.pop(0)
    kl = torch.rand(8, generator=torch.Generator().manual_seed(0)) + 0.5
    for name, scale in (("a", 1.5), ("b", 1.0)):
        rows = {"R": {"windows": [{"nll": 100.0 * scale, "n": 128, "kl": float(k) * scale} for k in kl]}}
        (tmp_path / f"{name}.json").write_text(json.dumps({"texts": {"t.txt": {"rows": rows}}}))
    out = pair_rows.main([str(tmp_path / "a.json"), "R", str(tmp_path / "b.json"), "R"])
    assert out["windows"] == 8 and abs(out["kl_ratio"].value - 1.5) < 1e-12
    assert out["kl_ratio"].low <= 1.5 <= out["kl_ratio"].high and "t.txt, 8 windows" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no row"):
        pair_rows.main([str(tmp_path / "a.json"), "missing", str(tmp_path / "b.json"), "R"])
