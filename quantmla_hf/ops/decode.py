"""The one decode entry: a cache layer's `DecodeView` and the queries in, the latent-space attention out.

Every cache hands the decode the same view of one layer (`DecodeView`): its packed planes (contiguous
`[B, capacity, .]`, or page pools `[P, page_size, .]` with a page table), the model-dtype sink and recent copies,
the lengths on the device, the online RoPE rotation of the Hadamard baseline and the kernel choice. `decode` then
picks the code that runs, in one place:

    the Triton/Gluon kernels or the PyTorch reference   `use_triton` (the config's `kernel`, the device)
    which kernel                                          `backends.select_backend` / `select_paged_backend`
    the custom-op boundary                                only inside `torch.compile` (`custom.mla_decode`)

and `native_chunk` states which chunks take this path at all (the rest are prefills: SDPA over the history).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..format import CacheFormat
from ..kernels.mla_decode_ref import mla_decode_paged_ref
from . import custom

# Longest query chunk the latent-space decode takes; longer chunks (prefill) expand heads and use SDPA.
NATIVE_MAX_QUERY = 16


def native_chunk(query_len: int, recent_tokens: int) -> bool:
    """Whether a chunk of `query_len` new tokens is stored only and attended in the latent space straight from the
    cache: at most `NATIVE_MAX_QUERY` tokens, all inside the recent window (the decode reads every new token from
    its model-dtype recent copy). Every cache and the decode-graph plans ask this."""
    return query_len <= min(NATIVE_MAX_QUERY, recent_tokens)


def use_triton(kernel: str, device: torch.device) -> bool:
    """Whether the Triton (and Gluon) kernels run for `QuantMLAConfig(kernel=...)` on `device`: "triton" always
    (off CUDA only in the Triton interpreter), "torch" never, "auto" on CUDA."""
    if kernel == "torch":
        return False
    if kernel == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"kernel='triton' runs the Triton kernels, which need a CUDA GPU, but the cache is on {device}; use "
                "kernel='auto' (Triton on CUDA, PyTorch elsewhere) or kernel='torch', or move the model to a GPU"
            )
        return True
    return device.type == "cuda"


@dataclass
class DecodeView:
    """One cache layer as the decode reads it (no copies: the cache's own tensors).

    Attributes:
        fmt: the cache format (bits, groups, `sink_tokens` S, `recent_tokens` R).
        content, rope: the planes of each path (`codes/scale/zero`, or `values` at 16 bits), `[B, capacity, .]`
            for a contiguous cache, `[P, page_size, .]` page pools for the paged one.
        sink_content, sink_rope, recent_content, recent_rope: model-dtype copies, `[rows, S, d]` and `[rows, R, d]`
            (the recent ring holds position p in slot p % R).
        kernel: "auto", "triton" or "torch" (`use_triton`).
        rope_rotation: `[d_R, d_R]` online rotation of the stored RoPE keys (Hadamard baseline), or None.
        left_padding, length, capacity: contiguous caches: `[B]` int64, int64 `[1]` on the device (positions held;
            the queries are the last ones), and the static number of positions the planes hold.
        page_table, rows, cu_seqlens_q, seq_lens, token_request, max_seq_len: the paged cache's step (see
            `cache.paged.PagedStep`): int32 `[n, pages]`, `[n]`, `[n + 1]`, `[n]`, `[Nq]`, and the longest length
            (fixes the grid).
    """

    fmt: CacheFormat
    content: dict
    rope: dict
    sink_content: torch.Tensor
    sink_rope: torch.Tensor
    recent_content: torch.Tensor
    recent_rope: torch.Tensor
    kernel: str = "auto"
    rope_rotation: torch.Tensor | None = None
    left_padding: torch.Tensor | None = None
    length: torch.Tensor | None = None
    capacity: int = 0
    page_table: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    token_request: torch.Tensor | None = None
    max_seq_len: int | None = None

    @property
    def paged(self) -> bool:
        return self.page_table is not None


def decode(view: DecodeView, q_lat: torch.Tensor, q_rot: torch.Tensor, scaling: float):
    """Absorbed attention of the queries over everything `view` holds, with no host synchronisation.

    `q_lat: [B, H, Tq, d_c]` (W_UK absorbed) and `q_rot: [B, H, Tq, d_R]` (rotated like the stored keys); a paged
    view takes its `Nq` query tokens as `[1, H, Nq, .]`. Returns `(o_lat [B, H, Tq, d_c], lse [B, H, Tq])`, fp32.
    """
    triton = use_triton(view.kernel, q_lat.device)
    if view.paged:
        q, qr = q_lat[0].transpose(0, 1), q_rot[0].transpose(0, 1)  # [Nq, H, d]
        args = (q, qr, view.content, view.rope, view.fmt, view.sink_content, view.sink_rope, view.recent_content,
                view.recent_rope, view.page_table, view.rows, view.cu_seqlens_q, view.seq_lens, scaling)
        if triton:
            o, lse = custom.mla_decode_paged(*args, token_request=view.token_request, max_seq_len=view.max_seq_len)
        else:
            o, lse = mla_decode_paged_ref(*args)
        return o.transpose(0, 1)[None], lse.transpose(0, 1)[None]
    if torch.compiler.is_compiling():  # the op boundary: one opaque call for dynamo
        f = view.fmt
        c, r = view.content, view.rope
        empty = q_lat.new_empty(0, dtype=torch.uint8)
        c0, c1, c2 = (c["values"], empty, empty) if f.content.bits == 16 else (c["codes"], c["scale"], c["zero"])
        r0, r1, r2 = (r["values"], empty, empty) if f.rope.bits == 16 else (r["codes"], r["scale"], r["zero"])
        return torch.ops.quantmla.mla_decode(
            q_lat.contiguous(), q_rot.contiguous(), c0, c1, c2, r0, r1, r2, view.sink_content, view.sink_rope,
            view.recent_content, view.recent_rope, view.left_padding, view.length, view.capacity, float(scaling),
            f.content.bits, f.content.group, f.rope.bits, f.rope.group, f.sink_tokens, f.recent_tokens, triton,
        )
    return custom.decode_contiguous(q_lat, q_rot, view.content, view.rope, view.fmt, view.sink_content,
                                    view.sink_rope, view.recent_content, view.recent_rope, view.left_padding,
                                    view.length, view.capacity, scaling, triton)
