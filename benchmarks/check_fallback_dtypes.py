"""GPU check of the fallback decode kernel (`kernels/mla_decode.py`) for each model dtype of the BF16 copies.

fp32 models keep fp32 sink/recent copies, and the kernel then computes fp32 IEEE dots (`EXACT`, no inline-assembly
fp16 dequantization); bf16 models take the fp16-operand path. Each case runs the kernel and the PyTorch reference
(`kernels/mla_decode_ref.py`) on the same random cache (3 rows with left padding 0, 7 and 33, 1000 positions, 16
heads) and prints the relative error of the output, or the exception if the kernel fails to compile or run.

    python benchmarks/check_fallback_dtypes.py          # exits 1 if a case fails or exceeds its tolerance
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402

from quantmla_hf.kernels.mla_decode import mla_decode  # noqa: E402
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-3}


def main() -> int:
    if not torch.cuda.is_available():
        print("check_fallback_dtypes: needs a CUDA GPU (the CPU tests run the kernel under TRITON_INTERPRET)")
        return 1
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for name in ("C4R4", "C2R4", "C16R16"):
            B, N, H = 3, 1000, 16
            fmt, cp, rp, sc, sr, rc, rr = bd.make_cache(name, B, N, dtype=dtype)
            g = torch.Generator(device="cuda").manual_seed(N)
            q = torch.randn(B, H, 1, bd.D_C, device="cuda", dtype=dtype, generator=g)
            qr = torch.randn(B, H, 1, bd.D_R, device="cuda", dtype=dtype, generator=g)
            lp = torch.tensor([0, 7, 33], device="cuda")
            try:
                o, _ = mla_decode(q, qr, cp, rp, fmt, sc, sr, rc, rr, lp, N, 0.07)
                ref, _ = mla_decode_ref(q, qr, cp, rp, fmt, sc, sr, rc, rr, lp, N, 0.07)
                err = ((o.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
                good = err <= TOLERANCE[dtype]
                print(f"fallback kernel, {str(dtype)[6:]} copies, {name}: relative error {err:.2e} "
                      f"({'OK' if good else 'FAIL'}, tolerance {TOLERANCE[dtype]:.0e})", flush=True)
            except Exception as e:  # a compile failure is the thing this script exists to catch
                good = False
                print(f"fallback kernel, {str(dtype)[6:]} copies, {name}: FAILED {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
            ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
