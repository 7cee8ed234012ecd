"""Triton MLA decode kernel vs its PyTorch reference (fp64) on fresh random packed caches.

On CPU the kernel runs in the Triton interpreter, so sizes stay small; the real-size run is
`benchmarks/bench_decode.py --check` on a GPU.
"""

import math

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat, QuantMLALayer
from quantmla_hf.kernels.mla_decode import mla_decode, split_plan
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref
from quantmla_hf.kernels.quant_pack_ref import quantize_ref

from helpers import assert_close

OUT_RATIO = 2e-3
LSE_ABS = 1e-4


def random_case(B, N, H, Tq, dc, dr, cb, rb, S, R, dtype, left_padding, seed, q_scale=1.0):
    """Planes, sink and recent copies filled with fresh random data (unused capacity and padding included)."""
    g = torch.Generator().manual_seed(seed)
    fmt = CacheFormat(PathFormat(dc, cb, 64), PathFormat(dr, rb, 64), S, R)
    cap = N + 7

    def planes(f, d):
        x = torch.randn(B, cap, d, generator=g) * 2 + 0.3
        if f.quantized:
            codes, scale, zero = quantize_ref(x, f)
            return {"codes": codes, "scale": scale, "zero": zero}
        return {"values": x.to(dtype)}

    def dense(n, d):
        return torch.randn(B, n, d, generator=g).to(dtype)

    q_lat = torch.randn(B, H, Tq, dc, generator=g) * q_scale
    q_rot = torch.randn(B, H, Tq, dr, generator=g) * q_scale
    args = (q_lat, q_rot, planes(fmt.content, dc), planes(fmt.rope, dr), fmt, dense(S, dc), dense(S, dr),
            dense(R, dc), dense(R, dr), torch.tensor(left_padding), N, 1 / math.sqrt(dc + dr))
    return args


def check(args, **kw):
    out, lse = mla_decode(*args, **kw)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without visible positions differ"
    finite = torch.isfinite(ref_lse)
    err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert err < LSE_ABS, f"lse max abs error {err:.2e}"
    return out, lse


@pytest.mark.parametrize(
    "cb, rb, dtype",
    [(4, 4, torch.bfloat16), (2, 4, torch.bfloat16), (8, 8, torch.bfloat16), (16, 16, torch.bfloat16),
     (4, 4, torch.float32), (2, 16, torch.float32)],
)
def test_bit_configs_with_unequal_padding(cb, rb, dtype):
    check(random_case(2, 110, 4, 1, 128, 32, cb, rb, 3, 8, dtype, [0, 37], seed=cb * 10 + rb), num_splits=3, block_n=32)


@pytest.mark.parametrize("dr, heads", [(16, 1), (32, 3), (64, 2)])
def test_rope_widths_and_small_head_counts(dr, heads):
    check(random_case(2, 90, heads, 1, 64, dr, 4, 4, 2, 4, torch.bfloat16, [5, 0], seed=dr + heads), block_n=32)


@pytest.mark.parametrize("length", [1, 7, 13, 14, 47])
def test_lengths_around_sink_recent_and_split_edges(length):
    """S=2, R=4, 2 splits of 16-token blocks: the packed range [2, length - 4) empty, one token, across splits."""
    check(random_case(2, length, 2, 1, 64, 16, 4, 4, 2, 4, torch.bfloat16, [0, min(1, length - 1)], seed=length),
          num_splits=2)


@pytest.mark.parametrize("tq", [2, 8])
def test_several_query_tokens_see_a_causal_history(tq):
    check(random_case(2, 70, 3, tq, 64, 16, 4, 4, 3, 8, torch.bfloat16, [9, 0], seed=tq), num_splits=2, block_n=32)


def test_many_heads_take_several_head_blocks_and_odd_group_counts():
    """d_c = 192 is three groups (the value tile padded to 256 columns); 20 heads x 2 queries are 40 rows: blocks of
    32 rows by default, of 16 here as well."""
    check(random_case(1, 80, 20, 2, 192, 64, 4, 4, 4, 16, torch.bfloat16, [3], seed=7), num_splits=2)
    check(random_case(1, 80, 20, 2, 192, 64, 4, 4, 4, 16, torch.bfloat16, [3], seed=8), num_splits=2, block_m=16)


@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (8, 8), (16, 16)])
def test_bf16_queries_take_one_fp16_dot(cb, rb):
    """Model-dtype (bf16) queries, as the attention swap passes them: exact in one fp16 operand, no low part."""
    args = list(random_case(2, 110, 4, 1, 128, 32, cb, rb, 3, 8, torch.bfloat16, [0, 37], seed=cb + 40))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    check(tuple(args), num_splits=3, block_n=32)


def test_huge_bf16_queries_stay_finite_and_exact():
    """|q| ~ 1e6 is past fp16's range (65504): the per-row power of two keeps the operands finite and exact."""
    args = list(random_case(2, 90, 2, 1, 64, 16, 4, 4, 2, 4, torch.bfloat16, [0, 3], seed=21))
    args[0], args[1] = (args[0] * 1e6).bfloat16(), (args[1] * 1e6).bfloat16()
    out, lse = mla_decode(*args, num_splits=2)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert ((lse - ref_lse).abs() / ref_lse.abs()).max() < 1e-5


def test_peaked_attention_keeps_the_lse_exact():
    """Large queries (scores of tens) make one token dominate: the split query keeps the LSE within 1e-4."""
    check(random_case(2, 100, 2, 1, 128, 32, 4, 4, 2, 4, torch.bfloat16, [0, 4], seed=3, q_scale=6.0), num_splits=2, block_n=32)


def test_rows_without_visible_positions_give_zeros_and_minus_inf():
    args = random_case(2, 20, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0, 20], seed=11)
    out, lse = check(args, num_splits=2)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_split_count_does_not_change_the_result():
    args = random_case(1, 200, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0], seed=5)
    one, lse1 = mla_decode(*args, num_splits=1, block_n=64)
    many, lse5 = mla_decode(*args, num_splits=5, block_n=16)
    assert_close("splits", one, many, 1e-6)
    assert (lse1 - lse5).abs().max() < 1e-5


def test_default_split_count_fills_the_gpu():
    assert split_plan(1, 1, 32768, 132, 32)[1] >= 132  # batch 1: at least one program per SM
    assert 64 * split_plan(64, 1, 32768, 132, 32)[1] >= 2 * 132
    assert split_plan(1, 1, 100, 132, 32)[1] == 1  # too short to split
    assert split_plan(32, 1, 32768, 132, 32) == split_plan(32, 1, 131072, 132, 32)[:1] + (33,)  # target, not capacity


def test_split_boundaries_follow_the_length_not_the_capacity():
    """A host length (growing cache) and a device length with planes of 4x the capacity (static cache): different
    grids, the same split boundaries and combine order, so bitwise-identical results (fp32 model: exact path)."""
    args = random_case(2, 300, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0, 9], seed=8)
    a = list(args)
    o_host, lse_host = mla_decode(*args)
    big = lambda d: {k: torch.cat([v, torch.randn_like(v.float()).to(v.dtype).repeat(1, 3, 1)], 1)  # noqa: E731
                     for k, v in d.items()}
    from quantmla_hf.kernels.mla_decode import mla_decode_static

    o_dev, lse_dev = mla_decode_static(a[0], a[1], big(a[2]), big(a[3]), *a[4:10], torch.tensor([300]), 1200, a[11])
    assert torch.equal(o_host, o_dev) and torch.equal(lse_host, lse_dev)
    ref_o, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert_close("o_lat", ref_o, o_host, 2e-3)


def test_reads_a_real_cache_layer():
    """Tokens appended through `QuantMLALayer`: kernel == reference == the layer's own `read_history`."""
    torch.manual_seed(0)
    fmt = CacheFormat(PathFormat(64, 4, 64), PathFormat(16, 4, 64), 2, 4)
    layer = QuantMLALayer(fmt, kernel="torch", block_size=16)
    layer.set_left_padding(torch.tensor([0, 5]))
    for T in (9, 1, 3, 1):
        layer.update(torch.randn(2, 1, T, 64), torch.randn(2, 1, T, 16))
    q_lat, q_rot = torch.randn(2, 4, 1, 64), torch.randn(2, 4, 1, 16)
    args = (q_lat, q_rot, layer.content.planes, layer.rope.planes, fmt, layer.sink_content, layer.sink_rope,
            layer.recent_content, layer.recent_rope, layer.left_padding, layer.length, 0.2)
    out, lse = check(args, num_splits=2)
    c, r = layer.read_history()
    scores = (q_lat @ c[:, None].transpose(-1, -2) + q_rot @ r[:, None].transpose(-1, -2)) * 0.2
    scores[1, ..., :5] = float("-inf")
    assert_close("vs read_history", scores.softmax(-1) @ c[:, None], out, 1e-5)
    assert_close("lse vs read_history", torch.logsumexp(scores, -1)[..., 0], lse[..., 0], 1e-6)


def test_errors_name_the_problem():
    args = list(random_case(1, 10, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0], seed=1))
    args[0] = torch.randn(1, 2, 5, 64)
    args[1] = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="recent window"):
        mla_decode(*args)
    args = list(random_case(1, 10, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0], seed=1))
    args[10] = 100
    with pytest.raises(ValueError, match="capacity"):
        mla_decode(*args)
