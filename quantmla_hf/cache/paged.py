"""`PagedQuantMLACache`: the QuantMLA latent cache in fixed-size pages shared by many requests.

Storage, per cache layer (one tensor per plane, pages along the first dimension):

    content planes   codes uint8 [P, page_size, d_c * bits / 8], scale fp16 [P, page_size, G], zero int8 [P, page_size, G]
                     (16 bits: values [P, page_size, d_c] in the model dtype)
    rope planes      the same for the RoPE key, `d_R` wide
    sink copies      [max_requests + 1, S, d_c] and [.., S, d_R] in the model dtype (quantized formats only)
    recent rings     [max_requests + 1, R, d_c] and [.., R, d_R] in the model dtype (position p in slot p % R)

(row `max_requests` of the copies is the scratch row: the padding tokens of captured decode steps,
`quantmla_hf.serving.graphs`, write and read it and nothing else),

A page is `page_size` consecutive tokens of one request; the bytes of one token inside a page are exactly those of
the contiguous cache (`quantmla_hf/format.py`: a page plane `[page_size, width]` is one row of the contiguous
`[B, capacity, width]` plane), so a page holds what `QuantMLACache` holds for those positions, bit for bit.
Token `p` of a request lives at page `page_table[p // page_size]`, slot `p % page_size`, i.e. at the flat index
`page * page_size + slot` of a plane viewed as `[P * page_size, width]`. Each running request also owns one row of
the sink/recent copies; at 16 bits (C16R16, the BF16-latent baseline) the pages already hold the model-dtype values
and no row is kept.

A forward over several requests goes through one `PagedStep`: `begin_step` reserves the pages of every request's
new tokens (all or nothing, `CacheBudgetExceeded` otherwise), `write` stores one layer's new latents, `history`
returns what stock attention reads, `end_step` advances the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import QuantMLAConfig
from ..format import SCALE_DTYPE, ZERO_DTYPE, CacheFormat, PathFormat
from ..kernels.quant_pack_ref import dequantize_ref, quantize_ref
from ..mla import mla_dims
from ..ops.decode import DecodeView, use_triton
from ..ops.write import paged_write, quantize_pack_slots
from .allocator import CacheBudgetExceeded, PageAllocator, pages_for_budget, protected_bytes_per_request


@dataclass
class PagedRequest:
    """One request's place in the cache: its pages in order, its sink/recent row and its cached length."""

    request_id: str
    row: int
    pages: list[int]
    length: int = 0
    _page_tensor: torch.Tensor | None = field(default=None, repr=False)

    def page_tensor(self) -> torch.Tensor:
        """`pages` as int32 `[len(pages)]` on the host, rebuilt only when pages were added (they only grow)."""
        if self._page_tensor is None or self._page_tensor.shape[0] != len(self.pages):
            self._page_tensor = torch.tensor(self.pages, dtype=torch.int32)
        return self._page_tensor


@dataclass
class PagedStep:
    """Index tensors of one forward over `n` requests with `N` new tokens in all (varlen, no padding).

    Attributes:
        request_ids: the requests, in batch order.
        past_lens, query_lens: tokens cached before the step and new tokens, per request.
        cu_seqlens_q: int32 `[n + 1]`, start of each request's new tokens in the flat `[N, ...]` inputs.
        cu_seqlens_k: int32 `[n + 1]`, start of each request's whole history (past + new) in `history` outputs.
        seq_lens: int32 `[n]`, past + new tokens per request.
        page_table: int32 `[n, max_pages]`, each request's pages (unused entries 0).
        rows: int32 `[n]`, each request's sink/recent row.
        token_request: int32 `[N]`, the request (batch index) of each new token.
        slots: int64 `[N]`, flat page slot of each new token (`page * page_size + p % page_size`).
        positions: int64 `[N]`, position of each new token in its request.
        sink_writes, recent_writes: int64 `[3, k]`, the new tokens that enter a sink or recent copy: token index,
            request row, slot in the copy (built on the host, so writing needs no device synchronisation).
        copy_rows: int64 `[2, N]`, the same per token, as flat rows of the copies: `row * S + p` of the sink
            copies and `row * R + p % R` of the recent rings, -1 where the token enters neither (the one-launch
            write of packed formats, `kernels/paged_write.py`).
    """

    request_ids: list[str]
    past_lens: list[int]
    query_lens: list[int]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    rows: torch.Tensor
    token_request: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    sink_writes: torch.Tensor
    recent_writes: torch.Tensor
    copy_rows: torch.Tensor
    # History gather (positions [0, past) of every request, in batch order) and where each row goes in the output;
    # built by `history` when first needed (decode steps read the pages through the page table instead).
    hist_slots: torch.Tensor | None = None
    hist_sink: torch.Tensor | None = None  # int64 [3, k]: history row, copy row, copy slot of each sink position
    hist_recent: torch.Tensor | None = None  # the same for the positions read from the recent rings
    hist_dst: torch.Tensor | None = None
    new_dst: torch.Tensor | None = None

    @property
    def max_seq_len(self) -> int:
        return max(p + q for p, q in zip(self.past_lens, self.query_lens))


class PagedQuantMLACache:
    """Paged QuantMLA latent cache of one model, shared by up to `max_requests` running requests.

    Args:
        config: the model's `PretrainedConfig` (any supported MLA family).
        quantization_config: a `QuantMLAConfig` (format, group size, sink and recent sizes, `advanced.kernel`).
        page_size: tokens per page.
        max_requests: requests that can hold a sink/recent row at once.
        num_pages: pages to allocate; or give `budget_bytes` and the pages that fit are computed
            (`allocator.pages_for_budget`: the sink/recent rows are paid first).
        dtype: the model's compute dtype. device: where the cache lives.
    """

    def __init__(
        self,
        config,
        quantization_config: QuantMLAConfig | None = None,
        page_size: int = 64,
        max_requests: int = 64,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        qc = quantization_config or getattr(config, "quantization_config", None) or QuantMLAConfig()
        if isinstance(qc, dict):
            qc = QuantMLAConfig.from_dict(qc)
        if qc.transform == "hadamard":
            raise ValueError(
                "the paged cache does not apply the online RoPE rotation of transform='hadamard'; serve a model "
                "quantized with transform='learned' or 'none'"
            )
        if page_size < 1 or max_requests < 1:
            raise ValueError(f"page_size and max_requests must be >= 1, got {page_size} and {max_requests}")
        self.quantization_config = qc
        self.dims = mla_dims(config)
        self.format = CacheFormat.from_config(self.dims.kv_lora_rank, self.dims.rope_dim, qc)
        self.num_layers = self.dims.num_cache_layers
        self.page_size, self.max_requests = page_size, max_requests
        self.dtype, self.device = dtype, torch.device(device)
        self.kernel = qc.advanced.kernel
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_pages and budget_bytes")
        if num_pages is None:
            num_pages = pages_for_budget(budget_bytes, self.format, self.num_layers, page_size, max_requests + 1,
                                         dtype)
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self.protected = self.format.content.quantized or self.format.rope.quantized
        self.content = [self._planes(self.format.content) for _ in range(self.num_layers)]
        self.rope = [self._planes(self.format.rope) for _ in range(self.num_layers)]
        S, R = (self.format.sink_tokens, self.format.recent_tokens) if self.protected else (0, 0)
        self.sink_tokens, self.recent_tokens = S, R

        def dense(n: int, d: int) -> list[torch.Tensor]:
            return [torch.zeros((max_requests + 1 if n else 0, n, d), dtype=dtype, device=self.device)
                    for _ in range(self.num_layers)]

        self.sink_content, self.sink_rope = dense(S, self.format.content.dim), dense(S, self.format.rope.dim)
        self.recent_content, self.recent_rope = dense(R, self.format.content.dim), dense(R, self.format.rope.dim)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.scratch_row = max_requests  # never given to a request
        self.requests: dict[str, PagedRequest] = {}

    def _planes(self, fmt: PathFormat) -> dict[str, torch.Tensor]:
        shape = (self.num_pages, self.page_size)
        if not fmt.quantized:
            return {"values": torch.zeros((*shape, fmt.dim), dtype=self.dtype, device=self.device)}
        return {
            "codes": torch.zeros((*shape, fmt.code_bytes), dtype=torch.uint8, device=self.device),
            "scale": torch.ones((*shape, fmt.n_groups), dtype=SCALE_DTYPE, device=self.device),
            "zero": torch.zeros((*shape, fmt.n_groups), dtype=ZERO_DTYPE, device=self.device),
        }

    # ---- budget -----------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the cache holds: every page plane and every sink/recent row."""
        tensors = [t for layer in self.content + self.rope for t in layer.values()]
        tensors += self.sink_content + self.sink_rope + self.recent_content + self.recent_rope
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def free_rows(self) -> int:
        """Request rows free: each running request holds one (its sink/recent copies; at 16 bits just its place)."""
        return len(self._free_rows)

    def capacity_tokens(self) -> int:
        """Tokens the pages hold in all (over every request)."""
        return self.num_pages * self.page_size

    def pages_needed(self, request_id: str | None, new_tokens: int) -> int:
        """Pages a request (None: a new one) must add to cache `new_tokens` more tokens."""
        req = self.requests.get(request_id) if request_id is not None else None
        length, held = (req.length, len(req.pages)) if req is not None else (0, 0)
        return max(0, -(-(length + new_tokens) // self.page_size) - held)

    def can_admit(self, request_id: str, new_tokens: int) -> bool:
        """True when `new_tokens` more tokens of the request (new or running) fit right now."""
        new_row = request_id not in self.requests
        if new_row and not self._free_rows:
            return False
        return self.allocator.can_allocate(self.pages_needed(request_id, new_tokens))

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str) -> PagedRequest:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the cache")
        if not self._free_rows:
            raise CacheBudgetExceeded(
                f"all {self.max_requests} request rows are taken: finish a request first or build the cache with a "
                "larger max_requests"
            )
        req = PagedRequest(request_id, self._free_rows.pop(), [])
        self.requests[request_id] = req
        return req

    def free_request(self, request_id: str) -> None:
        """Return a request's pages and row (finished, cancelled or preempted)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request {request_id!r} is not in the cache")
        self.allocator.free(req.pages)
        self._free_rows.append(req.row)

    def get_seq_length(self, request_id: str) -> int:
        return self.requests[request_id].length

    # ---- one forward ------------------------------------------------------------------------------------------
    def begin_step(self, request_ids: list[str], query_lens: list[int]) -> PagedStep:
        """Reserve pages for `query_lens[i]` new tokens of each request (added if new); build the step's indices.

        All or nothing: raises `CacheBudgetExceeded` with nothing allocated when the pages or rows do not fit.
        """
        if len(request_ids) != len(query_lens) or len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be distinct and as many as query_lens")
        if any(q < 1 for q in query_lens):
            raise ValueError(f"every request needs at least one new token, got {query_lens}")
        new_rows = sum(rid not in self.requests for rid in request_ids)
        need = sum(self.pages_needed(rid, q) for rid, q in zip(request_ids, query_lens))
        if new_rows > len(self._free_rows) or not self.allocator.can_allocate(need):
            raise CacheBudgetExceeded(
                f"this step needs {need} pages and {new_rows} request rows; {self.allocator.num_free} pages and "
                f"{len(self._free_rows)} rows are free: run fewer requests at once or free some"
            )
        reqs = []
        for rid, q in zip(request_ids, query_lens):
            req = self.requests.get(rid) or self.add_request(rid)
            req.pages += self.allocator.allocate(self.pages_needed(rid, q))
            reqs.append(req)
        return self._build_step(reqs, query_lens)

    def _build_step(self, reqs: list[PagedRequest], query_lens: list[int]) -> PagedStep:
        """The step's index tensors, built on the host and moved to the device in two copies (one of the int32
        indices, one of the int64 ones): every synchronous host-to-device copy waits for the stream."""
        ps, n = self.page_size, len(reqs)
        past = [r.length for r in reqs]
        seq = [p + q for p, q in zip(past, query_lens)]
        max_pages = max(len(r.pages) for r in reqs)
        table = _host_page_table(reqs, max_pages)
        cu_q = torch.tensor([0] + query_lens).cumsum(0)
        cu_k = torch.tensor([0] + seq).cumsum(0)
        token_request = torch.repeat_interleave(torch.arange(n), torch.tensor(query_lens))
        positions = torch.cat([torch.arange(p, s) for p, s in zip(past, seq)])
        slots = table.long()[token_request, positions // ps] * ps + positions % ps
        S, R = self.sink_tokens, self.recent_tokens
        sink, recent, start = [], [], 0
        for r, p, q in zip(reqs, past, query_lens):
            # Sink: positions below S. Recent: the last R positions of the chunk (earlier ones would be overwritten).
            sink += [(start + t - p, r.row, t) for t in range(p, min(p + q, S))]
            recent += [(start + t - p, r.row, t % R) for t in range(max(p, p + q - R), p + q)] if R else []
            start += q
        writes = [torch.tensor(w, dtype=torch.long).reshape(-1, 3).T.reshape(-1) for w in (sink, recent)]
        copy_rows = torch.full((2, start), -1, dtype=torch.long)
        for k, (w, size) in enumerate(((sink, S), (recent, R))):
            if w:
                tok, row, slot = torch.tensor(w, dtype=torch.long).T
                copy_rows[k, tok] = row * size + slot
        int32 = torch.cat([cu_q, cu_k, torch.tensor(seq), torch.tensor([r.row for r in reqs]), token_request,
                           table.view(-1)]).to(torch.int32).to(self.device)
        int64 = torch.cat([slots, positions, *writes, copy_rows.view(-1)]).to(self.device)
        cu_q, cu_k, seq_lens, rows, token_request, table = int32.split([n + 1, n + 1, n, n, start, n * max_pages])
        slots, positions, sink_w, recent_w, copy_rows = int64.split(
            [start, start, len(writes[0]), len(writes[1]), 2 * start])
        return PagedStep(
            request_ids=[r.request_id for r in reqs], past_lens=past, query_lens=list(query_lens),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_lens=seq_lens, page_table=table.view(n, max_pages), rows=rows,
            token_request=token_request, slots=slots, positions=positions, sink_writes=sink_w.view(3, -1),
            recent_writes=recent_w.view(3, -1), copy_rows=copy_rows.view(2, -1),
        )

    def _ensure_history(self, step: PagedStep) -> None:
        """Fill the step's history-gather indices (positions `[0, past)` of each request, in batch order), built on the
        host and moved to the device in one copy."""
        if step.hist_slots is not None:
            return
        ps, dev, past = self.page_size, self.device, step.past_lens
        n = len(past)
        reqs = [self.requests[rid] for rid in step.request_ids]  # the host's copy of the step's pages and rows
        pages = _host_page_table(reqs, step.page_table.shape[1]).long()
        token_request = torch.repeat_interleave(torch.arange(n), torch.tensor(step.query_lens))
        offsets = torch.tensor([0] + [p + q for p, q in zip(past, step.query_lens)]).cumsum(0)[:-1]
        hist_req = torch.repeat_interleave(torch.arange(n), torch.tensor(past))
        hist_pos = torch.cat([torch.arange(p) for p in past]) if sum(past) else torch.zeros(0, dtype=torch.long)
        rows = torch.tensor([r.row for r in reqs])[hist_req]
        hist_slots = pages[hist_req, hist_pos // ps] * ps + hist_pos % ps
        # Which history rows come from the model-dtype copies, chosen here on the host: a boolean mask on the device
        # would make every layer wait for it (`nonzero`). Recent positions are written after sink ones (they win
        # where both hold a position; the values are the same copies).
        S, R = self.sink_tokens, self.recent_tokens
        total = torch.tensor([p + q for p, q in zip(past, step.query_lens)])[hist_req]

        def copy_rows(sel, slot):
            idx = sel.nonzero().flatten()
            return torch.stack([idx, rows[idx], slot[idx]]).reshape(-1)

        hist_sink = copy_rows(hist_pos < S, hist_pos)  # none when S = 0
        hist_recent = copy_rows(hist_pos >= total - R, hist_pos % max(R, 1))  # none when R = 0
        hist_dst = offsets[hist_req] + hist_pos
        new_dst = offsets[token_request] + query_offsets(step.query_lens) + torch.tensor(past)[token_request]
        parts = (hist_slots, hist_sink, hist_recent, hist_dst, new_dst)
        flat = torch.cat(parts).to(dev).split([p.numel() for p in parts])
        step.hist_slots, step.hist_dst, step.new_dst = flat[0], flat[3], flat[4]
        step.hist_sink, step.hist_recent = flat[1].view(3, -1), flat[2].view(3, -1)

    def sub_step(self, step: PagedStep, indices: list[int]) -> PagedStep:
        """The step restricted to the requests at `indices` (batch order), before `end_step`."""
        reqs = [self.requests[step.request_ids[i]] for i in indices]
        return self._build_step(reqs, [step.query_lens[i] for i in indices])

    def end_step(self, step: PagedStep) -> None:
        """Count the step's tokens as cached (after every layer was written)."""
        for rid, q in zip(step.request_ids, step.query_lens):
            self.requests[rid].length += q

    def decode_view(self, layer_idx: int, step: PagedStep) -> DecodeView:
        """What the latent-space decode reads of layer `layer_idx` for the requests of `step` (`ops.decode`)."""
        return DecodeView(
            self.format, self.content[layer_idx], self.rope[layer_idx], self.sink_content[layer_idx],
            self.sink_rope[layer_idx], self.recent_content[layer_idx], self.recent_rope[layer_idx], self.kernel,
            page_table=step.page_table, rows=step.rows, cu_seqlens_q=step.cu_seqlens_q, seq_lens=step.seq_lens,
            token_request=step.token_request, max_seq_len=step.max_seq_len,
        )

    @property
    def one_launch_write(self) -> bool:
        """Whether `write` stores a layer's new tokens in one launch (`kernels/paged_write.py`, reading
        `PagedStep.copy_rows`): the Triton kernels with both paths packed. Otherwise each path is written apart and
        the copies from `sink_writes` / `recent_writes`."""
        return use_triton(self.kernel, self.device) and self.format.content.quantized and self.format.rope.quantized

    def _write_path(self, planes: dict[str, torch.Tensor], fmt: PathFormat, x: torch.Tensor, slots: torch.Tensor):
        flat = {k: v.view(-1, v.shape[-1]) for k, v in planes.items()}
        if not fmt.quantized:
            flat["values"].index_copy_(0, slots, x.to(self.dtype))
            return
        if use_triton(self.kernel, self.device):
            x = x if x.stride(-1) == 1 else x.contiguous()  # rows may be strided (a slice of the projection)
            quantize_pack_slots(x, flat["codes"], flat["scale"], flat["zero"], slots, fmt)
            return
        codes, scale, zero = quantize_ref(x, fmt)
        flat["codes"].index_copy_(0, slots, codes)
        flat["scale"].index_copy_(0, slots, scale)
        flat["zero"].index_copy_(0, slots, zero)

    def write(self, layer_idx: int, step: PagedStep, latent: torch.Tensor, k_rot: torch.Tensor) -> None:
        """Store one layer's new tokens: `latent: [N, d_c]`, `k_rot: [N, d_R]` in the step's token order."""
        if latent.shape != (step.slots.shape[0], self.format.content.dim) or k_rot.shape != (
            step.slots.shape[0], self.format.rope.dim
        ):
            raise ValueError(
                f"expected latent [{step.slots.shape[0]}, {self.format.content.dim}] and k_rot "
                f"[{step.slots.shape[0]}, {self.format.rope.dim}], got {tuple(latent.shape)} and {tuple(k_rot.shape)}"
            )
        if self.one_launch_write:  # both paths and the copies in one launch (what the rest does in up to ten)
            copies = (self.sink_content[layer_idx], self.sink_rope[layer_idx], self.recent_content[layer_idx],
                      self.recent_rope[layer_idx])
            c, r = (x if x.stride(-1) == 1 else x.contiguous() for x in (latent, k_rot))
            paged_write(c, r, self.content[layer_idx], self.rope[layer_idx], step.slots, copies, step.copy_rows,
                        self.format)
            return
        self._write_path(self.content[layer_idx], self.format.content, latent, step.slots)
        self._write_path(self.rope[layer_idx], self.format.rope, k_rot, step.slots)
        for (content, rope), (tok, row, slot) in (
            ((self.sink_content, self.sink_rope), step.sink_writes),
            ((self.recent_content, self.recent_rope), step.recent_writes),
        ):
            if tok.numel():
                content[layer_idx][row, slot] = latent[tok].to(self.dtype)
                rope[layer_idx][row, slot] = k_rot[tok].to(self.dtype)

    def _read_path(self, planes: dict[str, torch.Tensor], fmt: PathFormat, slots: torch.Tensor) -> torch.Tensor:
        flat = {k: v.view(-1, v.shape[-1]) for k, v in planes.items()}
        if not fmt.quantized:
            return flat["values"][slots]
        return dequantize_ref(flat["codes"][slots], flat["scale"][slots], flat["zero"][slots], fmt, self.dtype)

    def _past(self, layer_idx: int, step: PagedStep, planes, fmt, sink, recent) -> torch.Tensor:
        """Positions `[0, past)` of every request as attention sees them after the step: `[sum(past), dim]`."""
        x = self._read_path(planes[layer_idx], fmt, step.hist_slots)
        for copies, (idx, row, slot) in ((sink, step.hist_sink), (recent, step.hist_recent)):
            if idx.numel():
                x[idx] = copies[layer_idx][row, slot]
        return x

    def history(
        self, layer_idx: int, step: PagedStep, latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What stock attention reads after `write`: `[sum(seq_lens), d_c]`, `[sum(seq_lens), d_R]`, request by
        request (offsets `cu_seqlens_k`), the step's own tokens exactly as given (`latent`, `k_rot`), older sink and
        recent positions from their model-dtype copies and the rest dequantized from the pages."""
        self._ensure_history(step)
        total = sum(step.past_lens) + sum(step.query_lens)
        out = []
        for planes, fmt, sink, recent, new in (
            (self.content, self.format.content, self.sink_content, self.recent_content, latent),
            (self.rope, self.format.rope, self.sink_rope, self.recent_rope, k_rot),
        ):
            x = torch.empty((total, fmt.dim), dtype=new.dtype, device=new.device)
            x[step.hist_dst] = self._past(layer_idx, step, planes, fmt, sink, recent).to(new.dtype)
            x[step.new_dst] = new
            out.append(x)
        return out[0], out[1]

    def request_planes(self, layer_idx: int, request_id: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One request's packed planes gathered into the contiguous layout, `[1, length, width]` each (for checks
        against `QuantMLACache` and for debugging; attention reads the pages in place)."""
        req = self.requests[request_id]
        pos = torch.arange(req.length, device=self.device)
        pages = torch.tensor(req.pages, dtype=torch.long, device=self.device)
        slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        return tuple(
            {k: v.view(-1, v.shape[-1])[slots].unsqueeze(0) for k, v in planes[layer_idx].items()}
            for planes in (self.content, self.rope)
        )

    def __repr__(self) -> str:
        return (f"PagedQuantMLACache({self.format.name}, {self.num_layers} layers, {self.num_pages} pages x "
                f"{self.page_size} tokens, {self.allocator.num_used} used, {len(self.requests)} requests)")


def _host_page_table(reqs: list[PagedRequest], width: int) -> torch.Tensor:
    """The requests' pages as an int32 `[len(reqs), width]` host table, unused entries 0."""
    table = torch.zeros((len(reqs), width), dtype=torch.int32)
    for i, r in enumerate(reqs):
        table[i, : len(r.pages)] = r.page_tensor()
    return table


def query_offsets(query_lens: list[int]) -> torch.Tensor:
    """Index of each new token within its request's chunk, `[sum(query_lens)]`."""
    return torch.cat([torch.arange(q) for q in query_lens])


__all__ = ["CacheBudgetExceeded", "PagedQuantMLACache", "PagedRequest", "PagedStep", "protected_bytes_per_request"]
