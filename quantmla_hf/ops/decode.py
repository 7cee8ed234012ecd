"""The one decode entry: a cache layer's `DecodeView` and the queries in, the latent-space attention out.

Every cache hands the decode the same view of one layer (`DecodeView`): its packed planes (contiguous
`[B, capacity, .]`, or page pools `[P, page_size, .]` with a page table), the model-dtype sink and recent copies,
the lengths on the device, the online RoPE rotation of the Hadamard baseline and the kernel choice. `decode` then
picks the code that runs, in one place:

    the Triton/Gluon kernels or the PyTorch reference   `use_triton` (the config's `kernel`, the device)
    which kernel                                          `backends.select_backend` / `select_paged_backend`
    the custom-op boundary                                only inside `torch.compile` (`mla_decode`, below)

and `native_chunk` states which chunks take this path at all (the rest are prefills: SDPA over the history).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from ..format import CacheFormat, PathFormat
from ..kernels.mla_decode_ref import mla_decode_paged_ref, mla_decode_static_ref

if importlib.util.find_spec("triton") is not None:
    from . import backends
else:  # Triton is a dependency on Linux only (pyproject.toml): without it the decode runs its PyTorch references
    backends = None

# Longest query chunk the latent-space decode takes; longer chunks (prefill) expand heads and use SDPA.
NATIVE_MAX_QUERY = 16


def native_chunk(query_len: int, recent_tokens: int) -> bool:
    """Whether a chunk of `query_len` new tokens is stored only and attended in the latent space straight from the
    cache: at most `NATIVE_MAX_QUERY` tokens, all inside the recent window (the decode reads every new token from
    its model-dtype recent copy). Every cache and the decode-graph plans ask this."""
    return query_len <= min(NATIVE_MAX_QUERY, recent_tokens)


def use_triton(kernel: str, device: torch.device) -> bool:
    """Whether the Triton (and Gluon) kernels run for `QuantMLAConfig(advanced={"kernel": ...})` on `device`: "triton" always
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
            o, lse = backends.mla_decode_paged(*args, token_request=view.token_request, max_seq_len=view.max_seq_len)
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
    return decode_contiguous(q_lat, q_rot, view.content, view.rope, view.fmt, view.sink_content, view.sink_rope,
                             view.recent_content, view.recent_rope, view.left_padding, view.length, view.capacity,
                             scaling, triton)


def decode_contiguous(
    q_lat: torch.Tensor, q_rot: torch.Tensor, content_planes: dict[str, torch.Tensor],
    rope_planes: dict[str, torch.Tensor], fmt: CacheFormat, sink_c: torch.Tensor, sink_r: torch.Tensor,
    recent_c: torch.Tensor, recent_r: torch.Tensor, left_padding: torch.Tensor, length: torch.Tensor, capacity: int,
    scaling: float, triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode of a contiguous cache: `backends.mla_decode_static` (its `select_backend` picks the kernel), or the
    PyTorch reference where `triton` is False. The first `length` (int64 `[1]` on the device) positions of planes
    `[B, capacity, .]`; `(o_lat [B, H, Tq, d_c], lse [B, H, Tq])` fp32, no host synchronisation. The growing and the
    static cache, eager, captured or compiled (`mla_decode`), all run this: the same kernel and split boundaries,
    bit for bit."""
    args = (q_lat, q_rot, content_planes, rope_planes, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length,
            capacity, scaling)
    return backends.mla_decode_static(*args) if triton else mla_decode_static_ref(*args)


# ---------------------------------------------------------------------------------------------- the op boundary
# `torch.compile(fullgraph=True)` traces a decode step without graph breaks through one custom op (namespace
# `quantmla`, as `write.quant_append`):
#
#     torch.ops.quantmla.mla_decode(q_lat, q_rot, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r,
#                                   left_padding, length, capacity, scaling, c_bits, c_group, r_bits, r_group,
#                                   sink_tokens, recent_tokens, use_triton) -> (o_lat [B, H, Tq, d_c], lse [B, H, Tq])
#
# A quantized path passes its `codes, scale, zero` planes, a 16-bit path its `values` plane as `codes` and empty
# tensors for scale and zero; the format is rebuilt from the ints (`cache_format`). The fake implementation gives the
# output shapes, and the outputs are fresh tensors (no aliasing), as `torch.library.opcheck` requires.

@functools.lru_cache(maxsize=None)
def cache_format(c_dim: int, c_bits: int, c_group: int, r_dim: int, r_bits: int, r_group: int, sink: int,
                 recent: int) -> CacheFormat:
    """The `CacheFormat` the op rebuilds from its int arguments (cached: one object per format)."""
    return CacheFormat(PathFormat(c_dim, c_bits, c_group), PathFormat(r_dim, r_bits, r_group), sink, recent)


def _planes(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    return {"values": p0} if bits == 16 else {"codes": p0, "scale": p1, "zero": p2}


@torch.library.custom_op("quantmla::mla_decode", mutates_args=())
def mla_decode(
    q_lat: torch.Tensor, q_rot: torch.Tensor,
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, r0: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
    sink_c: torch.Tensor, sink_r: torch.Tensor, recent_c: torch.Tensor, recent_r: torch.Tensor,
    left_padding: torch.Tensor, length: torch.Tensor, capacity: int, scaling: float,
    c_bits: int, c_group: int, r_bits: int, r_group: int, sink_tokens: int, recent_tokens: int, use_triton: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = cache_format(q_lat.shape[-1], c_bits, c_group, q_rot.shape[-1], r_bits, r_group, sink_tokens,
                       recent_tokens)
    return decode_contiguous(q_lat, q_rot, _planes(c0, c1, c2, c_bits), _planes(r0, r1, r2, r_bits), fmt, sink_c,
                             sink_r, recent_c, recent_r, left_padding, length, capacity, scaling, use_triton)


@mla_decode.register_fake
def _(q_lat, q_rot, c0, c1, c2, r0, r1, r2, sink_c, sink_r, recent_c, recent_r, left_padding, length, capacity,
      scaling, c_bits, c_group, r_bits, r_group, sink_tokens, recent_tokens, use_triton):
    B, H, Tq, d_c = q_lat.shape
    return q_lat.new_empty((B, H, Tq, d_c), dtype=torch.float32), q_lat.new_empty((B, H, Tq), dtype=torch.float32)
