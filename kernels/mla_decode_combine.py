"""Log-sum-exp merge of split-K decode partials (every decode kernel's second launch); its reference is
`mla_decode_ref.combine_ref`.

    o_part [B, M, NSP, d_c] fp32 (each split normalised by its own sum), lse_part [B, M, NSP] fp32 (natural log,
    -inf for an empty split)  ->  o [B, M, d_c] = sum_s exp(lse_s - lse) o_s,  lse [B, M] = logsumexp_s lse_s

or `o_part` fp16 holding `o_s * FP16_PARTIAL_SCALE` (`partial_scale`; `backends.partial_dtype` says which launches
write it): half the bytes to write and read. A split's partial is a convex combination of the content values it
saw. A quantized content path dequantizes to at most `(2**8 - 1) * 65504` in magnitude (an 8-bit code distance
times the largest fp16 step, `quant_pack_ref`), and its sink/recent copies lie within half a step of their
packed values, so every partial stays below `65504 / FP16_PARTIAL_SCALE`. The scale keeps fp16's 11 significant bits
for `|o_s| >= 2**-6`; below that the error is at most 2**-17 absolute.

The last `n_tail` slots hold the sink/recent copies. The result, to the bit, depends on the non-empty partials
only, not on the grid (`combine_kernel`): a growing cache and a static one of any capacity agree exactly.

On Hopper and newer the merge is a programmatic dependent launch of the decode kernel before it (`dependent_launch`):
its launch is set up while the decode runs, and its programs wait (`griddepcontrol.wait`) for the decode grid's
partials before reading any (docs/KERNELS.md, "Grid and splits").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .mla_decode_ref import partial_scale
from .mla_decode_triton import interpreting

CHUNK = 8  # packed splits merged per step (fixed: the summation order must not follow the grid)
LSE_BLOCK = 256  # split LSEs read per step of the first pass (the Gluon grids have at most 2 programs per SM)
BLOCK_D = 512  # latent columns per program at most
MIN_BLOCK_D = 64  # and at least
SMS_PER_PROGRAM = 2  # columns are split while the grid has fewer programs than half the multiprocessors


@triton.jit(do_not_specialize=["NSP"])
def combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, NSP, D_C: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, N_TAIL: tl.constexpr, LSE_BLOCK: tl.constexpr,
                   DEPENDENT: tl.constexpr, UNSCALE: tl.constexpr):
    """Log-sum-exp merge of the splits of one (batch row, query row) and block of d_c columns; a row with no
    visible position gives zeros and lse -inf. A first pass reads the packed splits' LSEs `LSE_BLOCK` at a time for
    their maximum and the last non-empty one; the packed splits up to it are then summed in chunks of a fixed
    `BLOCK_S` (each chunk's LSEs and partials loaded together, an empty split's partial, whatever it holds, selected
    away), then the `N_TAIL` copy slots one by one: the empty splits after the last add nothing, so the result does
    not depend on `NSP`. `DEPENDENT`: launched as a programmatic dependent of the decode kernel, so every read waits
    for that grid's partials (`gdc_wait`)."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    i_bm = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    n_packed = NSP - N_TAIL
    p_lse = lse_part_ptr + i_bm * NSP
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D_C
    if N_TAIL > 0:
        m = tl.load(p_lse + n_packed)
    else:  # no copy slots (a paged 16-bit cache)
        m = tl.full((), float("-inf"), tl.float32)
    for j in tl.static_range(1, N_TAIL):
        m = tl.maximum(m, tl.load(p_lse + n_packed + j))
    last = tl.full((), -1, tl.int32)  # the last non-empty packed split
    for s0 in range(0, n_packed, LSE_BLOCK):
        o_l = s0 + tl.arange(0, LSE_BLOCK)
        b_lse = tl.load(p_lse + o_l, mask=o_l < n_packed, other=float("-inf"))
        m = tl.maximum(m, tl.max(b_lse, axis=0))
        last = tl.maximum(last, tl.max(tl.where(b_lse > float("-inf"), o_l, -1), axis=0))
    n_used = last + 1
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < n_used
        b_lse = tl.load(p_lse + o_s, mask=m_s, other=float("-inf"))
        b_o = tl.load(o_part_ptr + (i_bm * NSP + o_s[:, None]) * D_C + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                      other=0.0)
        has = b_lse > float("-inf")
        w = tl.where(has, tl.exp(b_lse - m_use), 0.0)
        total += tl.sum(w, axis=0)
        acc += tl.sum(tl.where(has[:, None], b_o * w[:, None], 0.0), axis=0)
    for j in tl.static_range(N_TAIL):
        lse_dense = tl.load(p_lse + n_packed + j)
        w_d = tl.where(lse_dense > float("-inf"), tl.exp(lse_dense - m_use), 0.0)
        m_od = m_d & (lse_dense + tl.zeros((BLOCK_D,), tl.float32) > float("-inf"))  # read only if non-empty
        b_od = tl.load(o_part_ptr + (i_bm * NSP + n_packed + j) * D_C + o_d, mask=m_od, other=0.0)
        total += w_d
        acc += b_od * w_d
    tot = tl.sum(total, axis=0)
    if UNSCALE != 1.0:
        acc = acc * UNSCALE
    out = acc / tl.where(tot > 0, tot, 1.0)
    tl.store(o_ptr + i_bm * D_C + o_d, out, mask=m_d)
    if i_d == 0:
        tl.store(lse_ptr + i_bm, tl.where(tot > 0, m_use + tl.log(tot), float("-inf")))


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether the merge on `device` launches as a programmatic dependent of the kernel before it (CUDA graphs keep
    the dependency): a CUDA device of compute capability 9.0 or newer, outside the Triton interpreter."""
    return (device.type == "cuda" and not interpreting()
            and _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device()))


def column_block(rows: int, d_c: int, sms: int) -> int:
    """Latent columns per combine program: the whole row (up to `BLOCK_D`), halved down to `MIN_BLOCK_D` while the
    programs are fewer than half the multiprocessors (else few programs would read hundreds of partials each)."""
    block = min(triton.next_power_of_2(d_c), BLOCK_D)
    while block > MIN_BLOCK_D and rows * triton.cdiv(d_c, block) * SMS_PER_PROGRAM < sms:
        block //= 2
    return block


def combine(o_part: torch.Tensor, lse_part: torch.Tensor, n_tail: int = 1,
            out: tuple[torch.Tensor, torch.Tensor] | None = None, sms: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge above (`o [B, M, d_c]` fp32, `lse [B, M]`) of fp32 or scaled fp16 partials, written into `out`
    (contiguous tensors of `B * M * d_c` and `B * M` elements, any shape) when given. `sms`: the device's
    multiprocessors, for `column_block` (0: whole rows)."""
    B, M, NSP, D_C = o_part.shape
    if out is None:
        o = torch.empty((B, M, D_C), dtype=torch.float32, device=o_part.device)
        lse = torch.empty((B, M), dtype=torch.float32, device=o_part.device)
    else:
        o, lse = out
    block_d = column_block(B * M, D_C, sms)
    dependent = dependent_launch(o_part.device)
    combine_kernel[(B * M, triton.cdiv(D_C, block_d))](
        o_part, lse_part, o, lse, NSP, D_C=D_C, BLOCK_S=CHUNK, BLOCK_D=block_d, N_TAIL=n_tail, LSE_BLOCK=LSE_BLOCK,
        DEPENDENT=dependent, UNSCALE=1.0 / partial_scale(o_part.dtype), launch_pdl=dependent,
    )
    return o, lse

