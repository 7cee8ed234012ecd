"""Fusion of the content and RoPE transforms: exact function preservation for every family, the cached paths
change as intended, and the fused model is a plain checkpoint of its architecture."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.calibration.capture import LatentHook
from quantmla_hf.calibration.fusion import fuse_content, fuse_rope
from quantmla_hf.calibration.transforms import cayley, rope_layout, rotate_pairs
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_mla_model

D_C, D_R = 64, 16
CASES = [(f, {}) for f in TINY_FAMILIES] + [("deepseek_v3", {"rope_interleave": False})]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family, overrides, seed=0):
    model = tiny_mla_model(family, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in mla_attention_modules(model):
            m.kv_a_layernorm.weight.copy_(torch.randn(D_C, generator=g))  # signs and spread, not the init ones
    return model


def _transforms(n_modules, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [
        (cayley(0.3 * torch.randn(D_C, D_C, generator=g)), 0.3 + torch.rand(D_C, generator=g),
         torch.randn(D_R // 2, generator=g), 0.3 + torch.rand(D_R // 2, generator=g))
        for _ in range(n_modules)
    ]


def _cached_paths(model, ids):
    """Latent `[B, T, d_c]` and post-RoPE key `[B, T, d_R]` each MLA module hands its cache."""
    out, handles = [], []
    for m in mla_attention_modules(model):
        def hook(mod, args, kwargs):
            rec = LatentHook()
            out.append(rec)
            kwargs = dict(kwargs)
            kwargs["cache" if "cache" in kwargs else "past_key_values"] = rec
            return args, kwargs
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    return [(r.latent[:, 0], r.k_rot[:, 0]) for r in out]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family,overrides", CASES, ids=[f + ("-half" if o else "") for f, o in CASES])
def test_fusion_preserves_function_and_moves_the_cached_paths(family, overrides):
    model = _model(family, overrides)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    before = _cached_paths(model, ids)
    modules = mla_attention_modules(model)
    layout = rope_layout(model.config, D_R)
    transforms = _transforms(len(modules))
    weights = [m.kv_a_layernorm.weight.detach().clone() for m in modules]
    for m, (rot, s, theta, s_r) in zip(modules, transforms):
        fuse_content(m, rot, s)
        fuse_rope(m, layout, theta, s_r)
    with torch.no_grad():
        out = model(ids).logits
    assert _rel(out, ref) <= 1e-5
    after = _cached_paths(model, ids)
    for (c0, k0), (c1, k1), m, w, (rot, s, theta, s_r) in zip(before, after, modules, weights, transforms):
        a = getattr(m, "mla_scale_kv_lora", 1.0)  # LongCat scales the normalized latent by a constant
        n = c0 / (a * w)  # the un-weighted RMSNorm output
        assert _rel(c1, a * s * (n @ rot.T)) <= 1e-5
        assert _rel(k1, rotate_pairs(k0, layout.post_a, layout.post_b, theta, s_r)) <= 1e-5
        assert _rel(c1, c0) > 1e-2 and _rel(k1, k0) > 1e-2


def test_wrong_pair_layout_breaks_invariance():
    """The check above can fail: fusing DeepSeek-V3's interleaved RoPE with the rotate_half pairing changes scores."""
    model = _model("deepseek_v3", {})
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    wrong = rope_layout(tiny_mla_model("minicpm3").config, D_R)
    for m, (_, _, theta, s_r) in zip(mla_attention_modules(model), _transforms(2)):
        fuse_rope(m, wrong, theta, s_r)
    with torch.no_grad():
        assert _rel(model(ids).logits, ref) > 1e-3


def test_fused_model_is_a_plain_checkpoint(tmp_path):
    model = _model("deepseek_v2", {})
    shapes = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    modules = mla_attention_modules(model)
    layout = rope_layout(model.config, D_R)
    for m, (rot, s, theta, s_r) in zip(modules, _transforms(len(modules))):
        fuse_content(m, rot, s)
        fuse_rope(m, layout, theta, s_r)
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == shapes
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_fusion_rejects_bad_transforms():
    m = mla_attention_modules(_model("deepseek_v3", {}))[0]
    with pytest.raises(ValueError, match="positive"):
        fuse_content(m, torch.eye(D_C), -torch.ones(D_C))
    with pytest.raises(ValueError, match=r"rotation \[64, 64\]"):
        fuse_content(m, torch.eye(D_C - 1), torch.ones(D_C - 1))
    with pytest.raises(ValueError, match="positive"):
        fuse_rope(m, rope_layout(m.config, D_R), torch.zeros(D_R // 2), torch.zeros(D_R // 2))
