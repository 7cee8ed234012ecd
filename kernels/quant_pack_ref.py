"""Plain PyTorch reference of per-token asymmetric group quantization, packing and dequantization.

The byte layout of the codes, scales and zero points is documented in `quantmla_hf/format.py`.

Quantization of one group `x[0:group]` of one token, all in fp32:

    lo, hi = min(x), max(x)
    s  = fp16_round_up(max((hi - lo) / qmax, SCALE_MIN))
    z  = floor(-lo / s + 0.5)
    if z - 2**(bits-1) does not fit int8:           # a group far from zero
        lo, hi = min(lo, 0), max(hi, 0)             # widen the range to include zero, then recompute s and z
    q  = clamp(floor(x / s + z + 0.5), 0, qmax)     # ties round up
    stored: codes q, scale s (fp16), zero z - 2**(bits-1) (int8)

`fp16_round_up` rounds to the nearest fp16 and steps one ulp up if that fell below `s`, so the fp16 step still
spans the group and every element is within `s / 2` of its reconstruction `(q - z) * s`.
The Triton kernel performs exactly these fp32 operations (IEEE division), so on the same input both give
identical codes, scales and zero points.
"""

from __future__ import annotations

import torch

from quantmla_hf.format import SCALE_DTYPE, ZERO_DTYPE, PathFormat

# Smallest step: fp16's smallest normal number. A constant group quantizes exactly (all codes equal z).
SCALE_MIN = 2.0**-14
FP16_MAX = 65504.0


def fp16_round_up(s: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 `s` to the smallest fp16 value >= `s`. Returns fp16."""
    s16 = s.to(torch.float16)
    low = s16.float() < s
    return torch.where(low, (s16.view(torch.int16) + 1).view(torch.float16), s16)


def quantize_ref(
    x: torch.Tensor, fmt: PathFormat, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize and pack `x: [..., dim]`.

    `check=False` skips the checks that read values on the host (non-finite input, steps past fp16): the same
    codes for valid input, and no device synchronisation, so it can run inside a captured graph.

    Returns `codes: [..., code_bytes] uint8`, `scale: [..., G] fp16`, `zero: [..., G] int8`.
    """
    if not fmt.quantized:
        raise ValueError("quantize_ref is for 2, 4 and 8 bits; a 16-bit path is stored unquantized")
    if x.shape[-1] != fmt.dim:
        raise ValueError(f"expected the last dimension to be {fmt.dim}, got {x.shape[-1]}")
    lead = x.shape[:-1]
    xg = x.float().reshape(*lead, fmt.n_groups, fmt.group)
    if check and not torch.isfinite(xg).all():
        raise ValueError("cannot quantize NaN or inf values: check the model's activations (dtype overflow?)")
    half = 1 << (fmt.bits - 1)
    lo, hi = xg.amin(-1), xg.amax(-1)
    scale, zero = _scale_and_zero(lo, hi, fmt.qmax)
    outside = (zero - half < -128) | (zero - half > 127)
    if not check or outside.any():
        s_wide, z_wide = _scale_and_zero(lo.clamp(max=0), hi.clamp(min=0), fmt.qmax)
        scale, zero = torch.where(outside, s_wide, scale), torch.where(outside, z_wide, zero)
    if check and (scale.float() > FP16_MAX).any():
        raise ValueError("a group spans more than fp16 can hold as a quantization step (values over ~1e6)")
    s = scale.float().unsqueeze(-1)
    q = torch.floor(xg / s + zero.unsqueeze(-1) + 0.5).clamp(0, fmt.qmax).to(torch.uint8)
    codes = pack_codes(q.reshape(*lead, fmt.dim), fmt.bits)
    return codes, scale.to(SCALE_DTYPE), (zero - half).to(ZERO_DTYPE)


def _scale_and_zero(lo: torch.Tensor, hi: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = fp16_round_up(torch.clamp((hi - lo) / qmax, min=SCALE_MIN))
    zero = torch.floor(-lo / scale.float() + 0.5)
    return scale, zero


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes `q: [..., dim]` (uint8, values < 2**bits) into `[..., dim * bits // 8]` bytes."""
    if bits == 8:
        return q.to(torch.uint8)
    per_byte = 8 // bits
    q = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=q.device, dtype=torch.int32) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: `[..., n_bytes] uint8 -> [..., n_bytes * 8 // bits] uint8`."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    q = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(*codes.shape[:-1], codes.shape[-1] * per_byte).to(torch.uint8)


def dequantize_ref(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: PathFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Reconstruct `[..., dim]` in `dtype` from `codes: [..., code_bytes]`, `scale, zero: [..., G]`."""
    q = unpack_codes(codes, fmt.bits).float()
    lead = q.shape[:-1]
    q = q.reshape(*lead, fmt.n_groups, fmt.group)
    z = zero.float().unsqueeze(-1) + (1 << (fmt.bits - 1))
    x = (q - z) * scale.float().unsqueeze(-1)
    return x.reshape(*lead, fmt.dim).to(dtype)


def quantize_pack_at_ref(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, position: torch.Tensor,
    fmt: PathFormat,
) -> None:
    """Reference of `quant_pack.quantize_pack` with a device-side start: quantize `x: [B, T, dim]` and write it into
    positions `[position, position + T)` of the planes, `position` an int64 tensor `[1]` on the planes' device (no
    host synchronisation; positions at or past the capacity are dropped, like the kernel)."""
    c, s, z = quantize_ref(x, fmt, check=False)
    T, cap = x.shape[1], codes.shape[1]
    pos = position.reshape(1) + torch.arange(T, device=codes.device)
    # Out-of-range positions write to a scratch index past the end, dropped by the slice below.
    keep = pos < cap
    for plane, new in ((codes, c), (scale, s), (zero, z)):
        cur = plane.index_select(1, pos.clamp(max=cap - 1))
        plane.index_copy_(1, pos.clamp(max=cap - 1), torch.where(keep[None, :, None], new, cur))
