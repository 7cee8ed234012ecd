"""The decode operation (`quantmla_hf/ops/backends.py`) against its PyTorch reference (fp64) on fresh random packed
caches, for every backend this machine runs: the reference path itself and the portable Triton kernel (`triton`;
compiled on a CUDA GPU, in the Triton interpreter on the CPU: small sizes), on an sm_90 GPU also the Gluon kernels.
The real-size run is `benchmarks/bench_decode.py --check` on a GPU.
"""

import math

import pytest
import torch
from helpers import KERNEL_DEVICE, assert_close, random_planes, to_device

from quantmla_hf import CacheFormat, PathFormat, QuantMLALayer
from quantmla_hf.kernels.mla_decode_combine import combine
from quantmla_hf.kernels.mla_decode_gluon_common import score_rounding as gluon_score_rounding
from quantmla_hf.kernels.mla_decode_ref import combine_ref, mla_decode_ref
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref
from quantmla_hf.ops.backends import (BACKENDS, gluon_handles, mla_decode_static, score_rounding, select_backend,
                                      split_plan)

OUT_RATIO = 2e-3
LSE_ABS = 1e-4


def _available() -> list[str]:
    """The backends this machine runs: the reference always, the Triton kernel on CUDA or in the interpreter, the Gluon
    kernels on sm_90."""
    found = ["torch"]
    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    for rows in (16, 128):
        b = select_backend(fmt, rows, 1, torch.bfloat16, KERNEL_DEVICE)
        if b not in found:
            found.append(b)
    if found[-1].startswith("gluon"):  # sm_90: every Gluon kernel, whichever the table picks, and the portable one
        found = ["torch", "gluon_regs", "gluon_wide", "gluon_split", "triton"]
    return found


AVAILABLE = _available()
PORTABLE = [b for b in AVAILABLE if b in ("triton", "torch")]
HOPPER = [b for b in AVAILABLE if b.startswith("gluon")] or [
    pytest.param("gluon_regs", marks=pytest.mark.skip(reason="the Gluon kernels need an sm_90 GPU"))]


def random_case(B, N, H, Tq, dc, dr, cb, rb, S, R, dtype, left_padding, seed, q_scale=1.0, spare=7):
    """Positional arguments of `mla_decode_ref` (host length N): planes of capacity N + spare, sink and recent
    copies, all filled with fresh random data (unused capacity and padding included)."""
    g = torch.Generator().manual_seed(seed)
    fmt = CacheFormat(PathFormat(dc, cb, 64), PathFormat(dr, rb, 64), S, R)
    cap = N + spare

    def dense(n, d):
        return torch.randn(B, n, d, generator=g).to(dtype)

    q_lat = torch.randn(B, H, Tq, dc, generator=g) * q_scale
    q_rot = torch.randn(B, H, Tq, dr, generator=g) * q_scale
    content, rope = (random_planes(f, (B, cap), g, dtype) for f in (fmt.content, fmt.rope))
    return (q_lat, q_rot, content, rope, fmt, dense(S, dc), dense(S, dr),
            dense(R, dc), dense(R, dr), torch.tensor(left_padding), N, 1 / math.sqrt(dc + dr))


def run(args, backend, capacity=None, **kw):
    """`mla_decode_static` on the case (device-side length; capacity: the planes' own by default), the kernels on
    `KERNEL_DEVICE`, the reference path on the CPU; results on the CPU."""
    device = "cpu" if backend == "torch" else KERNEL_DEVICE
    a = to_device(list(args), device)
    cap = capacity or next(iter(a[2].values())).shape[1]
    length = torch.tensor([args[10]], dtype=torch.int64, device=device)
    o, lse = mla_decode_static(*a[:10], length, cap, a[11], backend=backend, **kw)
    return o.cpu(), lse.cpu()


def check(args, backend, lse_abs=LSE_ABS, **kw):
    """`backend` against the fp64 reference: the output within OUT_RATIO of the exact one, the LSE within `lse_abs`
    of the one that rounds the score keys as the backend does (`score_rounding`)."""
    out, lse = run(args, backend, **kw)
    ref_out, _ = mla_decode_ref(*args, dtype=torch.float64)
    rounding = score_rounding(backend, args[4])
    _, ref_lse = mla_decode_ref(*args, dtype=torch.float64, score_rounding=rounding)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without visible positions differ"
    finite = torch.isfinite(ref_lse)
    err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    assert err < lse_abs, f"lse max abs error {err:.2e}"
    return out, lse


@pytest.mark.parametrize("backend", PORTABLE)
@pytest.mark.parametrize(
    "cb, rb, dtype",
    [(4, 4, torch.bfloat16), (2, 4, torch.bfloat16), (8, 8, torch.float16), (16, 16, torch.bfloat16),
     (4, 4, torch.float32), (16, 16, torch.float32), (2, 16, torch.bfloat16), (4, 8, torch.bfloat16)],
)
def test_formats_and_dtypes_with_unequal_padding(backend, cb, rb, dtype):
    """Every format (C4R4, C2R4, C8R8, C16R16, mixed: C2R16, C4R8) in bf16/fp16/fp32 models (fp32: the exact fp32 path), odd
    length, unequal left padding, three splits."""
    check(random_case(2, 109, 3, 1, 128, 32, cb, rb, 3, 8, dtype, [0, 37], seed=cb * 10 + rb), backend,
          num_splits=3)


@pytest.mark.parametrize("backend", HOPPER)
@pytest.mark.parametrize("cb, rb, heads, tq", [(4, 4, 16, 1), (2, 4, 16, 1), (8, 8, 16, 1), (4, 4, 64, 2),
                                               (2, 4, 128, 1), (8, 8, 48, 1), (4, 8, 16, 1), (4, 8, 128, 1),
                                               (2, 8, 64, 2)])
def test_hopper_kernels_at_deepseek_widths(backend, cb, rb, heads, tq):
    """The Gluon kernels (sm_90 only) on the formats they take, odd length, unequal padding, several head blocks; the
    LSE against the reference that rounds the score keys as they do (`score_rounding`)."""
    if not gluon_handles(backend, CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64))):
        pytest.skip(f"{backend} does not take C{cb}R{rb}")
    args = list(random_case(2, 333, heads, tq, 512, 64, cb, rb, 4, 16, torch.bfloat16, [0, 37], seed=cb + heads))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    check(tuple(args), backend)


@pytest.mark.parametrize("backend", [b for b in PORTABLE if b == "triton"])
@pytest.mark.parametrize("cb, rb, heads, tq", [(4, 4, 128, 1), (2, 4, 70, 2), (16, 16, 64, 1), (4, 8, 16, 1)])
def test_triton_kernel_at_deepseek_widths(backend, cb, rb, heads, tq):
    """The portable kernel at d_c 512 / d_R 64 with bf16 queries: 128 heads (four 32-row blocks), 70 heads x 2 tokens
    (a partial block), C16R16, and 16 heads (one 16-row block)."""
    args = list(random_case(2, 203, heads, tq, 512, 64, cb, rb, 4, 16, torch.bfloat16, [0, 29], seed=cb + heads))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    check(tuple(args), backend, num_splits=2)


@pytest.mark.parametrize("backend", [b for b in PORTABLE if b == "triton"])
@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (4, 8)])
def test_packed_cache_of_an_fp16_model_with_fp16_queries(backend, cb, rb):
    """fp16 queries and copies: the portable kernel's fp16 operands, queries scaled per row into fp16's range."""
    args = list(random_case(2, 157, 5, 1, 128, 32, cb, rb, 4, 8, torch.float16, [0, 11], seed=cb * 7 + rb))
    args[0], args[1] = args[0].half(), args[1].half()
    check(tuple(args), backend, num_splits=3)


@pytest.mark.parametrize("backend", PORTABLE)
@pytest.mark.parametrize("length", [1, 7, 13, 14, 47, 81])
def test_lengths_around_sink_recent_and_split_edges(backend, length):
    """S=2, R=4, 2 splits of 32-token tiles: the packed range [2, length - 4) empty, one token, across splits, with
    one row padded."""
    check(random_case(2, length, 2, 1, 64, 16, 4, 4, 2, 4, torch.bfloat16, [0, min(1, length - 1)], seed=length),
          backend, num_splits=2)


@pytest.mark.parametrize("backend", PORTABLE)
@pytest.mark.parametrize("bits", [2, 4])
def test_sixteen_element_groups(backend, bits):
    """A RoPE key of 16 elements in one group (the tiny models' width) at 2 and 4 bits: the portable kernel unpacks
    such groups a byte per element (Triton 3.6 compiles the `tl.join` unpacking wrongly for them on an H200)."""
    check(random_case(2, 47, 2, 1, 64, 16, 4, bits, 2, 4, torch.bfloat16, [0, 1], seed=bits), backend, num_splits=2)


@pytest.mark.parametrize("backend", PORTABLE)
def test_several_query_tokens_and_many_rows(backend):
    """3 query tokens see a causal history; 12 heads x 3 = 36 rows take 32-row blocks (two head blocks)."""
    check(random_case(2, 70, 12, 3, 64, 16, 4, 4, 3, 8, torch.bfloat16, [9, 0], seed=5), backend, num_splits=2)


@pytest.mark.parametrize("backend", PORTABLE)
def test_deepseek_widths_eight_groups_and_bf16_queries(backend):
    args = list(random_case(1, 75, 2, 1, 512, 64, 2, 4, 4, 16, torch.bfloat16, [3], seed=9))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    check(tuple(args), backend, num_splits=2)


@pytest.mark.parametrize("backend", PORTABLE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_cache_of_a_sixteen_bit_model(backend, dtype):
    # C16R16 with queries in the model dtype: on a GPU every operand stays in it (`NATIVE`); in the interpreter bf16
    # takes the fp16 operands (its dots multiply bf16 bit patterns)
    args = list(random_case(2, 150, 2, 1, 64, 16, 16, 16, 4, 16, dtype, [0, 5], seed=31))
    args[0], args[1] = args[0].to(dtype), args[1].to(dtype)
    check(tuple(args), backend, num_splits=3)


@pytest.mark.parametrize("cb, rb", [(4, 4), (4, 8), (8, 8)])
def test_reference_scores_with_keys_rounded_as_the_gluon_kernels_do(cb, rb):
    """`mla_decode_ref(score_rounding=...)` scores the packed keys of the flagged paths as `fp16((code - z) * s)`
    (what `score_rounding` says the Gluon kernels do: packed content at every width, RoPE below 8 bits), the copies
    and the values exact: recomputed here from the dequantized planes, for no sink or recent copies (every position
    packed) and left padding."""
    args = random_case(2, 77, 3, 1, 128, 64, cb, rb, 0, 0, torch.float32, [0, 9], seed=cb + rb)
    q_lat, q_rot, content, rope, fmt, *_, left_padding, n, scaling = args
    rounding = gluon_score_rounding(fmt)
    assert rounding == (True, rb < 8)
    assert score_rounding("gluon_regs", fmt) == rounding and score_rounding("triton", fmt) == (False, False)

    def keys(planes, f, rounded):
        x = dequantize_ref(planes["codes"][:, :n], planes["scale"][:, :n], planes["zero"][:, :n], f, torch.float32)
        return (x.half() if rounded else x).double()

    for flags in {(True, True), rounding}:
        k_c, k_r = keys(content, fmt.content, flags[0]), keys(rope, fmt.rope, flags[1])
        scores = (q_lat.double() @ k_c.unsqueeze(1).transpose(-1, -2)
                  + q_rot.double() @ k_r.unsqueeze(1).transpose(-1, -2)) * scaling  # [B, H, 1, n]
        visible = torch.arange(n)[None, :] >= left_padding[:, None]  # [B, n]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o, lse = mla_decode_ref(*args, dtype=torch.float64, score_rounding=flags)
        assert (lse.double() - torch.logsumexp(scores, dim=-1)).abs().max() < 1e-6
        assert (o.double() - probs @ keys(content, fmt.content, False).unsqueeze(1)).abs().max() < 1e-5
    _, exact = mla_decode_ref(*args, dtype=torch.float64)
    _, rounded = mla_decode_ref(*args, dtype=torch.float64, score_rounding=(True, True))
    assert (exact - rounded).abs().max() > 1e-5  # the rounding shows on these planes, above the tolerance above


def test_huge_bf16_queries_stay_finite_and_peaked_attention_keeps_the_lse():
    """|q| ~ 1e6 is past fp16's range: the per-row power of two keeps the operands finite and exact; large scores
    (one token dominating) keep the LSE within 1e-4."""
    args = list(random_case(2, 90, 2, 1, 64, 16, 4, 4, 2, 4, torch.bfloat16, [0, 3], seed=21))
    args[0], args[1] = (args[0] * 1e6).bfloat16(), (args[1] * 1e6).bfloat16()
    out, lse = run(args, "triton" if "triton" in AVAILABLE else "torch", num_splits=2)
    ref_out, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close("o_lat", ref_out, out, OUT_RATIO)
    assert ((lse - ref_lse).abs() / ref_lse.abs()).max() < 1e-5
    check(random_case(2, 100, 2, 1, 128, 32, 4, 4, 2, 4, torch.bfloat16, [0, 4], seed=3, q_scale=6.0),
          "triton" if "triton" in AVAILABLE else "torch", num_splits=2)


@pytest.mark.parametrize("backend", PORTABLE)
def test_rows_without_visible_positions_give_zeros_and_minus_inf(backend):
    out, lse = check(random_case(2, 20, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0, 20], seed=11), backend)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("bits, grids", [(4, [3, 32]), (16, [2, 32])])  # 32- and 64-token tiles
def test_split_boundaries_follow_the_length_not_the_capacity(bits, grids):
    """The same 140 positions in planes of capacity 150 and 4200 (a growing cache vs a static one): different grids,
    the same split boundaries (sized from the device-side length in the kernel) and the same combine order, so the
    outputs are bitwise identical."""
    if "triton" not in AVAILABLE:
        pytest.skip("needs the Triton kernel")
    args = random_case(2, 140, 2, 2, 128, 32, bits, bits, 2, 4, torch.bfloat16, [0, 7], seed=3, spare=4200 - 140)
    small = list(args)
    small[2], small[3] = ({k: v[:, :150].clone() for k, v in p.items()} for p in (args[2], args[3]))
    assert [split_plan("triton", 2, 1, c, args[4], 64)[1] for c in (150, 4200)] == grids  # the launches differ
    o_big, lse_big = run(args, "triton")
    o_small, lse_small = run(small, "triton")
    assert torch.equal(o_big, o_small) and torch.equal(lse_big, lse_small)


def test_preallocated_outputs_are_filled():
    args = random_case(1, 50, 2, 1, 64, 16, 4, 4, 2, 4, torch.bfloat16, [0], seed=17)
    o, lse = torch.full((1, 2, 1, 64), float("nan")), torch.full((1, 2, 1), float("nan"))
    a = list(args)
    out = mla_decode_static(*a[:10], torch.tensor([50]), 57, a[11], out=(o, lse), backend=PORTABLE[0])
    assert out[0].data_ptr() == o.data_ptr() and out[1].data_ptr() == lse.data_ptr()
    assert_close("o_lat", mla_decode_ref(*args, dtype=torch.float64)[0], o, OUT_RATIO)


def test_reads_a_real_cache_layer():
    """Tokens appended through `QuantMLALayer`: kernel == the layer's own `read_history`."""
    torch.manual_seed(0)
    fmt = CacheFormat(PathFormat(64, 4, 64), PathFormat(16, 4, 64), 2, 4)
    layer = QuantMLALayer(fmt, kernel="torch", block_size=16)
    layer.set_left_padding(torch.tensor([0, 5]))
    for T in (9, 1, 3, 1):
        layer.update(torch.randn(2, 1, T, 64), torch.randn(2, 1, T, 16))
    q_lat, q_rot = torch.randn(2, 4, 1, 64), torch.randn(2, 4, 1, 16)
    args = (q_lat, q_rot, layer.content.planes, layer.rope.planes, fmt, layer.sink_content, layer.sink_rope,
            layer.recent_content, layer.recent_rope, layer.left_padding, layer.length, 0.2)
    out, lse = check(args, PORTABLE[0], capacity=layer.content.capacity)
    c, r = layer.read_history()
    scores = (q_lat @ c[:, None].transpose(-1, -2) + q_rot @ r[:, None].transpose(-1, -2)) * 0.2
    scores[1, ..., :5] = float("-inf")
    assert_close("vs read_history", scores.softmax(-1) @ c[:, None], out, 1e-5)


@pytest.mark.parametrize("n_tail", [0, 1, 3])
def test_combine_matches_its_reference_and_ignores_trailing_empty_splits(n_tail):
    """Tail slots (the copies; none for a paged 16-bit cache) merged after the packed splits; empty packed splits add
    nothing whatever their partials hold, so a wider grid gives the same bits; a row with every split empty gives
    zeros and -inf."""
    if "triton" not in AVAILABLE:
        pytest.skip("needs the Triton kernels")
    g = torch.Generator().manual_seed(n_tail)
    o_part, lse_part = torch.randn(2, 3, 5 + n_tail, 64, generator=g), torch.randn(2, 3, 5 + n_tail, generator=g)
    lse_part[0, 0] = float("-inf")
    o, lse = to_device(combine(*to_device((o_part, lse_part)), n_tail), "cpu")
    ro, rl = combine_ref(o_part, lse_part)
    assert_close("o", ro, o, 1e-6)
    assert torch.isinf(lse[0, 0]) and not o[0, 0].any()
    wide_o = torch.cat([o_part[:, :, :5], torch.full((2, 3, 11, 64), float("nan")), o_part[:, :, 5:]], 2)
    wide_l = torch.cat([lse_part[:, :, :5], torch.full((2, 3, 11), float("-inf")), lse_part[:, :, 5:]], 2)
    o2, lse2 = to_device(combine(*to_device((wide_o, wide_l)), n_tail), "cpu")
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    # an empty split between non-empty ones (left padding) adds nothing, whatever its partial holds
    hole_o, hole_l = o_part.clone(), lse_part.clone()
    hole_o[:, :, 2], hole_l[:, :, 2] = float("nan"), float("-inf")
    o3, _ = to_device(combine(*to_device((hole_o, hole_l)), n_tail), "cpu")
    assert_close("o, a split empty", combine_ref(hole_o.nan_to_num(0.0), hole_l)[0], o3, 1e-6)


def test_combine_of_scaled_fp16_partials():
    """fp16 partials hold `o_s * FP16_PARTIAL_SCALE` (the split kernel's over quantized content): the merge and its
    reference unscale them, to fp16's precision over the whole range a quantized content path holds (up to an 8-bit
    code times the largest fp16 step); fp32 and fp16 are the partials' only dtypes."""
    if "triton" not in AVAILABLE:
        pytest.skip("needs the Triton kernels")
    from quantmla_hf.kernels.mla_decode_ref import FP16_PARTIAL_SCALE, partial_scale

    g = torch.Generator().manual_seed(7)
    o_exact = torch.randn(2, 3, 6, 64, generator=g) * torch.logspace(-3, 0, 64)
    o_exact[1, 2, :, 0] = 255 * 65504.0  # the largest value a quantized path holds
    lse_part = torch.randn(2, 3, 6, generator=g)
    o_half = (o_exact * FP16_PARTIAL_SCALE).half()
    assert torch.isfinite(o_half).all()
    o, lse = to_device(combine(*to_device((o_half, lse_part)), 2), "cpu")
    ro, rl = combine_ref(o_exact, lse_part)
    assert (lse - rl).abs().max() < 1e-5
    w = torch.exp(lse_part - rl.unsqueeze(-1)).unsqueeze(-1)  # each element within fp16's rounding of its partials
    bound = (w * o_exact.abs()).sum(-2) * (2**-11 + 1e-6) + 2**-17
    assert ((o - ro).abs() <= bound).all()
    assert_close("o vs the reference of the same partials", combine_ref(o_half, lse_part)[0], o, 1e-6)
    assert partial_scale(torch.float32) == 1.0 and partial_scale(torch.float16) == FP16_PARTIAL_SCALE
    with pytest.raises(ValueError, match="fp32 or fp16"):
        partial_scale(torch.bfloat16)


def test_merge_is_a_dependent_launch_on_hopper_only(monkeypatch):
    """The merge waits on the decode grid through a programmatic dependent launch on compute capability 9.0 and
    newer; never on the CPU, an older GPU or in the interpreter (which has no `griddepcontrol`)."""
    from quantmla_hf.kernels import mla_decode_combine as mcomb

    monkeypatch.setattr(mcomb, "_sm90_or_newer", lambda index: index == 0)  # device 0 a Hopper, device 1 an Ampere
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert mcomb.dependent_launch(torch.device("cuda", 0)) and not mcomb.dependent_launch(torch.device("cuda", 1))
    assert not mcomb.dependent_launch(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not mcomb.dependent_launch(torch.device("cuda", 0))


def test_bad_inputs_get_clear_errors():
    args = list(random_case(1, 30, 2, 1, 64, 16, 4, 4, 2, 4, torch.float32, [0], seed=2))
    with pytest.raises(ValueError, match="one-element tensor"):
        mla_decode_static(*args[:10], torch.tensor([30, 30]), 37, args[11])
    with pytest.raises(ValueError, match="capacity"):
        mla_decode_static(*args[:10], torch.tensor([30]), 38, args[11])
    with pytest.raises(ValueError, match="backend must be one of"):
        mla_decode_static(*args[:10], torch.tensor([30]), 37, args[11], backend="strided")
    with pytest.raises(ValueError, match="does not take"):
        mla_decode_static(*args[:10], torch.tensor([30]), 37, args[11], backend="gluon_regs")
    q = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="recent window"):
        mla_decode_static(*q, *args[2:10], torch.tensor([30]), 37, args[11])
    odd = list(random_case(1, 30, 2, 1, 96, 16, 16, 16, 2, 4, torch.float32, [0], seed=2))  # 96: not a power of 2
    with pytest.raises(ValueError, match="use backend='torch'"):
        mla_decode_static(*odd[:10], torch.tensor([30]), 37, odd[11], backend="triton")
    assert set(AVAILABLE) <= set(BACKENDS)
