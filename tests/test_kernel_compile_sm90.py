"""The portable Triton decode kernel (its contiguous and paged launches) compiles for sm_90 (Hopper) on a machine
without a GPU, within its shared memory.

The CPU tests run the kernels in the Triton interpreter, which neither type-checks the way the compiler does (an
fp32 model's launch once paired fp16 operands with fp32 IEEE dots and failed to compile on the H200 only) nor
counts shared memory (a paged launch once needed 253,952 bytes of the 232,448 a program may use, and failed on the
H200 only). This compiles the launches `launch_triton` and `mla_decode_paged` make (their tiling, warps and
stages: C4R4 and C16R16 in bf16, C4R4 in fp32, C16R16 at 128 heads; its paged launch in bf16), the
quantize-and-pack kernel's two ways of addressing rows, the paged cache's one-launch layer write and the merge of the
split partials (fp16 ones as a programmatic dependent launch: its wait before its first load; fp32 ones without)
ahead of time for sm_90 (Triton's own ptxas, no driver), in a subprocess because the test session runs Triton in
interpreter mode.
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
    from quantmla_hf.format import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_triton as mod

    SMEM = 232448  # bytes of shared memory one H100/H200 program may use

    def compile_launch(fn, bits, exact, rows, extra_const, ptr):
        fmt = CacheFormat(PathFormat(512, bits, 64), PathFormat(64, bits, 64), 4, 128)
        gc, group = mod.path_tiling(fmt.content, 8)
        const = dict(D_C=512, GC=gc, GROUP_C=group, C_BITS=bits, D_R=64, R_BITS=bits, S=4, R=128,
                     BLOCK_M=mod.block_rows(rows), BLOCK_T=mod.launch_shape(fmt, rows)[0], Q_SPLIT=exact,
                     NATIVE=exact or bits == 16, **extra_const)
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
               for n in fn.arg_names}
        src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        _, warps, stages = mod.launch_shape(fmt, rows)
        options = dict(num_warps=warps, num_stages=stages)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert ".target sm_90" in kernel.asm["ptx"]
        assert kernel.metadata.shared <= SMEM, (fn.__name__, bits, exact, rows, kernel.metadata.shared)

    for bits, exact, rows in ((4, False, 16), (4, True, 16), (16, False, 16), (16, True, 16), (16, False, 128)):
        copy = "*fp32" if exact else "*bf16"
        plane = copy if bits == 16 else "*u8"
        meta = (copy, copy) if bits == 16 else ("*fp16", "*i8")
        ptr = dict(q_ptr=copy, qr_ptr=copy, cc_ptr=plane, cs_ptr=meta[0], cz_ptr=meta[1], rc_ptr=plane,
                   rs_ptr=meta[0], rz_ptr=meta[1], snc_ptr=copy, snr_ptr=copy, rcc_ptr=copy, rcr_ptr=copy,
                   len_ptr="*i64", lp_ptr="*i64", pt_ptr="*i64", rows_ptr="*i64", cu_q_ptr="*i64",
                   tok_req_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
        compile_launch(mod.mla_decode_triton_kernel, bits, exact, rows, dict(PAGE=0), ptr)
        if rows == 16 and not exact:
            ptr.update(len_ptr="*i32", pt_ptr="*i32", rows_ptr="*i32", cu_q_ptr="*i32", tok_req_ptr="*i32")
            compile_launch(mod.mla_decode_triton_kernel, bits, exact, rows, dict(PAGE=64), ptr)

    # the quantize-and-pack writes: at consecutive positions (from a device-side start) and at page slots
    from quantmla_hf.kernels import quant_pack as qp
    from quantmla_hf.kernels.quant_pack_ref import SCALE_MIN

    fn = qp.quant_pack_fwd_kernel
    for bits, width, slots in ((4, 512, False), (4, 512, True), (2, 512, True), (4, 64, True)):
        const = dict(G=width // 64, BLOCK_G=triton.next_power_of_2(width // 64), GROUP=64, BITS=bits,
                     S_MIN=SCALE_MIN, START_FROM_PTR=True, SLOTS=slots)
        ptr = dict(x_ptr="*bf16", codes_ptr="*u8", scale_ptr="*fp16", zero_ptr="*i8", start_ptr="*i64")
        sig = {n: "constexpr" if n in const else ptr.get(n, "i64") for n in fn.arg_names}
        src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert ".target sm_90" in kernel.asm["ptx"]

    # the paged cache's one-launch write of a layer's new tokens (both packed paths, the sink and recent copies)
    from quantmla_hf.kernels import paged_write as pw

    fn = pw.paged_write_fwd_kernel
    for c_bits, r_bits in ((4, 4), (2, 4), (8, 8), (4, 8)):
        c, r = PathFormat(512, c_bits, 64), PathFormat(64, r_bits, 64)
        const = dict(D_C=512, BLOCK_DC=512, C_G=8, C_BLOCK_G=8, C_GROUP=64, C_BITS=c_bits, C_BYTES=c.code_bytes,
                     D_R=64, BLOCK_DR=64, R_G=1, R_BLOCK_G=1, R_GROUP=64, R_BITS=r_bits, R_BYTES=r.code_bytes,
                     S_MIN=SCALE_MIN, SINK=True, RECENT=True)
        ptr = dict(c_ptr="*bf16", r_ptr="*bf16", slots_ptr="*i64", cc_ptr="*u8", cs_ptr="*fp16", cz_ptr="*i8",
                   rc_ptr="*u8", rs_ptr="*fp16", rz_ptr="*i8", sink_c_ptr="*bf16", sink_r_ptr="*bf16",
                   recent_c_ptr="*bf16", recent_r_ptr="*bf16", copy_ptr="*i64")
        sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert ".target sm_90" in kernel.asm["ptx"]

    # the merge, as the dependent launch it is on Hopper (waits for the decode grid before its first read) and not
    from quantmla_hf.kernels import mla_decode_combine as mc

    fn = mc.combine_kernel
    for dependent, partials, unscale in ((True, "*fp16", 256.0), (False, "*fp32", 1.0)):
        const = dict(D_C=512, BLOCK_S=mc.CHUNK, BLOCK_D=64, N_TAIL=3, LSE_BLOCK=mc.LSE_BLOCK, DEPENDENT=dependent,
                     UNSCALE=unscale)
        ptr = dict(o_part_ptr=partials, lse_part_ptr="*fp32", o_ptr="*fp32", lse_ptr="*fp32")
        sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=dependent))
        ptx = kernel.asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == dependent and kernel.metadata.launch_pdl == dependent
        if dependent:  # the wait comes before any global load
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    print("compiled")
    """
)


def test_decode_kernels_compile_for_sm90_within_shared_memory():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
