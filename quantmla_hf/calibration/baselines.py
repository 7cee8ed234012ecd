"""Baseline transforms in the same fusible spaces: SmoothQuant-style scales and a QuaRot-style Hadamard.

- "smooth": per content channel `t_j = max|c_j|^alpha / max|W_b[:, j]|^(1 - alpha)` migrates range from the cached
  latent into its consumer `kv_b_proj`; per RoPE pair `t_i = max|k_i|^alpha / max|q_i|^(1 - alpha)` (pair
  magnitudes, maximum over tokens and heads) migrates it from the key into the queries. Scales are normalized to
  geometric mean 1 so only their spread matters.
- "hadamard": content `c' = rms(w) * H n` (the norm weight folded into `kv_b_proj`, as QuaRot folds norms before
  rotating); the RoPE Hadamard is post-RoPE, so it cannot be fused and stays online in the cache.
"""

from __future__ import annotations

import torch

from ..hadamard import hadamard_matrix
from .transforms import RopeLayout

SMOOTH_ALPHA = 0.5


def _geo_normalize(t: torch.Tensor) -> torch.Tensor:
    return t / t.log().mean().exp()


def smooth_content(latent_absmax: torch.Tensor, kv_b_weight: torch.Tensor, norm_weight: torch.Tensor,
                   alpha: float = SMOOTH_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothQuant scales for the latent.

    Args:
        latent_absmax: `[d_c]` max |c_j| over calibration tokens of the cached latent.
        kv_b_weight: `[H * (d_nope + d_v), d_c]` consumer weight.
        norm_weight: `[d_c]` original `kv_a_layernorm` weight `w`.

    Returns:
        `(rotation [d_c, d_c], scale [d_c])` of the fusible form `c' = s * R n` (R = signs of w, s = |w| / t).
    """
    eps = 1e-8
    a = latent_absmax.float().clamp_min(eps)
    b = kv_b_weight.float().abs().amax(0).clamp_min(eps)
    t = _geo_normalize(a.pow(alpha) / b.pow(1 - alpha))
    w = norm_weight.float()
    sign = torch.where(w < 0, -1.0, 1.0)
    return torch.diag(sign), (w.abs().clamp_min(eps) / t)


def smooth_rope(q: torch.Tensor, k: torch.Tensor, layout: RopeLayout, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant key scale per frequency pair, `[d_R / 2]`, from post-RoPE `q: [.., H, T, d_R]`, `k: [.., T, d_R]`."""
    eps = 1e-8
    a, b = layout.post_a.to(k.device), layout.post_b.to(k.device)
    k_mag = (k[..., a].float().pow(2) + k[..., b].float().pow(2)).sqrt().reshape(-1, layout.n_pairs).amax(0)
    q_mag = (q[..., a].float().pow(2) + q[..., b].float().pow(2)).sqrt().reshape(-1, layout.n_pairs).amax(0)
    t = _geo_normalize(k_mag.clamp_min(eps).pow(alpha) / q_mag.clamp_min(eps).pow(1 - alpha))
    return 1 / t


def hadamard_content(norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(H [d_c, d_c], rms(w) * ones [d_c])`; `d_c` must be a power of two."""
    d = norm_weight.numel()
    if d & (d - 1):
        raise ValueError(
            f"transform='hadamard' needs a power-of-two kv_lora_rank for its content rotation, got {d}; "
            "use transform='learned' or 'smooth' for this model"
        )
    rms = norm_weight.float().pow(2).mean().sqrt().clamp_min(1e-8)
    return hadamard_matrix(d, device=norm_weight.device), torch.full((d,), float(rms), device=norm_weight.device)
