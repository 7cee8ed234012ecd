"""Triton kernel: quantize new tokens of one cached path and pack them straight into the cache planes.

Same arithmetic as `quant_pack_ref.quantize_ref` (see its docstring); byte layout in `quantmla_hf/format.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantmla_hf.format import PathFormat

from .quant_pack_ref import SCALE_MIN


@triton.jit
def _fp16_round_up(s):
    s16 = s.to(tl.float16)
    bumped = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    return tl.where(s16.to(tl.float32) < s, bumped, s16)


@triton.jit
def _scale_and_zero(lo, hi, QMAX: tl.constexpr, S_MIN: tl.constexpr):
    s = _fp16_round_up(tl.maximum(tl.div_rn(hi - lo, tl.full(lo.shape, QMAX, tl.float32)), S_MIN))
    z = tl.floor(tl.div_rn(-lo, s.to(tl.float32)) + 0.5)
    return s, z


@triton.jit
def _quantize_pack_groups(p_elem, m_x, BLOCK_G: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
                          S_MIN: tl.constexpr):
    """The groups of one row, quantized and packed: `p_elem` `[BLOCK_G, NB]` points at the first element of every
    code byte (`PACK = 8 // BITS` consecutive elements each), `m_x` masks it. Returns the code bytes `[BLOCK_G, NB]`
    uint8, the fp16 scales `[BLOCK_G]` and the centred int8 zero points `[BLOCK_G]`."""
    PACK: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)
    b_x = tl.load(p_elem, mask=m_x, other=0.0).to(tl.float32)
    lo = tl.min(b_x, axis=1)
    hi = tl.max(b_x, axis=1)
    for k in tl.static_range(1, PACK):
        b_x = tl.load(p_elem + k, mask=m_x, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(b_x, axis=1))
        hi = tl.maximum(hi, tl.max(b_x, axis=1))

    s, z = _scale_and_zero(lo, hi, QMAX, S_MIN)
    outside = (z - HALF < -128.0) | (z - HALF > 127.0)
    s_w, z_w = _scale_and_zero(tl.minimum(lo, 0.0), tl.maximum(hi, 0.0), QMAX, S_MIN)
    s = tl.where(outside, s_w, s)
    z = tl.where(outside, z_w, z)
    s32 = s.to(tl.float32)

    b_byte = tl.zeros((BLOCK_G, NB), dtype=tl.int32)
    for k in tl.static_range(PACK):
        b_x = tl.load(p_elem + k, mask=m_x, other=0.0).to(tl.float32)
        b_q = tl.floor(tl.div_rn(b_x, s32[:, None]) + z[:, None] + 0.5)
        b_q = tl.minimum(tl.maximum(b_q, 0.0), QMAX).to(tl.int32)
        b_byte = b_byte | (b_q << (BITS * k))
    return b_byte.to(tl.uint8), s, (z - HALF).to(tl.int8)


# The write position and the token count change every decode step: specialising on them (% 16, == 1) would
# recompile the kernel in the middle of a generation.
@triton.jit(do_not_specialize=["T", "start", "capacity"])
def quant_pack_fwd_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr, start_ptr,
    T, start, capacity,
    stride_xb, stride_xt, stride_cb, stride_ct, stride_sb, stride_st, stride_zb, stride_zt,
    G: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, S_MIN: tl.constexpr,
    START_FROM_PTR: tl.constexpr, SLOTS: tl.constexpr = False,
):
    # One program per (batch row, new token); int64 so that offsets past 2**31 bytes stay valid.
    pid = tl.program_id(0).to(tl.int64)
    i_b = pid // T
    i_t = pid % T
    PACK: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PACK

    o_g = tl.arange(0, BLOCK_G)
    o_n = tl.arange(0, NB)
    m_g = o_g < G
    o_elem = o_g[:, None] * GROUP + o_n[None, :] * PACK
    m_x = m_g[:, None] & (o_n[None, :] < NB)
    p_x = x_ptr + i_b * stride_xb + i_t * stride_xt + o_elem
    b_byte, s, zq = _quantize_pack_groups(p_x, m_x, BLOCK_G, NB, BITS, S_MIN)

    # Static caches keep the write position on the device (`start_ptr`, int64 [1]); a position past the capacity
    # is not written (the host-side wrapper cannot check it without a synchronisation).
    if SLOTS:  # one row of planes, each token written at its own row (`start_ptr`: int64 [T])
        pos = tl.load(start_ptr + i_t).to(tl.int64)
    elif START_FROM_PTR:
        pos = tl.load(start_ptr).to(tl.int64) + i_t
    else:
        pos = start + i_t
    m_g = m_g & (o_g * 0 + pos < capacity)
    m_x = m_x & m_g[:, None]
    p_codes = codes_ptr + i_b * stride_cb + pos * stride_ct + o_g[:, None] * NB + o_n[None, :]
    tl.store(p_codes, b_byte, mask=m_x)
    tl.store(scale_ptr + i_b * stride_sb + pos * stride_st + o_g, s, mask=m_g)
    tl.store(zero_ptr + i_b * stride_zb + pos * stride_zt + o_g, zq, mask=m_g)


def quant_pack_fwd(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, start, fmt: PathFormat,
    slots: bool = False,
) -> None:
    """Host wrapper of `quantize_pack` (`start` as there) and, with `slots`, `quantize_pack_slots` (planes of one
    batch row, `start` an int64 tensor `[T]` of each token's row): one program per (row, token) of `x: [B, T, dim]`."""
    caller = "quantize_pack_slots" if slots else "quantize_pack"
    if not fmt.quantized:
        raise ValueError(f"{caller} handles 2, 4 and 8 bits; 16-bit paths are copied as they are")
    if any(t.stride(-1) != 1 for t in (x, codes, scale, zero)):
        raise ValueError(f"{caller} needs the last dimension of every tensor to be contiguous")
    B, T, _ = x.shape
    if B * T == 0:
        return
    from_ptr = isinstance(start, torch.Tensor)
    quant_pack_fwd_kernel[(B * T,)](
        x, codes, scale, zero, start if from_ptr else codes, T, 0 if from_ptr else start, codes.shape[1],
        *(t.stride(i) for t in (x, codes, scale, zero) for i in (0, 1)),
        G=fmt.n_groups, BLOCK_G=triton.next_power_of_2(fmt.n_groups), GROUP=fmt.group, BITS=fmt.bits, S_MIN=SCALE_MIN,
        START_FROM_PTR=from_ptr, SLOTS=slots,
    )


def quantize_pack(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, start: int | torch.Tensor,
    fmt: PathFormat,
) -> None:
    """Quantize `x: [B, T, dim]` and write it into positions `[start, start + T)` of the planes
    `codes: [B, capacity, code_bytes] uint8`, `scale: [B, capacity, G] fp16`, `zero: [B, capacity, G] int8`.

    `start` is an int (checked against the capacity) or an int64 tensor `[1]` on the planes' device, read by the
    kernel so that nothing waits for the device; then positions at or past the capacity are not written (the static
    cache checks its capacity where it can: docs/USAGE.md, "Static cache").
    """
    if x.dim() != 3 or x.shape[-1] != fmt.dim:
        raise ValueError(f"x must be [B, T, {fmt.dim}], got {tuple(x.shape)}")
    if isinstance(start, torch.Tensor):
        if start.numel() != 1 or start.dtype != torch.int64 or start.device != codes.device:
            raise ValueError(f"start must be an int or an int64 tensor of one element on {codes.device}, got "
                             f"{start.dtype} {tuple(start.shape)} on {start.device}")
    elif start < 0 or start + x.shape[1] > codes.shape[1]:
        raise ValueError(f"writing {x.shape[1]} tokens at position {start} overflows the cache capacity "
                         f"{codes.shape[1]}")
    quant_pack_fwd(x, codes, scale, zero, start, fmt)


def quantize_pack_slots(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, slots: torch.Tensor,
    fmt: PathFormat,
) -> None:
    """Quantize `x: [N, dim]` and write token `i` into row `slots[i]` of the planes `codes: [rows, code_bytes]`,
    `scale, zero: [rows, G]` (the paged cache's page planes viewed as `[P * page_size, width]`); `slots`: int64 `[N]`
    on the planes' device, each below `rows` (not checked on the device; tokens that share a row leave one of them
    there, as the padding rows of captured decode steps do in their scratch slot). One launch for the three planes,
    nothing staged."""
    if x.dim() != 2 or x.shape[-1] != fmt.dim or slots.shape != (x.shape[0],) or slots.dtype != torch.int64:
        raise ValueError(f"x must be [N, {fmt.dim}] and slots int64 [N], got {tuple(x.shape)} and "
                         f"{slots.dtype} {tuple(slots.shape)}")
    quant_pack_fwd(x.unsqueeze(0), codes.unsqueeze(0), scale.unsqueeze(0), zero.unsqueeze(0), slots.contiguous(), fmt,
                   slots=True)
