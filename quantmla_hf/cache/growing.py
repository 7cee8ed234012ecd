"""`QuantMLACache`: a transformers `Cache` holding packed low-bit copies of the MLA latent cache.

Per layer and sequence it holds
- the packed copy of every token (content `[d_c]` and RoPE key `[d_R]`, `PackedPathStore`), written once;
- model-dtype copies of the first `sink_tokens` real tokens (`sink_*: [B, S, d]`, after any left padding);
- model-dtype copies of the `recent_tokens` most recent tokens (`recent_*: [B, R, d]`, a ring: position p in
  slot p % R).

Stock transformers MLA attention calls `cache.update(latent [B, 1, T, d_c], k_rot [B, 1, T, d_R], layer_idx)`;
`update` stores the new tokens and returns the whole history `[B, 1, N, d]`: the tokens of this call exactly as
given, older tokens from their model-dtype copy where protected (sink or within the last R positions) and
dequantized from the packed copy elsewhere. Every MLA model of transformers therefore runs with it unmodified.
The native decode path (`quantmla_hf.attention.interface`) reads the planes directly instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import transformers
from packaging import version
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import QuantMLAConfig
from ..distributed import device_guard
from ..format import CacheFormat
from ..hadamard import hadamard_matrix
from ..mla import mla_dims
from ..ops.decode import DecodeView, native_chunk, use_triton
from .store import PackedPathStore

# transformers up to 5.19 also reads a positive crop(k) as "keep the first k tokens"; later releases refuse it.
LEGACY_POSITIVE_CROP = version.parse(transformers.__version__).release < (5, 20)

# Longest chunk after cached tokens whose queries are attended as one-token decoding attends them (draft verification
# in assisted and prompt-lookup decoding; `quantmla_hf.attention.chunk`); longer ones are attended as a prefill (SDPA)
# unless `QuantMLACache.mark_drafts` said where their drafts start.
CHUNK_WINDOW_MAX_QUERY = 256
# The forward (and `generate`) argument that carries the cache: transformers >= 5.24 says `cache`, earlier releases
# `past_key_values`. CACHE_KWARG is the installed release's; CACHE_KWARGS both, for reading.
CACHE_KWARG = "past_key_values" if version.parse(transformers.__version__).release < (5, 24) else "cache"
CACHE_KWARGS = ("cache", "past_key_values")


def cache_argument(kwargs: dict):
    """The cache passed in a forward's (or `generate`'s model) keyword arguments, or None."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


class ChunkWindow(NamedTuple):
    """The model-dtype rows a chunk's decode queries read (`QuantMLALayer.chunk_window`, `quantmla_hf.attention.chunk`).

    `content: [B, L - lo, d_c]` and `rope: [B, L - lo, d_R]` hold positions `[lo, L)` (L the cache length after the
    chunk; rope rows as the ring stores them, i.e. rotated when the layer has `rope_rotation`): the recent ring before
    the chunk overwrote it, then the chunk. The queries at positions `>= first` are attended as one-token decoding
    attends them; those before `first` (a prompt fed with its drafts) as a prefill of the tokens up to `first`.
    `lo = max(0, first - R)`, so every decode query's recent window is in the rows.
    """

    lo: int
    first: int
    content: torch.Tensor
    rope: torch.Tensor


class QuantMLALayer(CacheLayerMixin):
    """The QuantMLA cache of one MLA attention module.

    Args:
        fmt: cache format (both paths, sink and recent sizes).
        kernel: "auto", "triton" or "torch" (see `QuantMLAConfig.advanced.kernel`).
        block_size: allocation granularity of the packed planes, in tokens.
        rope_rotation: optional `[d_R, d_R]` online rotation of the RoPE key (Hadamard baseline).
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(
        self, fmt: CacheFormat, kernel: str = "auto", block_size: int = 256, rope_rotation: torch.Tensor | None = None
    ):
        super().__init__()
        self.fmt = fmt
        # Online rotation of the RoPE key (QuaRot-style baseline, `[d_R, d_R]` orthogonal): every stored copy of k_R
        # is `k_R @ rope_rotation.T`; reads rotate back. A latent-space kernel rotates the query instead.
        self.rope_rotation = rope_rotation
        self.kernel = kernel
        self.block_size = block_size
        self.pending_padding: torch.Tensor | None = None
        # Set by the "quantmla" attention implementation: short chunks then skip the history reconstruction.
        self.native = False
        self.last_update_native = False
        self._clear()

    def _clear(self) -> None:
        self.content: PackedPathStore | None = None
        self.rope: PackedPathStore | None = None
        self.sink_content = self.sink_rope = self.recent_content = self.recent_rope = None
        self.left_padding: torch.Tensor | None = None  # [B] long: padding positions before each row's first token
        self.max_left_padding = 0
        self.length = 0
        self.is_initialized = False
        self.chunk_window: ChunkWindow | None = None
        self.drafts_from: int | None = None  # `QuantMLACache.mark_drafts`, for the next update only

    def lazy_initialization(self, latent: torch.Tensor, k_rot: torch.Tensor) -> None:
        B, dtype, device = latent.shape[0], latent.dtype, latent.device
        self.dtype, self.device = dtype, device
        self.content = PackedPathStore(self.fmt.content, B, dtype, device, self.block_size)
        self.rope = PackedPathStore(self.fmt.rope, B, dtype, device, self.block_size)
        S, R = self.fmt.sink_tokens, self.fmt.recent_tokens
        self.sink_content = torch.zeros((B, S, self.fmt.content.dim), dtype=dtype, device=device)
        self.sink_rope = torch.zeros((B, S, self.fmt.rope.dim), dtype=dtype, device=device)
        self.recent_content = torch.zeros((B, R, self.fmt.content.dim), dtype=dtype, device=device)
        self.recent_rope = torch.zeros((B, R, self.fmt.rope.dim), dtype=dtype, device=device)
        padding = self.pending_padding
        if padding is not None and padding.shape[0] != B:
            raise ValueError(
                f"the attention mask given to set_left_padding has {padding.shape[0]} rows but the batch has {B}"
            )
        self.left_padding = (
            torch.zeros(B, dtype=torch.long, device=device) if padding is None else padding.to(device)
        )
        self.max_left_padding = int(self.left_padding.max()) if B else 0
        self.pending_padding = None
        self.is_initialized = True

    def set_left_padding(self, left_padding: torch.Tensor) -> None:
        """Record `left_padding: [B]` (padding positions before each row's first real token) before the first write."""
        if self.is_initialized and self.length > 0:
            raise ValueError("left padding can only be set before the first tokens are cached; call reset() first")
        self.pending_padding = left_padding.to(torch.long)
        if self.is_initialized:
            self.left_padding = self.pending_padding.to(self.device)
            self.max_left_padding = int(self.left_padding.max())
            self.pending_padding = None

    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `latent: [B, 1, T, d_c]` and `k_rot: [B, 1, T, d_R]`; return the history `[B, 1, N, d]` each.

        In native mode a chunk the latent-space decode takes (`ops.decode.native_chunk`) is only stored, and
        the new tokens alone are returned: the latent-space attention then reads the whole history from the cache.
        The returned history is what a prefill of the chunk's tokens before its first decode query would see
        (`_first_decode_query`); with the "quantmla" attention the decode queries read the cache instead.
        """
        self._check_inputs(latent, k_rot)
        if not self.is_initialized:
            self.lazy_initialization(latent, k_rot)
        c_new, r_new = latent[:, 0], k_rot[:, 0]
        start, T = self.length, c_new.shape[1]
        first = self._first_decode_query(start, T)
        self._keep_chunk_window(c_new, r_new, first)
        self.last_update_native = self.native and native_chunk(T, self.fmt.recent_tokens)
        if self.last_update_native:
            self.append(c_new, r_new)
            return latent, k_rot
        # A prompt fed with its drafts after cached tokens: its queries see the recent window of the prompt's end.
        total = first if first > start else start + T
        history_c = self._reconstruct(self.content, self.sink_content, self.recent_content, start, total)
        history_r = self._rotate_rope(
            self._reconstruct(self.rope, self.sink_rope, self.recent_rope, start, total), inverse=True
        )
        self.append(c_new, r_new)
        return (
            torch.cat([history_c, c_new], dim=1).unsqueeze(1),
            torch.cat([history_r, r_new], dim=1).unsqueeze(1),
        )

    def _first_decode_query(self, start: int, T: int) -> int:
        """Position of the first query of a chunk of `T` tokens at `start` that is attended as one-token decoding
        attends it (`start + T`: none); consumes the `drafts_from` mark.

        Unmarked, a chunk into an empty cache (a prefill) and a chunk of more than `CHUNK_WINDOW_MAX_QUERY` tokens
        after cached ones have none; a shorter chunk after cached tokens has all. Marked (draft verification), the
        tokens before `drafts_from` are a prompt, taken by the same rule, and every later one is a decode query.
        """
        drafts, self.drafts_from = self.drafts_from, None
        end = start + T
        prompt_end = end if drafts is None else min(max(drafts, start), end)
        if start == 0 or prompt_end - start > CHUNK_WINDOW_MAX_QUERY:
            return prompt_end
        return start

    def _keep_chunk_window(self, c_new: torch.Tensor, r_new: torch.Tensor, first: int) -> None:
        """Keep `chunk_window` (a `ChunkWindow` from `lo = max(0, first - R)`) for a chunk of at least 2 tokens
        with decode queries (`first` before its end); `None` otherwise. The decode queries read their recent windows
        from it (`quantmla_hf.attention.chunk`), and `crop` restores the recent window exactly from it after
        rejected drafts. Costs `(L - lo) x (d_c + d_R)` model-dtype values per layer until the next update.
        """
        T, start, R = c_new.shape[1], self.length, self.fmt.recent_tokens
        self.chunk_window = None
        if T < 2 or first >= start + T:
            return
        lo = max(0, first - R)
        skip = max(0, lo - start)
        rows_c, rows_r = c_new[:, skip:], self._rotate_rope(r_new[:, skip:], inverse=False)
        if lo < start:  # the ring still holds [start - R, start)
            ring = torch.arange(lo, start, device=c_new.device) % R
            rows_c = torch.cat([self.recent_content[:, ring], rows_c], dim=1)
            rows_r = torch.cat([self.recent_rope[:, ring], rows_r], dim=1)
        self.chunk_window = ChunkWindow(lo, first, rows_c, rows_r)

    def _check_inputs(self, latent: torch.Tensor, k_rot: torch.Tensor) -> None:
        for name, t in (("latent", latent), ("k_rot", k_rot)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(
                    f"{name} must be a floating-point tensor (the model's compute dtype), got "
                    f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
        if latent.dtype != k_rot.dtype:
            raise TypeError(f"latent ({latent.dtype}) and k_rot ({k_rot.dtype}) must have the same dtype")
        if self.is_initialized and latent.dtype != self.dtype:
            raise TypeError(
                f"this cache holds {self.dtype} tokens but got {latent.dtype} (the model's dtype changed?); "
                "call reset() or build a new cache for the new dtype"
            )
        if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[-1] != self.fmt.content.dim:
            raise ValueError(f"latent must be [B, 1, T, {self.fmt.content.dim}], got {tuple(latent.shape)}")
        if k_rot.dim() != 4 or k_rot.shape[1] != 1 or k_rot.shape[-1] != self.fmt.rope.dim:
            raise ValueError(f"k_rot must be [B, 1, T, {self.fmt.rope.dim}], got {tuple(k_rot.shape)}")
        if latent.shape[0] != k_rot.shape[0] or latent.shape[2] != k_rot.shape[2]:
            raise ValueError(
                f"latent {tuple(latent.shape)} and k_rot {tuple(k_rot.shape)} disagree on batch or length"
            )
        if self.is_initialized and latent.shape[0] != self.content.batch_size:
            raise ValueError(
                f"this cache holds {self.content.batch_size} sequences but got a batch of {latent.shape[0]}; "
                "call reset() (or build a new cache) for a new batch"
            )

    def append(self, c_new: torch.Tensor, r_new: torch.Tensor) -> None:
        """Write `c_new: [B, T, d_c]`, `r_new: [B, T, d_R]` at the end: packed copies, then sink and recent copies."""
        T, start = c_new.shape[1], self.length
        end = start + T
        r_new = self._rotate_rope(r_new, inverse=False)
        triton = use_triton(self.kernel, c_new.device)
        with device_guard(c_new.device):  # device maps: Triton launches on the current device, make it this layer's
            for store, x in ((self.content, c_new), (self.rope, r_new)):
                store.reserve(end, start)
                store.write(x, start, triton)
        self._write_sink(c_new, r_new, start)
        self._write_recent(c_new, r_new, start)
        self.length = end

    def _write_sink(self, c_new: torch.Tensor, r_new: torch.Tensor, start: int) -> None:
        S = self.fmt.sink_tokens
        if S == 0 or start >= self.max_left_padding + S:
            return
        T = c_new.shape[1]
        slot = torch.arange(start, start + T, device=c_new.device)[None, :] - self.left_padding[:, None]  # [B, T]
        rows, cols = torch.nonzero((slot >= 0) & (slot < S), as_tuple=True)
        self.sink_content[rows, slot[rows, cols]] = c_new[rows, cols]
        self.sink_rope[rows, slot[rows, cols]] = r_new[rows, cols]

    def _write_recent(self, c_new: torch.Tensor, r_new: torch.Tensor, start: int) -> None:
        R = self.fmt.recent_tokens
        if R == 0:
            return
        T = c_new.shape[1]
        keep = min(T, R)
        positions = torch.arange(start + T - keep, start + T, device=c_new.device)
        self.recent_content[:, positions % R] = c_new[:, T - keep :]
        self.recent_rope[:, positions % R] = r_new[:, T - keep :]

    def _reconstruct(
        self, store: PackedPathStore, sink: torch.Tensor, recent: torch.Tensor, end: int, total: int
    ) -> torch.Tensor:
        """History positions `[0, end)` as `[B, end, d]` for a cache that will hold `total` tokens: the sink and
        the positions of the recent window `[total - R, total)` from their model-dtype copies, the rest dequantized.
        """
        if end == 0:
            return sink[:, :0]
        out = store.read(end).clone()
        S, R = self.fmt.sink_tokens, self.fmt.recent_tokens
        window = min(end, self.max_left_padding + S)
        if S and window > 0:
            pos = torch.arange(window, device=out.device)[None, :]
            slot = pos - self.left_padding[:, None]
            is_sink = (slot >= 0) & (slot < S)
            gathered = sink.gather(1, slot.clamp(0, S - 1).unsqueeze(-1).expand(-1, -1, sink.shape[-1]))
            out[:, :window] = torch.where(is_sink.unsqueeze(-1), gathered, out[:, :window])
        # The ring holds [end - R, end) until this call's tokens are appended; of those, [total - R, end) stay recent.
        lo = max(0, total - R)
        if R and lo < end:
            positions = torch.arange(lo, end, device=out.device)
            out[:, lo:end] = recent[:, positions % R]
        return out

    def _rotate_rope(self, r: torch.Tensor, inverse: bool) -> torch.Tensor:
        if self.rope_rotation is None:
            return r
        rot = self.rope_rotation.to(device=r.device)
        return (r.float() @ (rot if inverse else rot.T)).to(r.dtype)

    def decode_view(self) -> DecodeView:
        """What the latent-space decode reads of this layer (`ops.decode`): the planes, the copies and the length as
        a device tensor (a fill, no synchronisation)."""
        return DecodeView(
            self.fmt, self.content.planes, self.rope.planes, self.sink_content, self.sink_rope, self.recent_content,
            self.recent_rope, self.kernel, self.rope_rotation, self.left_padding,
            torch.full((1,), self.length, dtype=torch.int64, device=self.device),
            min(self.content.capacity, self.rope.capacity),
        )

    def read_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reconstructed cache `[B, N, d_c]`, `[B, N, d_R]` as attention sees it after the last update."""
        if not self.is_initialized:
            raise ValueError("the cache layer is empty")
        n = self.length
        return (
            self._reconstruct(self.content, self.sink_content, self.recent_content, n, n),
            self._rotate_rope(self._reconstruct(self.rope, self.sink_rope, self.recent_rope, n, n), inverse=True),
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def __repr__(self) -> str:
        state = f"{self.length} tokens x {self.content.batch_size}" if self.is_initialized else "empty"
        return f"QuantMLALayer({self.fmt.name}, {state})"

    def used_bytes(self) -> int:
        """Bytes the cached tokens occupy (packed copies, and sink/recent copies of that many tokens), no slack."""
        if not self.is_initialized:
            return 0
        return self.content.batch_size * self.fmt.used_bytes(self.length, self.dtype)

    def nbytes(self) -> int:
        """Persistent bytes held: packed planes plus the sink and recent copies (allocated storage, not used)."""
        if not self.is_initialized:
            return 0
        dense = (self.sink_content, self.sink_rope, self.recent_content, self.recent_rope)
        return self.content.nbytes() + self.rope.nbytes() + sum(t.numel() * t.element_size() for t in dense)

    def reset(self) -> None:
        self.pending_padding = None
        self._clear()

    def crop(self, max_length: int) -> None:
        """Drop tokens at the end, with the convention of the installed transformers (as `DynamicLayer.crop`).

        `crop(-n)` removes the last `n` tokens and `crop(0)` removes nothing (every release; assisted and
        prompt-lookup decoding call `crop(-rejected)`, so `crop(0)` after a fully accepted draft). A positive
        value is the legacy "keep this many tokens" of transformers up to 5.19 (a no-op when the cache is not longer);
        from 5.20 on it is refused, as DynamicCache refuses it. Recent-window tokens older than the pre-crop
        window are refilled from their packed copies, the only copies left of them.
        """
        # transformers 5.17's assisted decoding passes a 0-d integer tensor (candidate_length - n_matches).
        if isinstance(max_length, torch.Tensor) and max_length.numel() == 1 and not max_length.is_floating_point():
            max_length = int(max_length)
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"crop takes an int (minus the number of tokens to remove), got {max_length!r}")
        n = self.length
        if max_length > 0:
            if not LEGACY_POSITIVE_CROP:
                raise ValueError(
                    f"crop({max_length}): a positive value (the legacy absolute length) is not supported from "
                    "transformers 5.20 on; pass minus the number of tokens to remove, e.g. crop(-2)"
                )
            keep = min(max_length, n)
        else:
            keep = n + max_length
        if keep < 0:
            raise ValueError(f"cannot remove {-max_length} tokens from a cache holding {n}")
        if keep == n or not self.is_initialized:
            return
        R = self.fmt.recent_tokens
        lost_lo, lost_hi = max(0, keep - R), min(keep, n - R)
        if R and lost_lo < lost_hi:
            positions = torch.arange(lost_lo, lost_hi, device=self.device)
            window = self.chunk_window
            if window is not None and window.lo <= lost_lo:  # rejected drafts of the last chunk: the exact rows
                rows = slice(lost_lo - window.lo, lost_hi - window.lo)
                self.recent_content[:, positions % R] = window.content[:, rows]
                self.recent_rope[:, positions % R] = window.rope[:, rows]
            else:  # older tokens: their packed copies are the only ones left
                self.recent_content[:, positions % R] = self.content.read(lost_hi, lost_lo).to(self.recent_content.dtype)
                self.recent_rope[:, positions % R] = self.rope.read(lost_hi, lost_lo).to(self.recent_rope.dtype)
        self.chunk_window = None
        self.length = keep
        self._cropped(keep)

    def _cropped(self, keep: int) -> None:
        """After a crop to `keep` tokens: release the storage past them (a static layer keeps its buffers)."""
        self.content.shrink(keep)
        self.rope.shrink(keep)

    def _apply_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.chunk_window = None
        self.content.apply_batch(fn)
        self.rope.apply_batch(fn)
        for name in ("sink_content", "sink_rope", "recent_content", "recent_rope", "left_padding"):
            setattr(self, name, fn(getattr(self, name)))
        self.max_left_padding = int(self.left_padding.max()) if self.left_padding.numel() else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        self._apply_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.left_padding.device != self.device:
            self._apply_batch(lambda t: t.to(self.device, non_blocking=True))


class QuantMLACache(Cache):
    """KV cache of an MLA model with packed low-bit copies and model-dtype sink/recent tokens.

    Args:
        config: the model's `PretrainedConfig` (any supported MLA family).
        quantization_config: a `QuantMLAConfig` (defaults to C4R4, group 64, 4 sink + 128 recent tokens).

    Example:
        >>> cache = QuantMLACache(config=model.config, quantization_config=QuantMLAConfig(content_bits=4))
        >>> model.generate(**inputs, cache=cache)  # transformers 5.17: past_key_values=cache
    """

    def __init__(self, config=None, quantization_config: QuantMLAConfig | None = None, **kwargs):
        if config is None:
            raise ValueError("QuantMLACache needs the model config: QuantMLACache(config=model.config, ...)")
        if quantization_config is None:
            quantization_config = getattr(config, "quantization_config", None) or QuantMLAConfig()
        if isinstance(quantization_config, dict):
            quantization_config = QuantMLAConfig.from_dict(quantization_config)
        self.quantization_config = quantization_config
        self.dims = mla_dims(config)
        self.format = CacheFormat.from_config(self.dims.kv_lora_rank, self.dims.rope_dim, quantization_config)
        # QuaRot-style baseline: its RoPE-path Hadamard must act after RoPE, so it stays online, in the cache.
        self.rope_rotation = (hadamard_matrix(self.dims.rope_dim) if quantization_config.transform == "hadamard"
                              else None)
        super().__init__(layers=[self.new_layer() for _ in range(self.dims.num_cache_layers)], **kwargs)

    def new_layer(self) -> QuantMLALayer:
        """One layer of this cache (the static cache makes its own kind)."""
        qc = self.quantization_config
        return QuantMLALayer(self.format, qc.advanced.kernel, qc.advanced.cache_block_size, self.rope_rotation)

    def update(self, latent: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, *args, **kwargs):
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an integer >= 0, got {layer_idx!r}")
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"layer_idx {layer_idx} is past the {len(self.layers)} cache layers built from the model config"
            )
        return super().update(latent, k_rot, layer_idx, *args, **kwargs)

    def set_left_padding(self, attention_mask: torch.Tensor) -> None:
        """Tell the cache where each row's real tokens start, from a 2D `attention_mask: [B, T]` of the prompt.

        Called by the forward hook that `quantmla_hf` installs on quantized models; call it yourself before the
        first forward when you pass this cache to a model prepared some other way and pad on the left.
        """
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, T], got {tuple(attention_mask.shape)}")
        valid = attention_mask.to(torch.bool)
        # Index of the first real token; an all-padding row is padding throughout.
        first = torch.where(valid.any(1), valid.to(torch.int8).argmax(1), valid.shape[1])
        for layer in self.layers:
            layer.set_left_padding(first)

    def set_layers(self, **attributes) -> None:
        """Set the same attributes on every layer (`native`, and the static cache's `length` and `host_checked`)."""
        for layer in self.layers:
            for name, value in attributes.items():
                setattr(layer, name, value)

    def set_native(self, enabled: bool) -> None:
        """Let short chunks skip the history reconstruction (for the "quantmla" attention implementation)."""
        self.set_layers(native=enabled)

    def mark_drafts(self, position: int) -> None:
        """Say that the tokens of the next forward from `position` on are drafts under verification.

        With the "quantmla" attention each of them is then attended as one-token decoding would attend it, and the
        tokens before `position` as a forward of those tokens alone would be: the first verification of assisted
        and prompt-lookup decoding feeds the prompt with its drafts into an empty cache, and a plain prefill would
        let the drafts see the whole prompt in the model dtype. The mark holds for the next update of each layer.
        `generate` sets it before every verification (`quantmla_hf.generation.speculative`).
        """
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"mark_drafts takes the position of the first draft token (an int >= 0), got {position!r}")
        self.set_layers(drafts_from=position)

    def nbytes(self) -> int:
        """Persistent bytes held by all layers (packed planes, sink and recent copies), as allocated."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes the cached tokens occupy in all layers, without allocation slack."""
        return sum(layer.used_bytes() for layer in self.layers)

    def _tokens(self) -> int:
        """Cached tokens times sequences."""
        layer = self.layers[0] if self.layers else None
        return layer.length * layer.content.batch_size if layer is not None and layer.is_initialized else 0

    def bytes_per_token(self, allocated: bool = False) -> float:
        """Bytes per cached token and sequence, summed over layers: used (default) or `allocated` (nbytes)."""
        n = self._tokens()
        return (self.nbytes() if allocated else self.used_bytes()) / n if n else 0.0

    def __repr__(self) -> str:
        n = self.get_seq_length()
        batch = self.layers[0].content.batch_size if self.layers and self.layers[0].is_initialized else 0
        return (f"QuantMLACache({self.format.name}, {len(self.layers)} layers, {n} tokens x {batch} sequences, "
                f"{self.used_bytes()} bytes used / {self.nbytes()} allocated)")
