"""The decode kernel compiles for sm_90 (Hopper) on a machine without a GPU.

The CPU tests run the kernels in the Triton interpreter, which has no inline assembly and does not type-check the
way the compiler does: an fp32 model's launch (fp32 copies, fp32 IEEE dots) once paired the inline-assembly fp16
dequantization with fp32 dots and failed to compile on the H200 only. This compiles the launch the host wrapper
makes for an fp32 model ahead of time for sm_90 (Triton's own ptxas, no driver), in a subprocess because the test
session runs Triton in interpreter mode.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quantmla_hf.format import PathFormat
    from quantmla_hf.kernels import mla_decode as mod

    fn = mod.mla_decode_fwd_kernel
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    content, rope = PathFormat(512, 4, 64), PathFormat(64, 4, 64)
    exact = True  # what the wrapper passes for fp32 copies
    const = dict(D_C=512, D_CP=512, GC=8, GROUP_C=64, GROUP_CP=64, C_BITS=4, D_R=64, D_RP=64, GR=1, GROUP_R=64,
                 GROUP_RP=64, R_BITS=4, S=4, R=128, BLOCK_M=16, BLOCK_N=32, EXACT=exact, Q_SPLIT=True,
                 C_ASM=mod._use_asm(content, cuda, exact), R_ASM=mod._use_asm(rope, cuda, exact), LEN_FROM_PTR=False)
    assert mod._use_asm(content, cuda, False), "bf16 launches keep the assembly dequantization"
    ptr = dict(q_ptr="*fp32", qr_ptr="*fp32", c0_ptr="*u8", c1_ptr="*fp16", c2_ptr="*i8", r0_ptr="*u8",
               r1_ptr="*fp16", r2_ptr="*i8", sc_ptr="*fp32", sr_ptr="*fp32", rc_ptr="*fp32", rr_ptr="*fp32",
               lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    assert ".target sm_90" in kernel.asm["ptx"]
    print("compiled")
    """
)


def test_fp32_model_launch_compiles_for_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
