"""Fast packed MLA decode kernel (`kernels/mla_decode_fast.py`) vs the PyTorch reference (fp64), fresh random data.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py), so sizes stay small; the real-size run is
`benchmarks/bench_decode.py --check` on a GPU (docs/BENCHMARKS.md). Every case passes the length as a one-element
device tensor and planes with spare capacity beyond it, as the static (graph-capturable) interface does.
"""

import math

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels.mla_decode_fast import fast_handles, fast_supported, mla_decode_static, split_plan
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref
from quantmla_hf.kernels.quant_pack_ref import quantize_ref

from helpers import assert_close

OUT_RATIO = 2e-3
LSE_ABS = 1e-4


def make_case(B, N, H, Tq, dc, dr, cb, rb, S, R, left_padding, seed, spare=45, q_dtype=torch.float32, q_scale=1.0,
              copy_dtype=torch.bfloat16):
    """Positional arguments of `mla_decode_ref` plus the planes' capacity (N + spare, the spare part random too)."""
    g = torch.Generator().manual_seed(seed)
    fmt = CacheFormat(PathFormat(dc, cb, 64), PathFormat(dr, rb, 64), S, R)
    cap = N + spare

    def planes(f, d):
        codes, scale, zero = quantize_ref(torch.randn(B, cap, d, generator=g) * 2 + 0.3, f)
        return {"codes": codes, "scale": scale, "zero": zero}

    def dense(n, d):
        return torch.randn(B, n, d, generator=g).to(copy_dtype)

    q_lat = (torch.randn(B, H, Tq, dc, generator=g) * q_scale).to(q_dtype)
    q_rot = (torch.randn(B, H, Tq, dr, generator=g) * q_scale).to(q_dtype)
    args = (q_lat, q_rot, planes(fmt.content, dc), planes(fmt.rope, dr), fmt, dense(S, dc), dense(S, dr),
            dense(R, dc), dense(R, dr), torch.tensor(left_padding), N, 1 / math.sqrt(dc + dr))
    return args, cap


def run_fast(args, cap, **launch):
    a = list(args)
    length = torch.tensor([a[10]], dtype=torch.int64)
    return mla_decode_static(*a[:10], length, cap, a[11], **launch)


def check(case, **launch):
    args, cap = case
    out, lse = run_fast(args, cap, **launch)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without visible positions differ"
    finite = torch.isfinite(ref_lse)
    err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert err < LSE_ABS, f"lse max abs error {err:.2e}"
    return out, lse


@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (8, 8)])
def test_bit_configs_with_unequal_padding(cb, rb):
    """Batch 2 with different left padding, an odd length, 3 splits of 16-token tiles plus the sink/recent split."""
    check(make_case(2, 101, 2, 1, 128, 32, cb, rb, 3, 8, [0, 37], seed=cb * 10 + rb), num_splits=3, block_t=16)


def test_deepseek_widths_eight_groups():
    """d_c 512 (eight content groups, every unrolled group of the kernel used), d_R 64, 16 heads, bf16 queries."""
    check(make_case(1, 60, 16, 1, 512, 64, 4, 4, 4, 16, [9], seed=5, q_dtype=torch.bfloat16), num_splits=2)


@pytest.mark.parametrize("length", [1, 7, 14, 47])
def test_lengths_around_sink_recent_and_split_edges(length):
    """S=2, R=4: the packed range [2, length - 4) empty, one token, across two splits; the second row starts later."""
    check(make_case(2, length, 2, 1, 64, 16, 4, 4, 2, 4, [0, min(1, length - 1)], seed=length), num_splits=2,
          block_t=16)


def test_several_query_tokens_see_a_causal_history():
    """5 query tokens x 3 heads = 15 rows (rows are (head, token) pairs); each token sees a different prefix."""
    check(make_case(2, 50, 3, 5, 128, 32, 4, 4, 3, 8, [9, 0], seed=5, q_dtype=torch.bfloat16), num_splits=2,
          block_t=16)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_query_dtypes(q_dtype):
    """fp32 queries take the high/low fp16 split (two dots), bf16/fp16 queries one dot (fp16: next test)."""
    check(make_case(2, 90, 2, 1, 128, 32, 2, 4, 2, 4, [0, 3], seed=31, q_dtype=q_dtype), num_splits=2)


def test_fp16_model_copies():
    check(make_case(2, 77, 2, 1, 128, 32, 4, 4, 2, 8, [4, 0], seed=41, copy_dtype=torch.float16,
                    q_dtype=torch.float16), num_splits=2)


def test_peaked_attention_keeps_the_lse_exact():
    """Large queries (scores of tens) make a few tokens dominate; keys are exact integers, scales after the dot."""
    check(make_case(2, 100, 2, 1, 128, 32, 8, 8, 2, 4, [0, 4], seed=3, q_scale=6.0), num_splits=2)


def test_huge_bf16_queries_stay_finite():
    """|q| ~ 1e6 is past fp16's range: the per-row power of two keeps the operands finite and exact."""
    args, cap = make_case(2, 90, 2, 1, 128, 16 * 2, 4, 4, 2, 4, [0, 3], seed=21, q_dtype=torch.bfloat16,
                          q_scale=1e6)
    out, lse = run_fast(args, cap, num_splits=2)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert ((lse - ref_lse).abs() / ref_lse.abs()).max() < 1e-5


def test_many_rows_take_several_head_blocks():
    """20 heads x 2 queries = 40 rows: 32-row blocks by default (two), 16-row blocks (three) as well."""
    case = make_case(1, 45, 20, 2, 128, 32, 4, 4, 4, 16, [3], seed=7)
    check(case, num_splits=2)
    check(case, num_splits=2, block_m=16, num_warps=4)


def test_splits_past_the_length_stay_empty():
    """Capacity 4x the length: the splits are cut for the capacity, most lie past `length` and must add nothing."""
    check(make_case(2, 60, 2, 1, 128, 32, 4, 4, 2, 4, [0, 5], seed=13, spare=180), num_splits=6, block_t=16)


def test_rows_without_visible_positions_give_zeros_and_minus_inf():
    out, lse = check(make_case(2, 20, 2, 1, 64, 16, 4, 4, 2, 4, [0, 20], seed=11), num_splits=2, block_t=16)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_preallocated_outputs_are_filled():
    args, cap = make_case(1, 50, 2, 1, 64, 16, 4, 4, 2, 4, [0], seed=17)
    o = torch.full((1, 2, 1, 64), float("nan"))
    lse = torch.full((1, 2, 1), float("nan"))
    out = run_fast(args, cap, out=(o, lse), num_splits=2)
    assert out[0] is o and out[1] is lse
    ref_out, _ = mla_decode_ref(*args, dtype=torch.float64)
    assert_close("o_lat", ref_out, o, OUT_RATIO)


def test_fast_supported_says_which_formats_it_takes():
    fmt = lambda cb, rb, dc=512, dr=64, group=64: CacheFormat(PathFormat(dc, cb, group), PathFormat(dr, rb, group))  # noqa: E731
    # (the interpreter runs the kernel on CPU; on a machine without it, CPU is refused)
    assert fast_supported(fmt(4, 4), torch.bfloat16, "cpu", torch.bfloat16)
    assert fast_supported(fmt(2, 4), torch.float32, "cpu")
    assert fast_handles(fmt(8, 8), torch.float16, "cpu")  # computed correctly (tested above) ...
    # ... but the Triton kernel was measured slower than the fallback at 8 bits; only the Gluon kernel (sm_90, never
    # on CPU) takes 8-bit content
    assert not fast_supported(fmt(8, 8), torch.float16, "cpu")
    assert not fast_supported(fmt(16, 16), torch.bfloat16, "cpu")  # unquantized paths: fallback kernel
    assert not fast_supported(fmt(4, 16), torch.bfloat16, "cpu")
    assert not fast_supported(fmt(4, 4), torch.bfloat16, "cpu", torch.float32)  # fp32 models: exact fallback
    assert not fast_supported(fmt(4, 4, dc=192), torch.bfloat16, "cpu")  # three groups
    assert not fast_supported(fmt(4, 4, dc=1024), torch.bfloat16, "cpu")  # sixteen groups
    assert not fast_supported(fmt(4, 4, dr=128), torch.bfloat16, "cpu")  # two RoPE groups
    assert not fast_supported(fmt(4, 4), torch.int8, "cpu")
    assert not fast_handles(fmt(16, 16), torch.bfloat16, "cpu") and not fast_handles(fmt(4, 4, dr=128), torch.bfloat16, "cpu")


def test_bad_inputs_get_clear_errors():
    args, cap = make_case(1, 30, 2, 1, 64, 16, 4, 4, 2, 4, [0], seed=2)
    a = list(args)
    with pytest.raises(ValueError, match="one-element tensor"):
        mla_decode_static(*a[:10], torch.tensor([30, 30]), cap, a[11])
    with pytest.raises(ValueError, match="capacity"):
        mla_decode_static(*a[:10], torch.tensor([30]), cap + 1, a[11])
    fmt16 = CacheFormat(PathFormat(64, 16, 64), PathFormat(16, 16, 64), 2, 4)
    with pytest.raises(ValueError, match="fast_supported"):
        mla_decode_static(*a[:4], fmt16, *a[5:10], torch.tensor([30]), cap, a[11])


def _shrunk(planes, cap):
    return {k: v[:, :cap].clone() for k, v in planes.items()}


def test_split_boundaries_follow_the_length_not_the_capacity():
    """The same 140 positions in planes of capacity 150 and 4200 (a growing cache vs a static one): different grids
    (3 and 32 splits), the same split boundaries (sized from the device-side length in the kernel: 64, 64, 6
    packed positions) and the same combine order, so the outputs are bitwise identical; both match the reference.
    (Boundaries cut for the capacity gave 96 + 38 vs one split of 160 here, and results differing in the last
    bits.)"""
    length = 140
    args, _ = make_case(2, length, 2, 2, 128, 32, 4, 4, 2, 4, [0, 7], seed=3, spare=4200 - length,
                        q_dtype=torch.bfloat16)
    fmt = args[4]
    small = list(args)
    small[2], small[3] = _shrunk(args[2], 150), _shrunk(args[3], 150)
    grids = [split_plan(2, 1, c, fmt.sink_tokens, fmt, 8, 32, 8)[1] for c in (150, 4200)]
    assert grids == [3, 32], grids  # the launches really differ
    o_big, lse_big = run_fast(args, 4200)
    o_small, lse_small = run_fast(small, 150)
    assert torch.equal(o_big, o_small) and torch.equal(lse_big, lse_small)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert_close("o_lat", ref_out, o_big, OUT_RATIO)
    assert (lse_big - ref_lse).abs().max() < LSE_ABS


def test_split_plan_keeps_the_measured_split_counts():
    """Splits holding positions (H200, 132 SMs, default launches): B32 32K as before the length-sized splits
    (33 of 992 tokens); B1 4K 62 splits of 64 tokens (before: 42 of 96), on a grid bounded by the capacity."""
    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    S, R = fmt.sink_tokens, fmt.recent_tokens

    def active(B, length, capacity):
        target, grid = split_plan(B, 1, capacity, S, fmt, 132, 32, 8)
        n = length - S - R
        tps = max(64, -(-(-(-n // target)) // 32) * 32)
        assert -(-n // tps) <= grid
        return -(-n // tps), tps, grid

    assert active(32, 32768, 32768) == (33, 992, 33)
    assert active(1, 4096, 4096) == (62, 64, 62)
    assert active(1, 4096, 32768)[:2] == (62, 64)  # a larger static cache: same splits, larger grid


def test_fill_splits_fill_the_resident_slots_once():
    """The register kernels' default split count (H200: 132 SMs; the one-warpgroup kernel keeps 2 programs per SM,
    the two-warpgroup one fills its 1 twice): B * head_blocks * splits at most the slots, and the largest such."""
    from quantmla_hf.kernels.mla_decode_fast import fill_splits

    assert [fill_splits(B, 1, 132, 2) for B in (1, 8, 16, 32, 64, 264, 1000)] == [264, 33, 16, 8, 4, 1, 1]
    assert fill_splits(32, 4, 132, 2) == 2  # 128 heads in 32-row blocks (the two-warpgroup kernel)
    for B, hb, sms, per in ((32, 1, 132, 2), (7, 3, 114, 2), (5, 8, 78, 1)):
        n = fill_splits(B, hb, sms, per)
        assert B * hb * n <= per * sms < B * hb * (n + 1)


def test_flat_grid_numbers_every_program_once_packed_splits_first():
    """The Gluon kernels' one-dimensional grid (`flat_grid`, numbered by `program_coords` as the kernels'
    `_program_coords`): every (split, head block, batch row) exactly once, and every packed split before any copy
    program, so the long programs all start in the first wave."""
    from quantmla_hf.kernels.mla_decode_gluon_scaled import copy_programs, flat_grid, program_coords

    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    nd = copy_programs(fmt)
    for NS, M, block_m, B in ((8, 16, 16, 32), (2, 128, 32, 3), (1, 33, 16, 2), (5, 4, 16, 1)):
        n_hb = -(-M // block_m)
        (n,) = flat_grid(NS, fmt, M, block_m, B)
        assert n == B * n_hb * (NS + nd)
        coords = [program_coords(pid, NS, nd, n_hb, n) for pid in range(n)]
        assert sorted(coords) == sorted((s, h, b) for s in range(NS + nd) for h in range(n_hb) for b in range(B))
        splits = [s for s, _, _ in coords]
        assert all(s < NS for s in splits[:B * n_hb * NS]) and all(s >= NS for s in splits[B * n_hb * NS:])
        assert coords[:NS] == [(s, 0, 0) for s in range(NS)]  # split fastest


def test_register_kernels_default_to_fill_splits(monkeypatch):
    """Without `waves` or `num_splits` the register kernels' launch takes `fill_splits` (132 SMs: 8 splits at 16
    heads B32 at 2 programs per SM, 1 at 128 heads in 32-row blocks at 1 per SM); an explicit `waves` keeps
    `split_plan`'s count, `num_splits` wins."""
    from quantmla_hf.kernels import mla_decode_fast as mf

    monkeypatch.setattr(mf, "_num_sms", lambda index: 132)
    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    lp = torch.zeros(32, dtype=torch.int64)

    def splits(H, block_m, fill, waves=None, num_splits=None):
        q, qr = torch.zeros(32, H, 1, 512), torch.zeros(32, H, 1, 64)
        return mf._register_kernel_inputs(q, qr, fmt, lp, 32768, block_m, waves, num_splits, fill)[6]

    assert splits(16, 16, 2) == 8
    assert splits(128, 32, 2) == 2
    assert splits(128, 32, 1) == 1  # the two-warpgroup kernel's one round
    assert splits(16, 16, 2, waves=8) == 33  # about 8 programs per SM, as before
    assert splits(16, 16, 2, num_splits=5) == 5


@pytest.mark.parametrize("n_tail", [1, 3])
def test_combine_tail_slots_and_trailing_empty_splits(n_tail):
    """The combine merges packed splits in fixed chunks and then the `n_tail` copy slots at the end (3 for the
    scaled Gluon kernel, whose sink and recent copies take one program per tile): the log-sum-exp merge of the
    reference, and bitwise the same with 70 more empty packed splits (a larger static grid)."""
    from quantmla_hf.kernels.mla_decode_fast import _combine

    g = torch.Generator().manual_seed(n_tail)
    B, H, Tq, D, live = 2, 3, 1, 40, 5
    o_live = torch.randn(B, H * Tq, live + n_tail, D, generator=g)
    lse_live = torch.randn(B, H * Tq, live + n_tail, generator=g) * 3
    lse_live[0, 1, 2] = float("-inf")  # an empty split inside the live ones
    lse_live[1, 0, -1] = float("-inf")  # an empty copy slot

    def with_empty(extra):
        o = torch.cat([o_live[:, :, :live], torch.full((B, H * Tq, extra, D), float("nan")), o_live[:, :, live:]], 2)
        lse = torch.cat([lse_live[:, :, :live], torch.full((B, H * Tq, extra), float("-inf")),
                         lse_live[:, :, live:]], 2)
        return o.contiguous(), lse.contiguous()

    outs = [_combine(*with_empty(extra), B, H, Tq, D, live + extra + n_tail, None, n_tail) for extra in (0, 70)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    w = torch.softmax(lse_live.double(), dim=-1)
    ref_o = (torch.nan_to_num(o_live.double()) * w[..., None]).sum(2)
    ref_lse = torch.logsumexp(lse_live.double(), dim=-1)
    assert (outs[0][0].reshape(B, H * Tq, D).double() - ref_o).abs().max() < 1e-5
    assert (outs[0][1].reshape(B, H * Tq).double() - ref_lse).abs().max() < 1e-5
