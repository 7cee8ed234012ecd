"""The portable Triton decode kernel compiles for sm_90 (Hopper) on a machine without a GPU.

The CPU tests run the kernel in the Triton interpreter, which does not type-check the way the compiler does (an
fp32 model's launch once paired fp16 operands with fp32 IEEE dots and failed to compile on the H200 only). This
compiles the launches `launch_triton` makes for a bf16 and an fp32 model, C4R4 and C16R16, ahead of time for sm_90
(Triton's own ptxas, no driver), in a subprocess because the test session runs Triton in interpreter mode.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quantmla_hf.kernels import mla_decode_triton as mod

    fn = mod.mla_decode_triton_kernel
    for bits, exact in ((4, False), (4, True), (16, False)):
        copy = "*fp32" if exact else "*bf16"
        const = dict(D_C=512, GC=8, GROUP_C=64, C_BITS=bits, D_R=64, R_BITS=bits, S=4, R=128, BLOCK_M=16,
                     BLOCK_T=mod.BLOCK_T, Q_SPLIT=exact, EXACT=exact)
        plane = copy if bits == 16 else "*u8"
        meta = (copy, copy) if bits == 16 else ("*fp16", "*i8")
        ptr = dict(q_ptr=copy, qr_ptr=copy, cc_ptr=plane, cs_ptr=meta[0], cz_ptr=meta[1], rc_ptr=plane,
                   rs_ptr=meta[0], rz_ptr=meta[1], snc_ptr=copy, snr_ptr=copy, rcc_ptr=copy, rcr_ptr=copy,
                   lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
               for n in fn.arg_names}
        src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
        assert ".target sm_90" in kernel.asm["ptx"]
    print("compiled")
    """
)


def test_portable_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
