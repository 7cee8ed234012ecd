"""Quantize/pack: exact round trips, the scale/2 error bound, and the Triton kernel against the reference."""

import pytest
import torch
from helpers import to_device

from quantmla_hf.format import PathFormat
from quantmla_hf.kernels.mla_decode_triton import mla_decode_triton_kernel
from quantmla_hf.kernels.quant_pack import quant_pack_fwd_kernel, quantize_pack, quantize_pack_slots
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref, pack_codes, quantize_ref, unpack_codes


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [32, 64, 512])
def test_pack_unpack_round_trip_is_exact(bits, dim):
    q = torch.randint(0, 1 << bits, (5, 3, dim), dtype=torch.uint8)
    packed = pack_codes(q, bits)
    assert packed.shape == (5, 3, dim * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), q)


def test_pack_layout_is_little_end_first():
    q = torch.tensor([[1, 2, 3, 0, 2, 1, 0, 3]], dtype=torch.uint8)
    assert pack_codes(q, 4).tolist() == [[0x21, 0x03, 0x12, 0x30]]
    assert pack_codes(q, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 2 | 1 << 2 | 0 << 4 | 3 << 6]]


def _inputs(shape, kind):
    x = torch.randn(shape)
    if kind == "outliers":
        x[..., 3] *= 40.0
    elif kind == "offset":
        x = x * 0.01 + 7.5  # every group far from zero: its zero point does not fit the code range
    elif kind == "constant":
        x = torch.full(shape, -2.25)
    elif kind == "zeros":
        x = torch.zeros(shape)
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", ["normal", "outliers", "offset", "constant", "zeros"])
@pytest.mark.parametrize("dim", [32, 64, 320])
def test_reconstruction_error_within_half_a_step(bits, kind, dim):
    fmt = PathFormat(dim, bits, 64)
    x = _inputs((4, 9, dim), kind)
    codes, scale, zero = quantize_ref(x, fmt)
    assert codes.shape == (4, 9, fmt.code_bytes)
    assert scale.shape == zero.shape == (4, 9, fmt.n_groups)
    assert (scale > 0).all()
    err = (dequantize_ref(codes, scale, zero, fmt, torch.float32) - x).abs()
    err = err.reshape(4, 9, fmt.n_groups, fmt.group).amax(-1)
    # fp32 rounding of x / s and of (q - z) * s adds a few ulps of the values themselves.
    slack = 1e-6 * x.abs().reshape(4, 9, fmt.n_groups, fmt.group).amax(-1)
    assert (err <= scale.float() / 2 + slack).all()


def test_quantize_rejects_nan():
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_ref(x, PathFormat(64, 4, 64))


def test_format_rejects_indivisible_width():
    with pytest.raises(ValueError, match="not divisible by group_size=64"):
        PathFormat(96, 4, 64)


@pytest.mark.parametrize("bits,dim", [(4, 512), (2, 512), (8, 64), (4, 64), (4, 32), (2, 320)])
@pytest.mark.parametrize("T,start", [(1, 0), (7, 3), (16, 1)])
def test_triton_kernel_matches_reference_and_writes_only_its_rows(bits, dim, T, start):
    fmt = PathFormat(dim, bits, 64)
    B, cap = 3, start + T + 2
    x = _inputs((B, T, dim), "outliers") * (1 + torch.arange(B)[:, None, None])
    x[1, 0] = 0.01 * torch.randn(dim) + 11.0  # a token whose groups need the widened range
    codes = torch.full((B, cap, fmt.code_bytes), 0xAB, dtype=torch.uint8)
    scale = torch.full((B, cap, fmt.n_groups), float("nan"), dtype=torch.float16)
    zero = torch.full((B, cap, fmt.n_groups), -77, dtype=torch.int8)
    planes = to_device((codes, scale, zero))
    quantize_pack(to_device(x), *planes, start, fmt)
    codes, scale, zero = to_device(planes, "cpu")
    ref_codes, ref_scale, ref_zero = quantize_ref(x, fmt)
    rows = slice(start, start + T)
    assert torch.equal(codes[:, rows], ref_codes)
    assert torch.equal(scale[:, rows], ref_scale)
    assert torch.equal(zero[:, rows], ref_zero)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[rows] = False
    assert (codes[:, untouched] == 0xAB).all()
    assert torch.isnan(scale[:, untouched]).all()
    assert (zero[:, untouched] == -77).all()


@pytest.mark.parametrize("bits,dim", [(4, 512), (2, 512), (4, 64), (8, 64)])
def test_triton_kernel_writes_tokens_at_their_slots(bits, dim):
    """The paged cache's write: token i at row slots[i] of flat page planes, the other rows untouched."""
    fmt = PathFormat(dim, bits, 64)
    rows, N = 37, 9
    x = _inputs((N, dim + 64), "outliers")[:, :dim]  # strided rows, as a slice of a projection's output
    slots = torch.randperm(rows)[:N]
    codes = torch.full((rows, fmt.code_bytes), 0xAB, dtype=torch.uint8)
    scale = torch.full((rows, fmt.n_groups), float("nan"), dtype=torch.float16)
    zero = torch.full((rows, fmt.n_groups), -77, dtype=torch.int8)
    planes = to_device((codes, scale, zero))
    quantize_pack_slots(to_device(x), *planes, to_device(slots), fmt)
    codes, scale, zero = to_device(planes, "cpu")
    ref_codes, ref_scale, ref_zero = quantize_ref(x, fmt)
    assert torch.equal(codes[slots], ref_codes) and torch.equal(scale[slots], ref_scale)
    assert torch.equal(zero[slots], ref_zero)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots] = False
    assert (codes[untouched] == 0xAB).all() and torch.isnan(scale[untouched]).all() and (zero[untouched] == -77).all()
    with pytest.raises(ValueError, match="slots int64"):
        quantize_pack_slots(x, codes, scale, zero, slots.int(), fmt)


def test_triton_kernel_reports_overflow():
    fmt = PathFormat(64, 4, 64)
    codes = torch.empty((1, 4, 32), dtype=torch.uint8)
    scale = torch.empty((1, 4, 1), dtype=torch.float16)
    zero = torch.empty((1, 4, 1), dtype=torch.int8)
    with pytest.raises(ValueError, match="overflows the cache capacity 4"):
        quantize_pack(torch.randn(1, 3, 64), codes, scale, zero, 2, fmt)
    for start in (torch.tensor([2], dtype=torch.int32), torch.tensor([1, 2])):  # a device start: int64, one element
        with pytest.raises(ValueError, match="int64 tensor of one element"):
            quantize_pack(torch.randn(1, 3, 64), codes, scale, zero, start, fmt)


def test_per_step_arguments_are_not_specialised():
    """Arguments that change every decode step must not be specialised on (% 16, == 1): a specialisation would
    recompile the kernel mid-generation whenever the position crosses a multiple of 16."""
    def unspecialised(kernel):
        # A JITFunction keeps the list; under TRITON_INTERPRET the decorator's keyword arguments are kept instead.
        names = getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize", ())
        return {kernel.arg_names[i] if isinstance(i, int) else i for i in names}

    assert {"T", "start"} <= unspecialised(quant_pack_fwd_kernel)
    assert {"M", "Tq", "split_target", "num_splits"} <= unspecialised(mla_decode_triton_kernel)
