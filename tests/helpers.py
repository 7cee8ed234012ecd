"""Shared test helpers: comparison with a reference, and the cache keyword of the installed transformers."""

from __future__ import annotations

import torch

from quantmla_hf.cache.growing import CACHE_KWARG  # noqa: F401  (the tests' name for it)
from quantmla_hf.kernels.quant_pack_ref import quantize_ref

# Where the tests run the Triton kernels: the CUDA GPU when there is one (compiled), else the CPU in the Triton
# interpreter (tests/conftest.py sets TRITON_INTERPRET only where no GPU is).
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")



def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """Relative RMSE `||out - ref|| / ||ref||` below `ratio`, identical NaN/inf positions, cosine above 1 - ratio."""
    ref64, out64 = ref.double(), out.double()
    assert torch.equal(torch.isnan(ref64), torch.isnan(out64)), f"{name}: NaN positions differ"
    assert torch.equal(torch.isinf(ref64), torch.isinf(out64)), f"{name}: inf positions differ"
    finite = torch.isfinite(ref64)
    r, o = ref64[finite], out64[finite]
    err = (o - r).norm() / r.norm().clamp_min(1e-30)
    assert err <= ratio, f"{name}: relative error {err:.3e} > {ratio:.1e}"
    if r.numel() > 1 and r.norm() > 0:
        cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0)
        assert cos >= 1 - ratio, f"{name}: cosine {cos:.6f} < {1 - ratio}"


def random_planes(f, lead: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh random values `[*lead, f.dim]` (`randn * 2 + 0.3`) stored as path format `f` stores them: `codes`,
    `scale`, `zero` of a packed path (`quantize_ref`), `values` in `dtype` of a 16-bit one."""
    x = torch.randn(*lead, f.dim, generator=g) * 2 + 0.3
    if f.quantized:
        codes, scale, zero = quantize_ref(x, f)
        return {"codes": codes, "scale": scale, "zero": zero}
    return {"values": x.to(dtype)}


def to_device(x, device=KERNEL_DEVICE):
    """`x` with every tensor in it (nested tuples, lists and dicts) moved to `device`; other values as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
