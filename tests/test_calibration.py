"""Calibration: on a tiny model with planted outlier channels (latent and RoPE key) the learned transforms cut the
attention-output error of C4R4 and C2R4 against RTN, the objectives fall, the function is kept; baselines and
input validation."""

import copy
import os

import pytest
import torch
from helpers import CACHE_KWARG
from transformers import PreTrainedTokenizerFast

from quantmla_hf import QuantMLACache
from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.calibration import calibrate, calibration_token_ids
from quantmla_hf.config import QuantMLAConfig
from quantmla_hf.evaluation.analysis import quantized_attention_error
from quantmla_hf.hadamard import hadamard_matrix
from quantmla_hf.tiny_models import tiny_mla_model

D_C = 64
TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "quantmla_hf", "assets", "reference_model", "tokenizer.json")


pytestmark = pytest.mark.usefixtures("one_thread")


def planted(family="deepseek_v3", seed=0):
    """Tiny model whose latent has 4 outlier channels (norm weight 10 vs ~1) and whose RoPE key has one outlier
    frequency pair (pre-RoPE rows x10), with queries' RoPE rows x3 so positions matter."""
    model = tiny_mla_model(family, seed=seed)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in mla_attention_modules(model):
            w = 0.5 + torch.rand(D_C, generator=g)
            w[torch.randperm(D_C, generator=g)[:4]] = 10.0
            m.kv_a_layernorm.weight.copy_(w)
            m.kv_a_proj_with_mqa.weight[D_C : D_C + 2] *= 10
            q = m.q_proj if getattr(m, "q_proj", None) is not None else m.q_b_proj
            q.weight.view(m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, -1)[:, m.qk_nope_head_dim :] *= 3
    return model


def ids(n, seed, t=32):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def rel(a, b):
    return float((a - b).norm() / b.norm())


def decode_error(model, x, content_bits, prompt=24):
    """Relative logits error of decoding `x[:, prompt:]` token by token with the real QuantMLACache (no protected
    tokens, so every history token is read back from its packed copy) against the full-precision forward."""
    cfg = QuantMLAConfig(content_bits=content_bits, rope_bits=4, sink_tokens=0, recent_tokens=0, transform="none")
    with torch.no_grad():
        ref = model(x).logits[:, prompt:]
        cache = QuantMLACache(config=model.config, quantization_config=cfg)
        model(x[:, :prompt], **{CACHE_KWARG: cache})
        out = torch.cat([model(x[:, t : t + 1], **{CACHE_KWARG: cache}).logits for t in range(prompt, x.shape[1])], 1)
    return rel(out, ref)


def learned_config(content_bits):
    """The learned transforms at `content_bits` (RoPE 4), 40 Adam steps a layer and path: short, for the tiny model."""
    return QuantMLAConfig(transform="learned", content_bits=content_bits, rope_bits=4,
                          advanced={"calibration_steps": 40, "calibration_lr": 1e-2})


@pytest.fixture(scope="module")
def base():
    return planted()


@pytest.mark.parametrize("content_bits,gain", [(4, 0.5), (2, 0.75)])
def test_learned_beats_rtn_and_objectives_fall(base, content_bits, gain):
    model = copy.deepcopy(base)
    test_ids = ids(8, seed=1)
    ref = logits(model, test_ids)
    rtn = quantized_attention_error(model, test_ids, content_bits, 4, 64)
    decode_ids = ids(4, seed=5, t=40)
    rtn_decode = decode_error(model, decode_ids, content_bits)
    cfg = learned_config(content_bits)
    calibrate(model, cfg, ids(16, seed=0), batch_size=4, progress=False)
    learned = quantized_attention_error(model, test_ids, content_bits, 4, 64)
    assert rel(logits(model, test_ids), ref) <= 1e-5  # the fused model computes the same function
    assert sum(learned) < gain * sum(rtn), (learned, rtn)
    # Decoding through the packed cache. One calibration's trajectory is chaotic: on some CPUs one of six
    # calibration sets cuts only a fifth of RTN's decode error at 2 bits, the others about half. So the claim is held
    # over three calibration sets: the middle one cuts RTN's decode error by a quarter, and none is worse than RTN.
    ratios = [decode_error(model, decode_ids, content_bits) / rtn_decode]
    for seed in (1, 2):
        other = copy.deepcopy(base)
        calibrate(other, learned_config(content_bits), ids(16, seed=seed), batch_size=4, progress=False)
        ratios.append(decode_error(other, decode_ids, content_bits) / rtn_decode)
    assert sorted(ratios)[1] < 0.75 and max(ratios) < 1.0, ratios
    assert cfg.calibrated and len(cfg.extra["calibration"]["layers"]) == 2
    layers = cfg.extra["calibration"]["layers"]
    for path in ("content", "rope"):
        # Learning lowered the objective summed over layers and was kept in some layer; one layer's 2 held-out windows
        # can keep its start (a 1e-7 change of the inputs flips that layer's choice: the trajectories are chaotic).
        assert sum(r[path]["train_best"] for r in layers) < sum(r[path]["train_start"] for r in layers), path
        assert any(r[path]["selected"] == "learned" for r in layers), path
        for r in layers:
            assert r[path]["heldout_best"] < r[path]["heldout_rtn"], (path, r[path])


def test_smooth_and_hadamard_baselines(base):
    test_ids = ids(8, seed=1)
    ref = logits(base, test_ids)
    rtn = sum(quantized_attention_error(base, test_ids, 4, 4, 64))
    smooth = copy.deepcopy(base)
    calibrate(smooth, QuantMLAConfig(transform="smooth"), ids(8, seed=0), batch_size=4, progress=False)
    assert rel(logits(smooth, test_ids), ref) <= 1e-5
    assert sum(quantized_attention_error(smooth, test_ids, 4, 4, 64)) < 0.5 * rtn
    had = copy.deepcopy(base)
    cfg = QuantMLAConfig(transform="hadamard")
    calibrate(had, cfg, progress=False)  # no data needed
    assert rel(logits(had, test_ids), ref) <= 1e-5 and cfg.calibrated
    assert sum(quantized_attention_error(had, test_ids, 4, 4, 64, rope_rotation=hadamard_matrix(16))) < rtn
    c0 = mla_attention_modules(base)[0].kv_a_proj_with_mqa.weight[:D_C]
    c1 = mla_attention_modules(had)[0].kv_a_proj_with_mqa.weight[:D_C]
    assert torch.allclose(c1, hadamard_matrix(D_C) @ c0, atol=1e-5)


def test_hadamard_needs_power_of_two_latent():
    model = tiny_mla_model("deepseek_v3", kv_lora_rank=48)
    with pytest.raises(ValueError, match="power-of-two kv_lora_rank"):
        calibrate(model, QuantMLAConfig(transform="hadamard", group_size=16), progress=False)


def test_a_16_bit_rope_path_learns_only_the_content_path():
    x = ids(6, seed=0, t=16)
    model = tiny_mla_model("deepseek_v3")
    ref = logits(model, x)
    cfg = QuantMLAConfig(transform="learned", content_bits=2, rope_bits=16, group_size=16,
                         advanced={"calibration_steps": 2, "calibration_seq_len": 16})
    calibrate(model, cfg, x, batch_size=3, progress=True)
    assert all(set(entry) >= {"content"} and "rope" not in entry for entry in cfg.extra["calibration"]["layers"])
    assert rel(logits(model, x), ref) <= 1e-5


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_attention_weights_are_calibrated_and_written_back(offload, tmp_path):
    """accelerate keeps offloaded weights on `meta` and reloads them from its offload map at every forward: the
    fused values must land in that map, identical to calibrating the resident model."""
    from accelerate import cpu_offload, disk_offload

    from quantmla_hf.calibration.offload import materialized
    from quantmla_hf.evaluation.analysis import analyze

    x = ids(6, seed=0, t=16)
    cfg = dict(transform="learned", content_bits=2, group_size=16,
               advanced={"calibration_steps": 2, "calibration_seq_len": 16})
    resident = tiny_mla_model("deepseek_v3")
    ref = logits(resident, x)
    calibrate(resident, QuantMLAConfig(**cfg), x, batch_size=3, progress=False)
    model = tiny_mla_model("deepseek_v3")
    if offload == "cpu":
        cpu_offload(model, execution_device="cpu")
    else:
        disk_offload(model, str(tmp_path), execution_device="cpu")
    assert mla_attention_modules(model)[0].kv_b_proj.weight.device.type == "meta"
    calibrate(model, QuantMLAConfig(**cfg), x, batch_size=3, progress=False)
    assert rel(logits(model, x), ref) <= 1e-5
    for fused, m in zip(mla_attention_modules(resident), mla_attention_modules(model)):
        with materialized(m):
            assert torch.equal(m.kv_b_proj.weight, fused.kv_b_proj.weight)
            assert torch.equal(m.kv_a_proj_with_mqa.weight, fused.kv_a_proj_with_mqa.weight)
        assert m.kv_b_proj.weight.device.type == "meta"
    assert len(analyze(model, x, progress=False).layers) == 2


def test_none_is_a_no_op():
    model = tiny_mla_model("minicpm3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = QuantMLAConfig(transform="none")
    assert calibrate(model, cfg) is model and cfg.calibrated
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_longcat_is_deterministic_and_keeps_its_function():
    """Two MLA modules per decoder layer; the same seed gives the same fused weights."""
    x = ids(6, seed=0, t=16)
    ref = logits(tiny_mla_model("longcat_flash"), x)
    runs = []
    for _ in range(2):
        model = tiny_mla_model("longcat_flash")
        cfg = QuantMLAConfig(transform="learned", content_bits=2, group_size=16,
                             advanced={"calibration_steps": 4, "calibration_seq_len": 16})
        calibrate(model, cfg, x, batch_size=3, progress=False)
        assert len(cfg.extra["calibration"]["layers"]) == 4
        assert rel(logits(model, x), ref) <= 1e-5
        runs.append(model.state_dict())
    assert all(torch.equal(v, runs[1][k]) for k, v in runs[0].items())


def test_bad_data_and_weights_raise():
    model = tiny_mla_model("deepseek_v2")
    cfg = QuantMLAConfig(transform="learned")
    with pytest.raises(ValueError, match="NaN or inf"):
        calibrate(model, cfg, torch.full((4, 16), float("nan")))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        calibrate(model, cfg, ["some text"])
    with pytest.raises(ValueError, match="needs calibration_data"):
        calibrate(model, cfg)
    with pytest.raises(ValueError, match=r"in \[0, 128\)"):
        calibrate(model, cfg, torch.full((4, 16), 500))
    with torch.no_grad():
        mla_attention_modules(model)[1].kv_b_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="kv_b_proj.weight of attention layer 1 contains NaN or inf"):
        calibrate(model, cfg, ids(4, seed=0))


@pytest.mark.skipif(not os.path.exists(TOKENIZER), reason="reference tokenizer asset not built yet")
def test_text_and_file_become_windows(tmp_path):
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    windows = calibration_token_ids([text, text], tok, samples=5, seq_len=16, seed=0)
    assert windows.shape == (5, 16) and windows.dtype == torch.long
    path = tmp_path / "calib.txt"
    path.write_text(text)
    again = calibration_token_ids(str(path), tok, samples=3, seq_len=16, seed=0)
    assert again.shape == (3, 16)
    with pytest.raises(ValueError, match="fewer than 2 windows"):
        calibration_token_ids(["short"], tok, samples=3, seq_len=512, seed=0)
