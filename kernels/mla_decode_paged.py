"""The paged decode operation: absorbed MLA attention of several requests read from the paged QuantMLA cache.

Same function and arguments as `mla_decode_ref.mla_decode_paged_ref` (see its docstring for the read rule):
requests of different lengths in one launch, packed without padding (`cu_seqlens_q`), each token read by
indirection (its page from the request's `page_table` row, its slot `p % page_size`).

Two launches (`select_paged_backend`): a decode step in 64-token pages on sm_90 goes to the Gluon kernel the
contiguous table picks, reading the pools through the page table; every other step (chunks of several query
tokens, other page sizes, other GPUs, the interpreter) to the portable kernel (`mla_decode_triton.py`) with
`PAGE = page_size`: one program per (split, head block, query token), the page pools viewed as `[P * page_size,
width]` planes whose rows it addresses by slot `page * page_size + p % page_size`. Both write normalised partials
that `mla_decode_combine.combine` merges per (token, head).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from quantmla_hf.format import CacheFormat

from . import mla_decode_gluon_regs as regs
from . import mla_decode_gluon_wide as wide
from .mla_decode import LOG2E, interpreting, num_sms, select_backend, split_plan
from .mla_decode_combine import combine
from .mla_decode_gluon_common import BLOCK_T as GLUON_BLOCK_T
from .mla_decode_gluon_common import copy_programs, planes_contiguous
from .mla_decode_triton import block_rows, launch_shape, launch_triton, native_operands, split_target, triton_handles


PAGED_BACKENDS = ("gluon_regs", "gluon_wide", "triton")


def select_paged_backend(fmt: CacheFormat, H: int, n_requests: int, n_queries: int, page_size: int,
                         copy_dtype: torch.dtype, device) -> str:
    """The paged decode kernel: for a decode step, one query token per request (`n_queries == n_requests`), in pages
    of 64 tokens with sink and recent copies, the Gluon kernel the contiguous table (`mla_decode.select_backend`)
    picks for these `H` rows (`gluon_regs` or `gluon_wide`, reading the pools through the page table); otherwise
    `triton` (this module's kernel: any step, page size and format)."""
    if n_queries != n_requests or page_size != GLUON_BLOCK_T or not (fmt.sink_tokens and fmt.recent_tokens):
        return "triton"
    choice = select_backend(fmt, H, n_requests, copy_dtype, device)
    return choice if choice.startswith("gluon") else "triton"


def _decode_gluon(backend, q_lat, q_rot, content, rope, fmt, sink_content, sink_rope, recent_content, recent_rope,
                  page_table, rows, seq_lens, scaling, longest, num_splits):
    """One query token per request through the paged launch of Gluon kernel `backend`; `(o_lat [n, H, d_c], lse
    [n, H])`. Splits as the contiguous launch makes them for `n` rows of `longest` positions
    (`mla_decode.split_plan`)."""
    n, H, d_c = q_lat.shape
    if not planes_contiguous(fmt, content, rope):
        raise ValueError("the paged Gluon kernel needs contiguous page planes [P, 64, width]: use backend='triton'")
    for planes, path in ((content, fmt.content), (rope, fmt.rope)):
        words = planes["codes"].shape[0] * planes["codes"].shape[1] * path.code_bytes // 4
        if words >= 2**31:
            raise ValueError(f"the paged Gluon kernel addresses pool rows with int32 offsets; {words} code words "
                             "are more: use backend='triton'")
    sms = num_sms(q_lat.device.index or 0)
    block_m, launch = (regs.BLOCK_M, regs.launch_regs) if backend == "gluon_regs" else (wide.BLOCK_M, wide.launch_wide)
    target, NS = split_plan(backend, n, -(-H // block_m), longest, fmt, sms, num_splits)
    NSP = NS + copy_programs(fmt)
    o_part = torch.empty((n, H, NSP, d_c), dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty((n, H, NSP), dtype=torch.float32, device=q_lat.device)
    launch(q_lat.contiguous(), q_rot.contiguous(), content, rope, fmt, sink_content, sink_rope, recent_content,
           recent_rope, rows.to(torch.int32), seq_lens.to(torch.int32), o_part, lse_part, H, 1, target, NS,
           float(scaling) * LOG2E, page_table=page_table.to(torch.int32).contiguous())
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
    native = native_operands(fmt, q_lat.dtype, q_rot.dtype, copy_dtype)
    if not triton_handles(fmt, copy_dtype):
        raise ValueError(f"the paged Triton kernel does not take {fmt.name} (power-of-two widths, at most 8 content "
                         "groups and one RoPE group): use mla_decode_paged_ref")
    if Nq == 0:
        return (torch.empty((0, H, d_c), dtype=torch.float32, device=q_lat.device),
                torch.empty((0, H), dtype=torch.float32, device=q_lat.device))
    page_size = next(iter(content.values())).shape[1]
    choice = "triton" if interpreting() else select_paged_backend(fmt, H, n, Nq, page_size, copy_dtype, q_lat.device)
    backend = backend or choice
    if backend not in PAGED_BACKENDS:
        raise ValueError(f"backend must be one of {PAGED_BACKENDS}, got {backend!r}")
    if backend.startswith("gluon"):
        if choice == "triton" or (backend == "gluon_wide" and not wide.wide_handles(fmt)):
            raise ValueError(f"the paged {backend} kernel takes a decode step (one query token per request) of "
                             f"{fmt.name} in pages of {GLUON_BLOCK_T} tokens on sm_90 (wide: C4R4, C2R4, C8R8), got "
                             f"{Nq} tokens of {n} requests in pages of {page_size} on {q_lat.device}: use "
                             "backend='triton'")
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        return _decode_gluon(backend, q_lat, q_rot, content, rope, fmt, sink_content, sink_rope, recent_content,
                             recent_rope, page_table, rows, seq_lens, scaling, longest, num_splits)
    if token_request is None:
        counts = cu_seqlens_q[1:].long() - cu_seqlens_q[:-1].long()
        token_request = torch.repeat_interleave(torch.arange(n, device=q_lat.device), counts)
    S, R = sink_content.shape[1], recent_content.shape[1]
    bt = block_t or launch_shape(fmt, H)[0]
    longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    sms = num_sms(q_lat.device.index or 0) if q_lat.is_cuda else 8
    target = max(1, int(num_splits or split_target(Nq * triton.cdiv(H, block_rows(H)), sms)))
    NS = max(1, min(target, triton.cdiv(max(longest - R - S, 0), 2 * bt)))  # splits that can hold positions
    o_part = torch.empty((Nq, H, NS + 1, d_c), dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty((Nq, H, NS + 1), dtype=torch.float32, device=q_lat.device)
    # An empty copy tensor has no storage to point at: pass the queries (never read, the masks are all false).
    snc, snr, rcc, rcr = (t.contiguous() if t.numel() else q_lat
                          for t in (sink_content, sink_rope, recent_content, recent_rope))
    lens = seq_lens.to(torch.int32).contiguous()
    copies = dataclasses.replace(fmt, sink_tokens=S, recent_tokens=R)  # a 16-bit cache keeps no copies
    pages = tuple(t.to(torch.int32).contiguous() for t in (page_table, rows, cu_seqlens_q, token_request))
    launch_triton(q_lat.contiguous(), q_rot.contiguous(), content, rope, copies, snc, snr, rcc, rcr, lens, lens, o_part,
                  lse_part, H, 1, target, NS, float(scaling) * LOG2E, native=native, pages=pages, block_t=bt)
    return combine(o_part, lse_part, 1, None, sms)
