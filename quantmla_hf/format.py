"""Typed description of the packed MLA cache formats and their byte layout.

One token of one layer caches two paths: the content latent `c` (`[d_c]`) and the post-RoPE key `k_R` (`[d_R]`).
Each path is stored in its own planes (separate tensors, so every plane is naturally aligned):

For a path of `dim` elements at `bits` < 16, split into `G = dim // group` groups (`group = min(group_size, dim)`):

    codes  uint8   [B, capacity, dim * bits // 8]
        element j of the token lives in byte j * bits // 8, at bit offset (j * bits) % 8, little end first:
        4 bits: byte i holds element 2i in bits 0-3 and element 2i+1 in bits 4-7;
        2 bits: byte i holds elements 4i .. 4i+3 in bits 0-1, 2-3, 4-5, 6-7;
        8 bits: byte i holds element i.
    scale  fp16    [B, capacity, G]   step of group g, always > 0
    zero   int8    [B, capacity, G]   stored zero point, `z - 2**(bits-1)`

and element j of group g dequantizes as `(q_j - z_g) * scale_g` with `z_g = zero_g + 2**(bits-1)`, computed in fp32.
`z_g` may lie outside the code range (a group far from zero), which is why it is stored as a signed byte relative
to the middle code; only when even that does not fit does the quantizer widen the group's range to include zero.
Every element is within `scale_g / 2` of its original value.

At `bits == 16` a path is stored as-is, `values [B, capacity, dim]` in the model's compute dtype, with no metadata.

Bytes per token and layer, per path: `dim * bits / 8 + 3 * G` (fp16 scale + int8 zero per group).
DeepSeek (d_c = 512, d_R = 64, group 64):
    C4R4: content 256 + 24, RoPE 32 + 3             = 315 bytes  (BF16 latent: 1152 bytes, 3.66x)
    C2R4: content 128 + 24, RoPE 32 + 3             = 187 bytes  (6.16x)
    C8R8: content 512 + 24, RoPE 64 + 3             = 603 bytes
The BF16 sink and recent copies add `(sink + recent) * (d_c + d_R) * 2` bytes per layer and sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
ZERO_DTYPE = torch.int8
METADATA_BYTES_PER_GROUP = 3  # fp16 scale + int8 zero point
# Smallest allocation of the packed planes, in tokens: a short prompt does not hold a whole block.
MIN_CAPACITY = 16


def allocated_tokens(n_tokens: int, block_size: int) -> int:
    """Capacity the packed planes hold for `n_tokens` tokens: powers of two from `MIN_CAPACITY` up to one block,
    then whole blocks (geometric growth while short, at most one block of slack when long)."""
    if n_tokens <= 0:
        return 0
    if n_tokens >= block_size:
        return -(-n_tokens // block_size) * block_size
    cap = MIN_CAPACITY
    while cap < n_tokens:
        cap *= 2
    return min(cap, block_size)


@dataclass(frozen=True)
class PathFormat:
    """Storage format of one cached path (content latent or RoPE key).

    Attributes:
        dim: elements per token (d_c or d_R).
        bits: 2, 4, 8 (packed integer codes) or 16 (stored unquantized in the model dtype).
        group_size: requested group size; a path narrower than it is one group.
    """

    dim: int
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8, 16):
            raise ValueError(f"bits must be one of 2, 4, 8, 16, got {self.bits}")
        if self.dim <= 0:
            raise ValueError(f"a cached path needs a positive width, got dim={self.dim}")
        if self.bits < 16 and (self.group * self.bits) % 8:
            raise ValueError(f"a group of {self.group} elements at {self.bits} bits does not fill whole bytes")
        if self.bits < 16 and self.dim % self.group:
            raise ValueError(
                f"the cached width {self.dim} is not divisible by group_size={self.group_size}: "
                f"choose a group_size that divides {self.dim} (e.g. {_largest_pow2_divisor(self.dim)})"
            )

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    @property
    def group(self) -> int:
        """Elements per group actually used: `min(group_size, dim)`."""
        return min(self.group_size, self.dim)

    @property
    def n_groups(self) -> int:
        return self.dim // self.group if self.quantized else 0

    @property
    def code_bytes(self) -> int:
        """Bytes of packed codes per token (0 for an unquantized path)."""
        return self.dim * self.bits // 8 if self.quantized else 0

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    def bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Persistent bytes one token of this path occupies (codes plus metadata, or raw values)."""
        if not self.quantized:
            return self.dim * torch.empty((), dtype=dtype).element_size()
        return self.code_bytes + METADATA_BYTES_PER_GROUP * self.n_groups


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


@dataclass(frozen=True)
class CacheFormat:
    """Format of one token of one MLA layer: a content path and a RoPE path.

    Attributes:
        content: format of the content latent `[d_c]`.
        rope: format of the post-RoPE key `[d_R]`.
        sink_tokens: first real tokens kept in the model dtype beside their packed copy.
        recent_tokens: most recent tokens kept in the model dtype beside their packed copy.
    """

    content: PathFormat
    rope: PathFormat
    sink_tokens: int = 4
    recent_tokens: int = 128

    @classmethod
    def from_config(cls, kv_lora_rank: int, rope_dim: int, quantization_config) -> "CacheFormat":
        """Build the format for a model with `d_c = kv_lora_rank` and `d_R = rope_dim`."""
        q = quantization_config
        return cls(
            content=PathFormat(kv_lora_rank, q.content_bits, q.group_size),
            rope=PathFormat(rope_dim, q.rope_bits, q.group_size),
            sink_tokens=q.sink_tokens,
            recent_tokens=q.recent_tokens,
        )

    @property
    def name(self) -> str:
        return f"C{self.content.bits}R{self.rope.bits}"

    @property
    def latent_dim(self) -> int:
        return self.content.dim + self.rope.dim

    def packed_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the packed copy of one token (both paths), excluding the sink/recent copies."""
        return self.content.bytes_per_token(dtype) + self.rope.bytes_per_token(dtype)

    def dense_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one token of an unquantized latent cache in `dtype` (the baseline)."""
        return self.latent_dim * torch.empty((), dtype=dtype).element_size()

    def persistent_bytes(self, n_tokens: int, dtype: torch.dtype = torch.bfloat16, block_size: int = 1) -> int:
        """Bytes one layer of one sequence of `n_tokens` holds (allocated): packed copies for
        `allocated_tokens(n_tokens, block_size)` tokens, plus the sink and recent buffers in `dtype` (allocated
        whole once anything is cached)."""
        if n_tokens == 0:
            return 0
        protected = (self.sink_tokens + self.recent_tokens) * self.dense_bytes_per_token(dtype)
        return allocated_tokens(n_tokens, block_size) * self.packed_bytes_per_token(dtype) + protected

    def used_bytes(self, n_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes the `n_tokens` cached tokens of one layer and sequence occupy: their packed copies and the
        model-dtype copies of those that are sink or recent tokens (no allocation slack)."""
        dense = (min(n_tokens, self.sink_tokens) + min(n_tokens, self.recent_tokens)) * self.dense_bytes_per_token(dtype)
        return n_tokens * self.packed_bytes_per_token(dtype) + dense
