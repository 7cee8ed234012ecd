"""Dual-path matched-error analysis: responses, aggregate ratio, table and PNG; sensitivity to planted structure."""

import struct

import pytest
import torch

from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.evaluation.analysis import DualPathReport, LayerResponse, _png_bars, analyze, quantized_attention_error
from quantmla_hf.tiny_models import tiny_mla_model

pytestmark = pytest.mark.usefixtures("one_thread")


def ids(n=6, t=32, seed=0):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_analyze_reports_per_layer_and_aggregate_ratio(tmp_path):
    model = tiny_mla_model("deepseek_v3")
    report = analyze(model, ids(), group_size=16, progress=False)
    assert [r.layer_idx for r in report.layers] == [0, 1]
    assert all(r.content_response > 0 and r.rope_response > 0 for r in report.layers)
    mean_c = sum(r.content_response for r in report.layers) / 2
    mean_r = sum(r.rope_response for r in report.layers) / 2
    assert report.ratio == pytest.approx(mean_r / mean_c)
    table = report.to_markdown()
    assert table.count("\n| ") == 5 and "**model** (aggregate)" in table
    assert _png_size(report.save_plot(str(tmp_path / "dual.png")))[0] > 0
    assert report.to_dict()["layers"][1]["ratio"] == pytest.approx(report.layers[1].ratio)


def test_rope_response_follows_query_rope_magnitude():
    """Tripling every query's RoPE rows triples positional-score errors: the RoPE response grows (~9x), the content
    response of the same keys much less, so the model-level ratio rises."""
    x = ids()
    base = analyze(tiny_mla_model("deepseek_v2"), x, group_size=16, progress=False)
    model = tiny_mla_model("deepseek_v2")
    with torch.no_grad():
        for m in mla_attention_modules(model):
            m.q_proj.weight.view(m.num_heads, -1, m.q_proj.weight.shape[1])[:, m.qk_nope_head_dim :] *= 3
    boosted = analyze(model, x, group_size=16, progress=False)
    assert boosted.rope_mean > 5 * base.rope_mean
    assert boosted.ratio > 3 * base.ratio


def test_aggregate_ratio_is_not_the_mean_of_ratios():
    report = DualPathReport(layers=[LayerResponse(0, 1.0, 1.0), LayerResponse(1, 0.01, 1.0)])
    assert report.ratio == pytest.approx(2.0 / 1.01)
    assert report.ratio != pytest.approx((1.0 + 100.0) / 2)


def test_png_fallback_without_matplotlib(tmp_path):
    path = str(tmp_path / "bars.png")
    _png_bars(path, [1.0, 0.5, 0.2], [2.0, 1.0, 0.1])
    assert _png_size(path) == (64, 200)


def test_quantized_attention_error_is_zero_at_16_bits():
    model, x = tiny_mla_model("glm4_moe_lite"), ids(4)
    assert quantized_attention_error(model, x, 16, 16, 16) == [0.0, 0.0]
    four = quantized_attention_error(model, x, 4, 4, 16)
    two = quantized_attention_error(model, x, 2, 4, 16)
    assert all(0 < a < b for a, b in zip(four, two))
