"""`StaticQuantMLACache`: the QuantMLA cache with every buffer preallocated, for compiled, graph-captured decode.

Same content and byte layout as `QuantMLACache` (`quantmla_hf/cache/growing.py`, `quantmla_hf/format.py`), but per layer
- the packed planes hold `max_cache_len` positions from the first write on (`[B, max_cache_len, .]`), and the sink
  `[B, S, d]`, recent `[B, R, d]` and left-padding `[B]` buffers never move: every write is in place, so their
  addresses stay fixed (marked static for `torch.compile`/CUDA graphs) until the cache grows (below);
- the number of cached positions lives on the device, `cumulative_length: int64 [1]`, with a host-side copy kept
  without synchronising (eager steps count, `advance_host_length` counts replayed ones; after compiled steps it is
  read back once when needed).

A decode step (a chunk of at most `min(16, recent_tokens)` tokens through the "quantmla" attention) then has no
host synchronisation and no data-dependent shape: the new tokens are quantized and written at the device-side
position (`torch.ops.quantmla.quant_append`), copied into the sink slots they fall in and into the recent ring
(`index_copy_`), and attention reads the length and left padding on the device (`torch.ops.quantmla.mla_decode`,
grid and splits fixed by `max_cache_len`). Sink writes stop once every row's sink is written (`sink_written`, a
host-side answer). `is_compileable = True`: plain `generate` replays the step from CUDA graphs
(`quantmla_hf.generation.graphs`), or compiles it when asked (`compile_config`); the prefill stays eager (longer chunks
take the `QuantMLACache` path, which may synchronise).

Masks: `get_mask_sizes` reports `max_cache_len` key positions for decode chunks, so the 4D mask that `generate`
builds keeps one shape for the whole generation (prefill chunks get the exact length, as with `QuantMLACache`). An
eager step checks that the mask is left padding + causal (one synchronisation per layer) and falls back to the exact
path otherwise; a compiled step trusts it; a step captured in a CUDA graph (`quantmla_hf.generation.graphs`) runs inside
`host_checked_steps()`, after the caller validated the mask and the room left once, on the host.

Sizes: `cache_length_bucket(n)` rounds a number of positions up to a bucket (multiples of 256 up to 4096, then 16
buckets per power of two, at most 6.25% slack). A cache built with `length_limit` above its `max_cache_len` grows
in place (`grow`, to the bucket of twice its length, at most the limit) when a write would pass its end; the
buffers then move, so compiled or captured steps of the old buffers are dropped (`buffers_version`).
"""

from __future__ import annotations

import contextlib

import torch

from ..format import CacheFormat
from ..ops import write  # noqa: F401  (registers torch.ops.quantmla.quant_append)
from ..ops.decode import DecodeView, native_chunk, use_triton
from .growing import QuantMLACache, QuantMLALayer

BUCKET_MIN = 256
BUCKETS_PER_OCTAVE = 16


def cache_length_bucket(n: int) -> int:
    """The capacity a static cache gets for `n` positions: a multiple of 256 up to 4096, then of
    `2**floor(log2 n) / 16` (16 buckets per power of two: at most 6.25% slack). E.g. 4162 -> 4352, 32834 -> 34816."""
    if n <= 0:
        raise ValueError(f"a static cache needs a positive number of positions, got {n}")
    step = max(BUCKET_MIN, (1 << (int(n).bit_length() - 1)) // BUCKETS_PER_OCTAVE)
    return -(-int(n) // step) * step


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _mark_static(t: torch.Tensor) -> None:
    if not _is_compiling():
        torch._dynamo.mark_static_address(t)


class StaticQuantMLALayer(QuantMLALayer):
    """One MLA layer of a `StaticQuantMLACache`.

    Args:
        fmt: cache format; `recent_tokens` must be at least 1 (decode steps write through the recent window).
        max_cache_len: positions the planes hold (prompt + generated tokens, left padding included).
        kernel: "auto", "triton" or "torch" (see `QuantMLAConfig.advanced.kernel`).
        rope_rotation: optional `[d_R, d_R]` online rotation of the RoPE key (Hadamard baseline).
    """

    is_compileable = True
    buffers_moved = False  # set when a batch change reallocated the buffers (`StaticQuantMLACache.moved_buffers`)

    def __init__(self, fmt: CacheFormat, max_cache_len: int, kernel: str = "auto",
                 rope_rotation: torch.Tensor | None = None):
        if max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        if fmt.recent_tokens < 1:
            raise ValueError(
                "a static QuantMLA cache needs recent_tokens >= 1 (each decode step is written through the recent "
                "window); use QuantMLACache for recent_tokens=0"
            )
        self.max_cache_len = max_cache_len
        self.cumulative_length = torch.zeros(1, dtype=torch.long)
        self._host_length = 0
        self._host_stale = False
        # Set by `StaticQuantMLACache.host_checked_steps`: the caller checked the mask and the room left on the host,
        # so a step skips its synchronising checks (a CUDA graph capture cannot synchronise).
        self.host_checked = False
        self.make_room = None  # set by StaticQuantMLACache: grows every layer (within its length_limit)
        super().__init__(fmt, kernel, block_size=max_cache_len, rope_rotation=rope_rotation)

    # The host-side length is derived from the device counter after compiled steps (one synchronisation, outside
    # the decode step: crop, read_history, nbytes...). Writes keep both in step.
    @property
    def length(self) -> int:
        if self._host_stale:
            self._host_length = int(self.cumulative_length.item())
            self._host_stale = False
        return self._host_length

    @length.setter
    def length(self, value: int) -> None:
        self._host_length = int(value)
        self._host_stale = False
        self.cumulative_length.fill_(int(value))

    def _clear(self) -> None:
        super()._clear()
        self.has_tokens = False

    def lazy_initialization(self, latent: torch.Tensor, k_rot: torch.Tensor) -> None:
        super().lazy_initialization(latent, k_rot)
        for store in (self.content, self.rope):
            store.reserve(self.max_cache_len, 0)
            for plane in store.planes.values():
                plane.zero_()
        self.cumulative_length = torch.zeros(1, dtype=torch.long, device=self.device)
        self.left_padding = self.left_padding.to(torch.long).contiguous()
        self._mark_all_static()

    def _buffers(self) -> list[torch.Tensor]:
        return [*self.content.planes.values(), *self.rope.planes.values(), self.sink_content, self.sink_rope,
                self.recent_content, self.recent_rope, self.left_padding, self.cumulative_length]

    def _mark_all_static(self) -> None:
        for t in self._buffers():
            _mark_static(t)

    def set_left_padding(self, left_padding: torch.Tensor) -> None:
        if self.is_initialized and self.has_tokens:
            raise ValueError("left padding can only be set before the first tokens are cached; call reset() first")
        if not self.is_initialized:
            self.pending_padding = left_padding.to(torch.long)
            return
        if left_padding.shape != self.left_padding.shape:
            raise ValueError(
                f"the attention mask given to set_left_padding has {left_padding.shape[0]} rows but the cache holds "
                f"{self.left_padding.shape[0]}"
            )
        self.left_padding.copy_(left_padding.to(torch.long))
        self.max_left_padding = int(self.left_padding.max())

    # ------------------------------------------------------------------------------------------- writes
    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """As `QuantMLALayer.update`; a native decode chunk is written at the device-side position without any
        host synchronisation, longer chunks (prefill) take the eager path."""
        self._check_inputs(latent, k_rot)
        if not self.is_initialized:
            self.lazy_initialization(latent, k_rot)
        T = latent.shape[2]
        native = self.native and native_chunk(T, self.fmt.recent_tokens)
        if native and self.has_tokens:
            self.last_update_native = True
            self._append_device(latent[:, 0], k_rot[:, 0])
            return latent, k_rot
        if _is_compiling():
            raise RuntimeError(
                f"a compiled forward gave the static QuantMLA cache a chunk of {T} tokens"
                + ("" if self.native else " without the 'quantmla' attention implementation")
                + "; only decode steps (at most min(16, recent_tokens) tokens, attn_implementation='quantmla') "
                "compile: run the prefill eagerly (generate does)"
            )
        out = super().update(latent, k_rot, *args, **kwargs)
        self.has_tokens = self.length > 0
        return out

    def append(self, c_new: torch.Tensor, r_new: torch.Tensor) -> None:
        end = self.length + c_new.shape[1]
        if end > self.max_cache_len:
            raise ValueError(
                f"the static QuantMLA cache holds max_cache_len={self.max_cache_len} positions but {end} were "
                "written; build it with a larger max_cache_len (generate sets it from max_length)"
            )
        super().append(c_new, r_new)

    def _append_device(self, c_new: torch.Tensor, r_new: torch.Tensor) -> None:
        """Write `c_new: [B, T, d_c]`, `r_new: [B, T, d_R]` at positions `[length, length + T)`, length on the
        device: packed planes, sink slots (only where a position falls in `[lp, lp + S)`), recent ring."""
        if not (_is_compiling() or self.host_checked):
            # Eager only: a compiled step cannot check (the kernels then drop writes past the capacity); a captured
            # step was checked by its caller on the host (`StaticQuantMLACache.host_checked_steps`).
            if self.length + c_new.shape[1] > self.max_cache_len:
                raise ValueError(
                    f"the static QuantMLA cache is full (max_cache_len={self.max_cache_len}); build it with a "
                    "larger max_cache_len"
                )
        B, T, _ = c_new.shape
        r_new = self._rotate_rope(r_new, inverse=False)
        pos0 = self.cumulative_length
        steps = torch.arange(T, device=c_new.device)
        positions = pos0 + steps  # [T]
        triton = use_triton(self.kernel, c_new.device)
        for store, x in ((self.content, c_new), (self.rope, r_new)):
            p = store.planes
            if store.fmt.quantized:
                torch.ops.quantmla.quant_append(x.contiguous(), p["codes"], p["scale"], p["zero"], pos0,
                                                store.fmt.bits, store.fmt.group, triton)
            else:
                p["values"].index_copy_(1, positions.clamp(max=self.max_cache_len - 1), x.to(p["values"].dtype))
        S, R = self.fmt.sink_tokens, self.fmt.recent_tokens
        if S and not self.sink_written():
            # Sink slot j of row b holds position lp_b + j: this chunk's token t = lp_b + j - length, if any.
            t_of_slot = self.left_padding[:, None] + torch.arange(S, device=c_new.device)[None, :] - pos0  # [B, S]
            hit = ((t_of_slot >= 0) & (t_of_slot < T)).unsqueeze(-1)
            idx = t_of_slot.clamp(0, T - 1).unsqueeze(-1)
            for sink, x in ((self.sink_content, c_new), (self.sink_rope, r_new)):
                new = x.gather(1, idx.expand(-1, -1, x.shape[-1])).to(sink.dtype)
                sink.copy_(torch.where(hit, new, sink))
        keep = min(T, R)
        slots = positions[T - keep :] % R
        self.recent_content.index_copy_(1, slots, c_new[:, T - keep :].to(self.recent_content.dtype))
        self.recent_rope.index_copy_(1, slots, r_new[:, T - keep :].to(self.recent_rope.dtype))
        self.cumulative_length.add_(T)
        if _is_compiling():
            self._host_stale = True  # traced once, replayed many times: read the device counter when needed
        elif not self._host_stale:
            self._host_length += T

    def decode_view(self) -> DecodeView:
        """As `QuantMLALayer.decode_view`, with the device-side length and the fixed capacity (no host value: the
        same view serves eager, captured and compiled steps)."""
        return DecodeView(
            self.fmt, self.content.planes, self.rope.planes, self.sink_content, self.sink_rope, self.recent_content,
            self.recent_rope, self.kernel, self.rope_rotation, self.left_padding, self.cumulative_length,
            self.max_cache_len,
        )

    def sink_written(self) -> bool:
        """Whether every row's sink slots hold their tokens already, from host-side counts (False when they are
        not known: inside a compiled step, or after one). Then later steps, which only write further positions,
        skip the sink writes (a dozen small kernels per layer): eager steps and captured ones (whose graph is keyed
        by this answer, `generation.graphs.step_signature`)."""
        if _is_compiling() or self._host_stale:
            return False
        return self._host_length >= self.max_left_padding + self.fmt.sink_tokens

    def advance_host_length(self, n_tokens: int) -> None:
        """Account for `n_tokens` written by a replayed CUDA graph (which runs no Python), without synchronising."""
        if not self._host_stale:
            self._host_length += n_tokens

    def grow(self, max_cache_len: int) -> None:
        """Hold `max_cache_len` positions from now on, keeping what is cached (new buffers: their addresses move)."""
        if max_cache_len <= self.max_cache_len:
            return
        if self.is_initialized:
            self.content.grow_to(max_cache_len)
            self.rope.grow_to(max_cache_len)
            self._mark_all_static()
        self.max_cache_len = max_cache_len
        self.block_size = max_cache_len

    # ------------------------------------------------------------------------------------------- sizes
    def get_seq_length(self):
        """Positions cached: the device counter (a 0-d tensor, as transformers' static layers return) once
        anything is cached, else 0."""
        return self.cumulative_length[0] if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Decode chunks (native): one mask shape for the whole generation. Prefill chunks and the stock attention
        # get the exact length (eager: the host length is read once per forward).
        if self.native and native_chunk(query_length, self.fmt.recent_tokens):
            # generate asks before the step's forward: the place to grow, so the mask has the new length too.
            # Only where the host count is known (eager and captured steps): after compiled steps it is not (dynamo
            # replays `_host_stale = True`), and reading it would synchronise before every compiled step.
            if self.make_room is not None and not (_is_compiling() or self.host_checked or self._host_stale):
                if self._host_length + query_length > self.max_cache_len:
                    self.make_room(self._host_length + query_length)
            return self.max_cache_len, 0
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    # ------------------------------------------------------------------------------------------- host operations
    def reset(self) -> None:
        """Empty the cache but keep its buffers (and their addresses: a compiled step stays valid)."""
        self.pending_padding = None
        if not self.is_initialized:
            return
        for t in self._buffers():
            t.zero_()
        self.length = 0
        self.max_left_padding = 0
        self.has_tokens = False

    def _cropped(self, keep: int) -> None:
        # `QuantMLALayer.crop` (both conventions, the recent window refilled), keeping every buffer in place.
        self.has_tokens = keep > 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorder, in place (the buffers keep their addresses)."""
        if not self.is_initialized:
            return
        for t in self._buffers()[:-1]:
            t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def _apply_batch(self, fn) -> None:
        # The batch size changes: new buffers (a compiled step recompiles for the new shapes, captured steps go).
        super()._apply_batch(fn)
        self._mark_all_static()
        self.buffers_moved = True

    def nbytes(self) -> int:
        n = super().nbytes()
        return n + (self.cumulative_length.numel() * 8 if self.is_initialized else 0)


class StaticQuantMLACache(QuantMLACache):
    """`QuantMLACache` with preallocated buffers and device-side lengths: `torch.compile`/CUDA-graph friendly.

    Args:
        config: the model's `PretrainedConfig` (any supported MLA family).
        quantization_config: a `QuantMLAConfig` (default: the model config's, else C4R4).
        max_cache_len: positions to preallocate (prompt, left padding included, plus new tokens); `generate`
            passes a bucket of what the call needs (`quantmla_hf.generation.plan`).
        length_limit: positions the cache may grow to (default `max_cache_len`: it never grows).

    Example:
        >>> cache = StaticQuantMLACache(config=model.config, max_cache_len=4096 + 256)
        >>> model.generate(**inputs, cache=cache, max_new_tokens=256)  # transformers 5.17: past_key_values=cache
        # by default, on one CUDA device, the decode steps replay from CUDA graphs (`quantmla_hf.generation.graphs`);
        # with compile_config=... transformers compiles them
    """

    def __init__(self, config=None, quantization_config=None, max_cache_len: int | None = None,
                 length_limit: int | None = None, **kwargs):
        if max_cache_len is None:
            raise ValueError("StaticQuantMLACache needs max_cache_len (prompt + new tokens), e.g. max_cache_len=4352")
        # transformers 5.17's Cache has a read-only `max_cache_len` property: keep ours under another name.
        self._static_len = int(max_cache_len)
        self.length_limit = max(int(length_limit), self._static_len) if length_limit is not None else self._static_len
        # Bumped whenever the buffers move (growth, batch changes): captured steps of older buffers are stale.
        self.buffers_version = 0
        super().__init__(config=config, quantization_config=quantization_config, **kwargs)

    def new_layer(self) -> StaticQuantMLALayer:
        layer = StaticQuantMLALayer(self.format, self._static_len, self.quantization_config.advanced.kernel,
                                    self.rope_rotation)
        layer.make_room = self._make_room
        return layer

    def _make_room(self, needed: int) -> None:
        if self.max_cache_len < needed <= self.length_limit:
            self.grow_for(needed)

    @property
    def max_cache_len(self) -> int:
        """Positions every layer holds."""
        return self._static_len

    def holds_tokens(self) -> bool:
        """Whether anything is cached (a host-side flag, read without synchronising)."""
        return any(layer.has_tokens for layer in self.layers)

    def host_length(self) -> int:
        """Positions cached, from the host-side count (one synchronisation only after compiled steps)."""
        return self.layers[0].length if self.layers else 0

    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, *args, **kwargs):
        # Eager steps grow the cache (up to `length_limit`) before a write that would pass its end; a compiled
        # or captured step cannot (its caller grows it before the step).
        if layer_idx == 0 and not (_is_compiling() or self.layers[0].host_checked) and self.layers[0].is_initialized:
            self._make_room(self.host_length() + latent.shape[2])
        return super().update(latent, k_rot, layer_idx, *args, **kwargs)

    def room_for(self, n_tokens: int) -> bool:
        """Whether `n_tokens` more positions fit without growing (host-side count)."""
        return self.host_length() + n_tokens <= self.max_cache_len

    def grow_for(self, needed: int) -> None:
        """Grow every layer to hold `needed` positions: the bucket of `max(needed, 2 * max_cache_len)`, at most
        `length_limit` (and never below `needed`). Raises a `ValueError` past `length_limit`, and says how much
        memory the growth needed when the device has no room for it."""
        if needed <= self.max_cache_len:
            return
        if needed > self.length_limit:
            raise ValueError(
                f"the static QuantMLA cache may hold at most {self.length_limit} positions (its length_limit) but "
                f"{needed} were asked for; build it with a larger length_limit"
            )
        new_len = max(needed, min(self.length_limit, cache_length_bucket(max(needed, 2 * self.max_cache_len))))
        try:
            for layer in self.layers:
                layer.grow(new_len)
        except torch.OutOfMemoryError as err:
            per_position = self.nbytes() / max(self.max_cache_len, 1)
            raise torch.OutOfMemoryError(
                f"growing the static QuantMLA cache from {self.max_cache_len} to {new_len} positions needs about "
                f"{per_position * new_len / 2**30:.2f} GiB more device memory than is free; generate fewer tokens "
                "(max_new_tokens), a smaller batch, or pass QuantMLAConfig(advanced={'decode_graphs': False, "
                f"'static_cache': False}}) for the growing cache ({err})"
            ) from err
        self._static_len = new_len
        self.buffers_version += 1

    def advance_host_length(self, n_tokens: int) -> None:
        """Account for `n_tokens` positions written by a replayed CUDA graph, in every layer's host-side count."""
        for layer in self.layers:
            layer.advance_host_length(n_tokens)

    def set_host_length(self, n_tokens: int) -> None:
        """Set every layer's length, host and device (after a warm-up step that must leave no trace)."""
        self.set_layers(length=n_tokens)

    def moved_buffers(self) -> bool:
        """Whether any layer's buffers moved since the last call (batch reorders, repeats, selections)."""
        moved = any(layer.buffers_moved for layer in self.layers)
        if moved:
            self.buffers_version += 1
            for layer in self.layers:
                layer.buffers_moved = False
        return moved

    @contextlib.contextmanager
    def host_checked_steps(self):
        """Inside, decode steps skip their synchronising checks (mask, room left): the caller made them on the host
        (as `quantmla_hf.generation.graphs` does once per generation and before every replay)."""
        self.set_layers(host_checked=True)
        try:
            yield
        finally:
            self.set_layers(host_checked=False)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def bytes_per_token(self) -> float:
        n = int(self.get_seq_length())
        batch = self.layers[0].content.batch_size if self.layers and self.layers[0].is_initialized else 0
        return self.nbytes() / (n * batch) if n and batch else 0.0
