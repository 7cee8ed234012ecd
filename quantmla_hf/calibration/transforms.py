"""Parametrisations of the two transform spaces and the RoPE pair layout of each MLA family.

Content path (cached latent `c: [.., d_c]`): with `n = x_c / rms(x_c)` the un-weighted RMSNorm output and
`w` the original `kv_a_layernorm` weight (`c = w * n`), the fusible transform space is

    c' = s * (R n)          R: [d_c, d_c] orthogonal,  s: [d_c] > 0

(see docs/CALIBRATION.md for why this, and not `s * R c`, is the space that fuses exactly).
`R = cayley(A) @ R0` with a learned skew matrix `A` and a fixed start `R0` (signs of `w`, or a Hadamard matrix);
`s = exp(log_s)`.

RoPE path (post-RoPE key `k_R: [.., d_R]`, `d_R / 2` frequency pairs): per pair `i` one angle `theta_i` and one
scale `s_i > 0`; the key pair becomes `s_i * Q(theta_i) k_pair`, the query pair `Q(theta_i) q_pair / s_i`.
Both are scaled rotations of the pair plane, so they commute with RoPE's rotation of that pair and every
`q_R . k_R` is unchanged in full precision.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..hadamard import hadamard_matrix
from ..mla import text_config


def cayley(a: torch.Tensor) -> torch.Tensor:
    """Orthogonal `[d, d]` matrix `(I - K)^-1 (I + K)` of the skew part `K = a - a^T` of `a: [d, d]`."""
    k = a - a.transpose(-1, -2)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye - k, eye + k)


class ContentTransform(torch.nn.Module):
    """`c' = exp(log_s) * (cayley(A) @ R0) n` on the normalized latent `n: [.., d_c]`.

    Args:
        r0: `[d_c, d_c]` orthogonal starting rotation (kept fixed).
        scale0: `[d_c]` positive starting scale.
    """

    def __init__(self, r0: torch.Tensor, scale0: torch.Tensor):
        super().__init__()
        if (scale0 <= 0).any():
            raise ValueError("the content scale must be positive everywhere")
        self.register_buffer("r0", r0.float())
        self.a = torch.nn.Parameter(torch.zeros_like(self.r0))
        self.log_s = torch.nn.Parameter(scale0.float().log())

    def rotation(self) -> torch.Tensor:
        """`[d_c, d_c]` orthogonal."""
        return cayley(self.a) @ self.r0

    def scale(self) -> torch.Tensor:
        """`[d_c]` positive."""
        return self.log_s.exp()


@dataclass(frozen=True)
class RopeLayout:
    """Where the `d_R / 2` frequency pairs of a family live.

    Attributes:
        kind: "interleave" (DeepSeek-V3 style: pre-RoPE pairs (2i, 2i+1), de-interleaved by RoPE to (i, i + d_R/2)),
            "half" (rotate_half: pairs (i, i + d_R/2) before and after) or "complex" (DeepSeek-V2: pairs
            (2i, 2i+1) before and after).
        pre_a, pre_b: `[d_R / 2]` indices of the pair coordinates in the pre-RoPE projection rows.
        post_a, post_b: `[d_R / 2]` indices of the same pair in the cached post-RoPE key.
    """

    kind: str
    pre_a: torch.Tensor
    pre_b: torch.Tensor
    post_a: torch.Tensor
    post_b: torch.Tensor

    @property
    def n_pairs(self) -> int:
        return int(self.pre_a.numel())


ROPE_FUNCTIONS = {"interleave": "apply_rotary_pos_emb_interleave", "half": "apply_rotary_pos_emb", "complex": "apply_rotary_emb"}


def rope_kind(config) -> str:
    """The RoPE pair layout of a transformers MLA config (see `RopeLayout.kind`)."""
    cfg = text_config(config)
    model_type = cfg.model_type
    if model_type == "deepseek_v2":
        return "complex"
    if model_type == "longcat_flash":
        return "interleave"
    if model_type == "minicpm3":
        return "half"
    if model_type in ("deepseek_v3", "glm4_moe_lite"):
        return "interleave" if getattr(cfg, "rope_interleave", True) else "half"
    raise ValueError(f"no known RoPE layout for model_type {model_type!r} (known: deepseek_v2, deepseek_v3, "
                     "glm4_moe_lite, longcat_flash, minicpm3); quantize this model with transform='none'")


def rope_layout(config, rope_dim: int) -> RopeLayout:
    """Pair indices of the `rope_dim`-wide RoPE key of `config`'s family."""
    if rope_dim % 2:
        raise ValueError(f"a RoPE key has an even width, got {rope_dim}")
    kind = rope_kind(config)
    i = torch.arange(rope_dim // 2)
    even, odd, first, second = 2 * i, 2 * i + 1, i, i + rope_dim // 2
    if kind == "interleave":
        return RopeLayout(kind, even, odd, first, second)
    if kind == "half":
        return RopeLayout(kind, first, second, first, second)
    return RopeLayout(kind, even, odd, even, odd)


def apply_family_rope(module: torch.nn.Module, kind: str, q: torch.Tensor, k: torch.Tensor, position_embeddings):
    """Apply the family's own RoPE function (from its modeling module) to pre-RoPE `q: [B, H, T, d_R]`,
    `k: [B, 1, T, d_R]`; returns the post-RoPE pair exactly as the attention module computes it."""
    modeling = sys.modules[type(module).__module__]
    fn = getattr(modeling, ROPE_FUNCTIONS[kind])
    if kind == "complex":
        return fn(q, k, position_embeddings.to(q.device))
    cos, sin = position_embeddings
    return fn(q, k, cos, sin)


class RopeTransform(torch.nn.Module):
    """Per frequency pair a rotation angle and a positive scale, acting on post-RoPE keys and queries.

    Args:
        layout: the family's pair layout.
        scale0: `[d_R / 2]` positive starting scale of the key pairs.
    """

    def __init__(self, layout: RopeLayout, scale0: torch.Tensor):
        super().__init__()
        if (scale0 <= 0).any():
            raise ValueError("the RoPE pair scale must be positive everywhere")
        self.layout = layout
        self.theta = torch.nn.Parameter(torch.zeros(layout.n_pairs))
        self.log_s = torch.nn.Parameter(scale0.float().log())

    def scale(self) -> torch.Tensor:
        return self.log_s.exp()

    def apply(self, x: torch.Tensor, query: bool) -> torch.Tensor:
        """Transform post-RoPE keys (`query=False`: `s Q x`) or queries (`query=True`: `Q x / s`), `x: [.., d_R]`."""
        return rotate_pairs(x, self.layout.post_a, self.layout.post_b, self.theta, 1 / self.scale() if query else self.scale())

    def inverse_key(self, x: torch.Tensor) -> torch.Tensor:
        """`Q^T x / s`, `x: [.., d_R]`: undoes the key map; a transformed key error seen by the transformed queries
        is this error seen by the original ones (`(Q q / s) . e = q . (Q^T e / s)`)."""
        return rotate_pairs(x, self.layout.post_a, self.layout.post_b, -self.theta, 1 / self.scale())


def rotate_pairs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, theta: torch.Tensor, scale: torch.Tensor):
    """`x: [.., d]` with pair `i` at coordinates `(a_i, b_i)` mapped to `scale_i * Q(theta_i) (x_a, x_b)`,
    `Q(t) = [[cos t, -sin t], [sin t, cos t]]` (the orientation RoPE itself uses)."""
    a, b = a.to(x.device), b.to(x.device)
    xa, xb = x[..., a], x[..., b]
    cos, sin = (theta.cos() * scale).to(x.dtype), (theta.sin() * scale).to(x.dtype)
    return x.index_copy(-1, a, xa * cos - xb * sin).index_copy(-1, b, xa * sin + xb * cos)


def start_rotations(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Candidate starting rotations for the content path from the norm weight `w: [d_c]`: "identity" (the
    signs of `w`, so that `s = |w|` reproduces the original latent) and, for a power-of-two `d_c`, "hadamard"."""
    d = weight.numel()
    sign = torch.where(weight < 0, -1.0, 1.0).float()
    out = {"identity": torch.diag(sign)}
    if d & (d - 1) == 0:
        out["hadamard"] = hadamard_matrix(d, device=weight.device)
    return out
