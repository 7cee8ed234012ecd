"""The decode operation: absorbed MLA attention of a few query tokens over a packed QuantMLA cache layer, with one
backend table for the contiguous planes (growing cache, static cache, `torch.ops.quantmla.mla_decode`) and the page
pools (the paged cache), the split plan the kernels launch with, and the input checks.

    rows m = (head h, query token t) of `q_lat: [B, H, Tq, d_c]`, `q_rot: [B, H, Tq, d_R]`, flattened to `M = H * Tq`
    score[m, j] = (q_lat[m] . c[j] + q_rot[m] . k_R[j]) * scaling          for every valid cached position j
    o_lat[m] = softmax_j(score[m]) @ c,  lse[m] = logsumexp_j score[m]

Backends (the kernels, each beside its reference in `kernels/`; timings and why in docs/KERNELS.md):

    "gluon_regs"  mla_decode_gluon_regs.py   sm_90, 16 query rows per program, keys unpacked into wgmma registers
    "gluon_wide"  mla_decode_gluon_wide.py   sm_90, two warpgroups, 32 rows per program (many heads)
    "gluon_split" mla_decode_gluon_split.py  sm_90, a scorer on register keys and two value warpgroups, 64 rows
    "triton"      mla_decode_triton.py       any CUDA GPU (and the Triton interpreter on CPU), every dtype
    "torch"       mla_decode_ref.py          the reference, for formats no kernel takes

Every kernel splits the packed positions into `split_plan` shares sized from the device-side `length` (never the
capacity), writes one normalised partial per split, and `mla_decode_combine.combine` merges them in a fixed order:
a growing cache and a static one of any capacity give the same bits, and no launch synchronises with the host.

The paged decode (`mla_decode_paged`, reference `mla_decode_ref.mla_decode_paged_ref`) takes requests of different
lengths in one launch, packed without padding (`cu_seqlens_q`), each token read by indirection (its page from the
request's `page_table` row, its slot `p % page_size`): a decode step in 64-token pages on sm_90 goes to the Gluon
kernel the table picks in pages (the contiguous choice but for C8R8 from 64 rows: `gluon_split`), reading the pools
through the page table; every other step (chunks of several query tokens, other page sizes, other GPUs, the
interpreter) to the portable kernel with `PAGE = page_size`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from ..format import CacheFormat
from ..kernels import mla_decode_gluon_regs as regs
from ..kernels import mla_decode_gluon_split as split
from ..kernels import mla_decode_gluon_wide as wide
from ..kernels import mla_decode_triton as portable
from ..kernels.mla_decode_combine import combine
from ..kernels.mla_decode_gluon_common import BLOCK_T as GLUON_BLOCK_T
from ..kernels.mla_decode_gluon_common import copy_programs, hopper_handles, min_split_tiles, planes_contiguous
from ..kernels.mla_decode_gluon_common import score_rounding as gluon_score_rounding
from ..kernels.mla_decode_ref import mla_decode_static_ref

LOG2E = 1.4426950408889634
BACKENDS = ("gluon_regs", "gluon_wide", "gluon_split", "triton", "torch")
PAGED_BACKENDS = ("gluon_regs", "gluon_wide", "gluon_split", "triton")
GLUON_KERNELS = {  # backend: (rows per program, programs per SM the splits fill)
    "gluon_regs": (regs.BLOCK_M, regs.FILL_PER_SM),
    "gluon_wide": (wide.BLOCK_M, wide.FILL_PER_SM),
    "gluon_split": (split.BLOCK_M, split.FILL_PER_SM),
}


def select_backend(fmt: CacheFormat, rows: int, batch: int, dtype: torch.dtype, device,
                   query_dtype: torch.dtype | None = None, paged: bool = False) -> str:
    """The decode kernel for this format, `rows = H * Tq` query rows per batch row, `batch` rows, model dtype
    `dtype` (of the sink/recent copies and 16-bit planes), device and query dtype (default: `dtype`), for the
    contiguous planes or (`paged`) page pools: one of `BACKENDS`.

    The table (timings: docs/KERNELS.md "Which kernel runs"):

    - Hopper (sm_90) with bf16/fp16 copies: `gluon_split` from 64 rows where it takes the format (C4R4, C2R4, C4R8,
      C2R8 and C8R8 with 8 content groups, and C16R16 at 512 + 64 channels; bf16/fp16 queries); else,
      with 2/4/8-bit paths in groups of 64, `gluon_wide` above 16 rows where it takes the format (C4R4, C2R4, C4R8,
      C2R8, C8R8), else `gluon_regs`. Every batch measured picks the same kernel, so `batch` does not enter the rule.
    - Any other CUDA GPU, 16-bit paths below 64 rows, fp32 models, and the Triton interpreter on CPU: `triton`,
      where the format has power-of-two widths (`mla_decode_triton.triton_handles`).
    - Everything else (CPU without the interpreter, other widths): `torch`.
    """
    device = torch.device(device)
    if not portable.triton_handles(fmt, dtype):
        return "torch"
    if portable.interpreting():
        return "triton"
    if device.type != "cuda":
        return "torch"
    if hopper_handles(fmt, dtype, device):
        if rows >= split.BLOCK_M and split.split_handles(fmt) and (query_dtype or dtype) != torch.float32:
            return "gluon_split"
        if regs.regs_handles(fmt):
            return "gluon_wide" if rows > 16 and wide.wide_handles(fmt) else "gluon_regs"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "torch"
    return "triton"


def select_paged_backend(fmt: CacheFormat, H: int, n_requests: int, n_queries: int, page_size: int,
                         copy_dtype: torch.dtype, device, query_dtype: torch.dtype | None = None) -> str:
    """The paged decode kernel: for a decode step, one query token per request (`n_queries == n_requests`), in pages
    of 64 tokens with sink and recent copies (a 16-bit cache keeps none and needs none), the Gluon kernel
    `select_backend(..., paged=True)` picks for these `H` rows (`gluon_regs`, `gluon_wide` or `gluon_split`, reading
    the pools through the page table); otherwise `triton` (any step, page size and format)."""
    if (n_queries != n_requests or page_size != GLUON_BLOCK_T
            or not (split.dense(fmt) or (fmt.sink_tokens and fmt.recent_tokens))):
        return "triton"
    choice = select_backend(fmt, H, n_requests, copy_dtype, device, query_dtype, paged=True)
    return choice if choice.startswith("gluon") else "triton"


def gluon_handles(backend: str, fmt: CacheFormat) -> bool:
    """Whether Gluon kernel `backend` takes the format (besides `hopper_handles`)."""
    if backend == "gluon_split":
        return split.split_handles(fmt)
    if not regs.regs_handles(fmt):
        return False
    if backend == "gluon_wide":
        return wide.wide_handles(fmt)
    return True


def gluon_launch(backend: str):
    """The host launch of Gluon kernel `backend` (`launch_flat`'s arguments after its `block_m`)."""
    if backend == "gluon_split":
        return split.launch_split
    return functools.partial(regs.launch_gluon, wide_program=backend == "gluon_wide")


def score_rounding(backend: str, fmt: CacheFormat) -> tuple[bool, bool]:
    """Whether `backend`'s scores see the packed keys of (content, RoPE) rounded once to fp16, to nearest, as
    `mla_decode_ref(score_rounding=...)` repeats it
    (`bench_decode.py --check` holds each backend's LSE to that reference): the Gluon kernels below 8 bits
    (`mla_decode_gluon_common.score_rounding`). "triton" and "torch" score exactly."""
    if backend.startswith("gluon"):
        return gluon_score_rounding(fmt)
    return False, False


def partial_dtype(backend: str, fmt: CacheFormat) -> torch.dtype:
    """The dtype of `backend`'s split partials `o_part` over format `fmt`: fp16, scaled so that every value a
    quantized content path holds fits (`mla_decode_combine`'s docstring), for the split kernel (`gluon_split`, 64
    rows a program) over quantized content, whose partials are as many bytes as the cache or more (at 128 heads,
    batch 1, 32K: 17 MB of fp32 partials written and read against 10 MB of C4R4 cache); fp32 for `gluon_regs` (16
    rows a program, where fp16 partials were slower at batch 8: docs/KERNELS.md, "Grid and splits"), `gluon_wide`
    (slower with them at batches 1 and 2), the portable kernel and 16-bit content, whose values have no bound."""
    return torch.float16 if backend == "gluon_split" and fmt.content.quantized else torch.float32


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Multiprocessors of CUDA device `device_index` (read once)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fill_splits(B: int, head_blocks: int, sms: int, programs_per_sm: int) -> int:
    """Packed splits per (batch row, head block) for about `programs_per_sm` programs per multiprocessor in all (the
    Gluon kernels: their resident program slots, filled once): `programs_per_sm * sms // (B * head_blocks)`, at
    least 1."""
    return max(1, (programs_per_sm * sms) // max(1, B * head_blocks))


def one_wave_splits(fill: int, copies: int) -> int:
    """Packed splits per (batch row, head block) of a kernel with one program per multiprocessor, whose `fill`
    (`fill_splits`) takes every multiprocessor: `fill - copies`, so that the packed and the `copies` copy programs of
    every (row, head block) start together, where that keeps at least 7/8 of `fill`; else `fill`. A copy program that
    waits for a slot adds its whole time (query staging, one tile, a partial) to the step: at 128 heads and batch 1
    the filled grid left the last copy programs for a second wave (docs/KERNELS.md, "Grid and splits")."""
    return fill - copies if 8 * (fill - copies) >= 7 * fill else fill


def split_plan(backend: str, B: int, head_blocks: int, capacity: int, fmt: CacheFormat, sms: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """Packed-position splits as `(split_target, grid_splits)`.

    `split_target` (or `num_splits`) depends on static sizes other than the capacity: the portable kernel
    `programs_per_sm(B * head_blocks)` programs per multiprocessor (1 to 8, the paged kernel's rule), the Gluon
    kernels `fill_splits` of their resident slots (`gluon_split`: `one_wave_splits`, room for its copy programs in
    the same wave). The kernels cut the
    positions the device-side length holds, `n = length - R - first` (`first`: `S` for the portable kernel, 0 for
    the tile-aligned Gluon kernels), into `tokens_per_split = max(min_tiles * block_t, round_up(cdiv(n,
    split_target), block_t))` each (`min_tiles` 2 for the portable kernel, `min_split_tiles(fmt)` for the Gluon
    ones): the same boundaries for a growing cache and a static one. At most `min(split_target, cdiv(n, min_tiles *
    block_t))` splits hold positions, so `grid_splits`, that bound at the capacity, covers every length the
    planes can hold; splits past the data write empty partials that the combine skips."""
    if backend == "triton":
        first, block_t, min_tiles = fmt.sink_tokens, portable.launch_shape(fmt, 0)[0], 2
        target = portable.split_target(B * head_blocks, sms)
    else:
        first, block_t, min_tiles = 0, GLUON_BLOCK_T, min_split_tiles(fmt)
        target = fill_splits(B, head_blocks, sms, GLUON_KERNELS[backend][1])
        if backend == "gluon_split":  # one program per SM: the copy programs too in the first wave, if that is cheap
            target = one_wave_splits(target, copy_programs(fmt))
        if fmt.content.bits == 8:  # splits of 2 tiles (`min_split_tiles`), at most one per SM (docs/KERNELS.md)
            target = min(target, sms)
    target = max(1, int(num_splits or target))
    n_cap = max(0, capacity - fmt.recent_tokens - first)
    return target, max(1, min(target, -(-n_cap // (min_tiles * block_t))))


def _check_inputs(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, length,
                  capacity, out):
    if q_lat.dim() != 4 or q_rot.dim() != 4 or q_lat.shape[:3] != q_rot.shape[:3]:
        raise ValueError(f"q_lat and q_rot must be [B, H, Tq, d], got {tuple(q_lat.shape)} and {tuple(q_rot.shape)}")
    B, H, Tq, D_C = q_lat.shape
    if D_C != fmt.content.dim or q_rot.shape[-1] != fmt.rope.dim:
        raise ValueError(f"query widths ({D_C}, {q_rot.shape[-1]}) do not match the cache format "
                         f"({fmt.content.dim}, {fmt.rope.dim})")
    if Tq > fmt.recent_tokens:
        raise ValueError(f"{Tq} query tokens need a recent window of at least {Tq} tokens "
                         f"(recent_tokens={fmt.recent_tokens}); longer chunks go through the prefill path")
    if length.numel() != 1 or length.device != q_lat.device:
        raise ValueError(f"length must be a one-element tensor on {q_lat.device}, got shape {tuple(length.shape)} "
                         f"on {length.device}")
    for name, path, planes in (("content", fmt.content, content_planes), ("rope", fmt.rope, rope_planes)):
        keys = ("codes", "scale", "zero") if path.quantized else ("values",)
        for key in keys:
            if key not in planes:
                raise ValueError(f"{name} planes of a {path.bits}-bit path need {keys}, got {sorted(planes)}")
            plane = planes[key]
            if plane.shape[0] != B or plane.shape[1] < capacity or plane.stride(-1) != 1:
                raise ValueError(f"{name} plane {key!r} must be [B={B}, capacity >= {capacity}, .] with a contiguous "
                                 f"last dimension, got shape {tuple(plane.shape)} strides {plane.stride()}")
        if path.quantized and planes["scale"].stride() != planes["zero"].stride():
            raise ValueError(f"{name} scale and zero planes must share strides, got {planes['scale'].stride()} and "
                             f"{planes['zero'].stride()}")
    for name, t, n in (("sink_c", sink_c, fmt.sink_tokens), ("sink_r", sink_r, fmt.sink_tokens),
                       ("recent_c", recent_c, fmt.recent_tokens), ("recent_r", recent_r, fmt.recent_tokens)):
        if t.shape[0] != B or t.shape[1] < n or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [B={B}, {n}, d] with a contiguous last dimension, got {tuple(t.shape)}")
    if out is not None:
        o, lse = out
        if o.shape != (B, H, Tq, D_C) or lse.shape != (B, H, Tq) or not (o.is_contiguous() and lse.is_contiguous()):
            raise ValueError(f"out must be contiguous ([B, H, Tq, d_c], [B, H, Tq]) = ({(B, H, Tq, D_C)}, "
                             f"{(B, H, Tq)}), got {tuple(o.shape)} and {tuple(lse.shape)}")


def mla_decode_static(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor],
    fmt: CacheFormat,
    sink_c: torch.Tensor,
    sink_r: torch.Tensor,
    recent_c: torch.Tensor,
    recent_r: torch.Tensor,
    left_padding: torch.Tensor,
    length: torch.Tensor,
    capacity: int,
    scaling: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of `Tq` query tokens over the first `length` positions of a packed cache layer, with no
    host synchronisation and a grid fixed by static sizes (one launch serves every step of a generation).

    Args:
        q_lat: `[B, H, Tq, d_c]` queries with W_UK absorbed (bf16, fp16 or fp32).
        q_rot: `[B, H, Tq, d_R]` post-RoPE queries, rotated like the stored keys.
        content_planes, rope_planes: `codes/scale/zero` planes `[B, capacity, .]` of a packed path, or `values`
            `[B, capacity, d]` of a 16-bit one (byte layout: `quantmla_hf/format.py`).
        fmt: the cache format (bits, groups, `sink_tokens` S, `recent_tokens` R).
        sink_c, sink_r: `[B, S, d]` model-dtype copies of the first S real tokens of each row.
        recent_c, recent_r: `[B, R, d]` model-dtype ring of the last R positions (slot `p % R`).
        left_padding: `[B]` int64 on the device.
        length: int64 `[1]` on the device: positions cached (the Tq queries are the last Tq of them).
        capacity: static number of positions the planes hold; fixes the grid, not the split boundaries.
        scaling: softmax scale.
        out: optional preallocated contiguous `(o_lat [B, H, Tq, d_c], lse [B, H, Tq])` fp32.
        backend: one of `BACKENDS`; default `select_backend(...)`.
        num_splits: split target override (benchmarks, tests); default `split_plan`'s.

    Returns:
        `o_lat: [B, H, Tq, d_c]` fp32 and `lse: [B, H, Tq]` fp32 (natural log; zeros and -inf for a row with no
        visible position).
    """
    _check_inputs(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, length,
                  capacity, out)
    B, H, Tq, D_C = q_lat.shape
    M = H * Tq
    backend = backend or select_backend(fmt, M, B, sink_c.dtype, q_lat.device,
                                        torch.promote_types(q_lat.dtype, q_rot.dtype))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return mla_decode_static_ref(q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c,
                                     recent_r, left_padding, length, capacity, scaling, out)
    if backend.startswith("triton") and not portable.triton_handles(fmt, sink_c.dtype):
        raise ValueError(f"the Triton decode kernels do not take {fmt.name} with {sink_c.dtype} copies (power-of-two "
                         "widths, at most 8 content groups and one RoPE group): use backend='torch'")
    if backend.startswith("gluon"):
        handles = gluon_handles(backend, fmt)
        if not (hopper_handles(fmt, sink_c.dtype, q_lat.device) and handles):
            raise ValueError(f"the {backend} kernel does not take {fmt.name} with {sink_c.dtype} copies on "
                             f"{q_lat.device} (sm_90, groups of 64; wide: 8 content groups of C4R4, C2R4, "
                             "C4R8, C2R8 or C8R8; split: those of them and C16R16): use "
                             "backend='triton'")
        if not planes_contiguous(fmt, content_planes, rope_planes):
            raise ValueError("the Gluon decode kernels need plane rows laid out contiguously (docs/CACHE_FORMAT.md): "
                             "use backend='triton' for strided planes")

    if backend == "triton":
        block_m, n_tail = portable.block_rows(M), 1
    else:
        block_m = GLUON_KERNELS[backend][0]
        n_tail = copy_programs(fmt)
    head_blocks = -(-M // block_m)
    sms = num_sms(q_lat.device.index or 0) if q_lat.is_cuda and not portable.interpreting() else 8
    target, NS = split_plan(backend, B, head_blocks, capacity, fmt, sms, num_splits)
    NSP = NS + n_tail  # partial slots: packed splits, then the sink/recent copies
    q = q_lat.reshape(B, M, D_C).contiguous()
    qr = q_rot.reshape(B, M, q_rot.shape[-1]).contiguous()
    o_part = torch.empty((B, M, NSP, D_C), dtype=partial_dtype(backend, fmt), device=q.device)
    lse_part = torch.empty((B, M, NSP), dtype=torch.float32, device=q.device)
    lp = left_padding if left_padding.dtype == torch.int64 else left_padding.to(torch.int64)
    launch = portable.launch_triton if backend == "triton" else gluon_launch(backend)
    launch(q, qr, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, lp, length, o_part, lse_part,
           M, Tq, target, NS, scaling * LOG2E)
    o, lse = combine(o_part, lse_part, n_tail, out, sms)
    return o.view(B, H, Tq, D_C), lse.view(B, H, Tq)


def _decode_gluon(backend, q_lat, q_rot, content, rope, fmt, sink_content, sink_rope, recent_content, recent_rope,
                  page_table, rows, seq_lens, scaling, longest, num_splits):
    """One query token per request through the paged launch of Gluon kernel `backend`; `(o_lat [n, H, d_c], lse
    [n, H])`. Splits as the contiguous launch makes them for `n` rows of `longest` positions (`split_plan`)."""
    n, H, d_c = q_lat.shape
    if not planes_contiguous(fmt, content, rope):
        raise ValueError("the paged Gluon kernel needs contiguous page planes [P, 64, width]: use backend='triton'")
    for planes, path in ((content, fmt.content), (rope, fmt.rope)):
        if path.quantized:
            words = planes["codes"].shape[0] * planes["codes"].shape[1] * path.code_bytes // 4
        else:  # 16-bit pools, addressed in elements
            words = planes["values"].shape[0] * planes["values"].shape[1] * path.dim
        if words >= 2**31:
            raise ValueError(f"the paged Gluon kernel addresses pool rows with int32 offsets; {words} code words "
                             "are more: use backend='triton'")
    if split.dense(fmt):  # 16-bit pools: as many copies as the step passes (the paged 16-bit cache keeps none)
        fmt = dataclasses.replace(fmt, sink_tokens=sink_content.shape[1], recent_tokens=recent_content.shape[1])
        if not sink_content.numel():  # (never read: the queries stand in for an empty copy's storage)
            sink_content, sink_rope = q_lat, q_rot
        if not recent_content.numel():
            recent_content, recent_rope = q_lat, q_rot
    sms = num_sms(q_lat.device.index or 0)
    target, NS = split_plan(backend, n, -(-H // GLUON_KERNELS[backend][0]), longest, fmt, sms, num_splits)
    NSP = NS + copy_programs(fmt)
    o_part = torch.empty((n, H, NSP, d_c), dtype=partial_dtype(backend, fmt), device=q_lat.device)
    lse_part = torch.empty((n, H, NSP), dtype=torch.float32, device=q_lat.device)
    gluon_launch(backend)(q_lat.contiguous(), q_rot.contiguous(), content, rope, fmt, sink_content, sink_rope,
                          recent_content, recent_rope, rows.to(torch.int32), seq_lens.to(torch.int32), o_part,
                          lse_part, H, 1, target, NS, float(scaling) * LOG2E,
                          page_table=page_table.to(torch.int32).contiguous())
    return combine(o_part, lse_part, copy_programs(fmt), None, sms)


def mla_decode_paged(q_lat: torch.Tensor, q_rot: torch.Tensor, content: dict[str, torch.Tensor],
                     rope: dict[str, torch.Tensor], fmt: CacheFormat, sink_content: torch.Tensor,
                     sink_rope: torch.Tensor, recent_content: torch.Tensor, recent_rope: torch.Tensor,
                     page_table: torch.Tensor, rows: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                     scaling: float, token_request: torch.Tensor | None = None, block_t: int | None = None,
                     num_splits: int | None = None, max_seq_len: int | None = None,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `mla_decode_ref.mla_decode_paged_ref`; returns `o_lat: [Nq, H, d_c]`, `lse: [Nq, H]` (fp32).

    `token_request` (int32 `[Nq]`, each query token's request) is derived from `cu_seqlens_q` when not given (the
    paged cache's `PagedStep.token_request` is that tensor). `num_splits` overrides the split target (default:
    the kernel's rule); `block_t` the Triton kernel's token tile (default `mla_decode_triton.launch_shape`'s);
    `max_seq_len` (the longest `seq_lens`) saves reading it back from the device and fixes the grid (a captured
    step passes its page-table width). `backend`: one of `PAGED_BACKENDS`, default `select_paged_backend` (every
    request is taken to have at least one query token, so `Nq == n` means one each).
    """
    Nq, H, d_c = q_lat.shape
    if q_rot.shape != (Nq, H, fmt.rope.dim) or d_c != fmt.content.dim:
        raise ValueError(
            f"expected q_lat [Nq, H, {fmt.content.dim}] and q_rot [Nq, H, {fmt.rope.dim}], got "
            f"{tuple(q_lat.shape)} and {tuple(q_rot.shape)}"
        )
    n = seq_lens.shape[0]
    if cu_seqlens_q.shape != (n + 1,) or page_table.dim() != 2 or page_table.shape[0] != n or rows.shape != (n,):
        raise ValueError(
            f"cu_seqlens_q must be [n + 1], page_table [n, max_pages] and rows [n] for n = {n} requests, got "
            f"{tuple(cu_seqlens_q.shape)}, {tuple(page_table.shape)} and {tuple(rows.shape)}"
        )
    if sink_content.shape[1] and sink_content.shape[0] == 0:
        raise ValueError("sink copies are [rows, S, d]: give one row per request row in use")
    # The model dtype: of the copies, else of a 16-bit content plane, else of the queries.
    if sink_content.numel():
        copy_dtype = sink_content.dtype
    else:
        copy_dtype = q_lat.dtype if fmt.content.quantized else content["values"].dtype
    if not portable.triton_handles(fmt, copy_dtype):
        raise ValueError(f"the paged Triton kernel does not take {fmt.name} (power-of-two widths, at most 8 content "
                         "groups and one RoPE group): use mla_decode_paged_ref")
    if Nq == 0:
        return (torch.empty((0, H, d_c), dtype=torch.float32, device=q_lat.device),
                torch.empty((0, H), dtype=torch.float32, device=q_lat.device))
    page_size = next(iter(content.values())).shape[1]
    choice = select_paged_backend(fmt, H, n, Nq, page_size, copy_dtype, q_lat.device,  # "triton" in the interpreter
                                  torch.promote_types(q_lat.dtype, q_rot.dtype))
    backend = backend or choice
    if backend not in PAGED_BACKENDS:
        raise ValueError(f"backend must be one of {PAGED_BACKENDS}, got {backend!r}")
    if backend.startswith("gluon"):
        if choice == "triton" or not gluon_handles(backend, fmt):
            raise ValueError(f"the paged {backend} kernel does not take {fmt.name}, {Nq} query tokens of {n} requests "
                             f"in pages of {page_size} on {q_lat.device}: a paged Gluon kernel takes decode steps (one "
                             f"query token per request) in pages of {GLUON_BLOCK_T} tokens on sm_90, of the formats "
                             "it handles (gluon_regs: 2/4/8-bit formats with sink and recent copies; gluon_wide: "
                             "C4R4, C2R4, C4R8, C2R8, C8R8; gluon_split: those and C16R16); use backend='triton'")
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        return _decode_gluon(backend, q_lat, q_rot, content, rope, fmt, sink_content, sink_rope, recent_content,
                             recent_rope, page_table, rows, seq_lens, scaling, longest, num_splits)
    if token_request is None:
        counts = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        token_request = torch.repeat_interleave(torch.arange(n, device=q_lat.device), counts)
    S, R = sink_content.shape[1], recent_content.shape[1]
    native = portable.native_operands(fmt, q_lat.dtype, q_rot.dtype, copy_dtype)
    block_m, tile = portable.block_rows(H), portable.launch_shape(fmt, H)[0]
    bt = block_t or tile
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    sms = num_sms(q_lat.device.index or 0) if q_lat.is_cuda else 8
    target = max(1, int(num_splits or portable.split_target(Nq * triton.cdiv(H, block_m), sms)))
    NS = max(1, min(target, triton.cdiv(max(longest - R - S, 0), 2 * bt)))  # splits that can hold positions
    o_part = torch.empty((Nq, H, NS + 1, d_c), dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty((Nq, H, NS + 1), dtype=torch.float32, device=q_lat.device)
    # An empty copy tensor has no storage to point at: pass the queries (never read, the masks are all false).
    snc, snr, rcc, rcr = (t.contiguous() if t.numel() else q_lat
                          for t in (sink_content, sink_rope, recent_content, recent_rope))
    lens = seq_lens.to(torch.int32).contiguous()
    copies = dataclasses.replace(fmt, sink_tokens=S, recent_tokens=R)  # a 16-bit cache keeps no copies
    pages = tuple(t.to(torch.int32).contiguous() for t in (page_table, rows, cu_seqlens_q, token_request))
    portable.launch_triton(q_lat.contiguous(), q_rot.contiguous(), content, rope, copies, snc, snr, rcc, rcr, lens,
                           lens, o_part, lse_part, H, 1, target, NS, float(scaling) * LOG2E, native=native,
                           pages=pages, block_t=bt)
    return combine(o_part, lse_part, 1, None, sms)
