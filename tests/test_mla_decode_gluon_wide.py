"""The two-warpgroup register Gluon (sm_90) decode kernel `kernels/mla_decode_gluon_wide.py` on a machine without a GPU.

Gluon kernels do not run in the Triton interpreter. Here: the kernel compiles for sm_90 (in a subprocess: the test
session runs Triton in interpreter mode) at each block size within its shared memory, with `setmaxnreg` for the two
warpgroups, the score `wgmma`s taking the unpacked keys from registers (each warpgroup its own content units, the
leader the RoPE unit too), the value `wgmma`s reading the stored keys, and the column halves of the accumulator
relabelled without data movement (`convert_layout(..., assert_trivial=True)` fails the compile otherwise); no local
memory at the default 32-row blocks; the launcher's argument checks and the dispatch rules. The unit layout and the
asm it shares with the one-warpgroup kernel are tested in tests/test_mla_decode_gluon_regs.py. On the H200,
`benchmarks/bench_decode.py --check --check-kernels gluon-wide` runs it against the fp64 reference (docs/BENCHMARKS.md
"Two-warpgroup register kernel for many heads").
"""

import os
import subprocess
import sys
import textwrap

import pytest

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_gluon as mg
from quantmla_hf.kernels import mla_decode_gluon_wide as mw
from quantmla_hf.kernels.mla_decode_fast import gluon_wide_measured_faster

COMPILE = textwrap.dedent(
    """
    import os, re, subprocess, sys, tempfile, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_gluon as mg
    from quantmla_hf.kernels import mla_decode_gluon_wide as mw

    fn = mw.mla_decode_gluon_wide_kernel
    strides = [n for n in fn.arg_names if n.startswith("s_")]  # all multiples of 16 at DeepSeek widths
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    # (content bits, rows, fp32 queries, store_a, vote): the default launch (vote) and the options
    for cb, bm, q_split, store_a, vote in ((4, 32, False, False, True), (2, 32, True, False, True),
                                           (4, 64, False, False, True), (4, 32, False, True, False),
                                           (4, 32, False, False, False)):
        qd = "*fp32" if q_split else "*bf16"
        ptr = dict(q_ptr=qd, qr_ptr=qd, cc_ptr="*i32", cs_ptr="*fp16", cz_ptr="*i8", rc_ptr="*i32",
                   rs_ptr="*fp16", rz_ptr="*i8", snc_ptr="*bf16", snr_ptr="*bf16", rcc_ptr="*bf16",
                   rcr_ptr="*bf16", lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
        const = dict(GC=8, C_BITS=cb, R_BITS=4, S=4, R=128, BM=bm, Q_SPLIT=q_split, INFLIGHT=mw.INFLIGHT,
                     W_REGS=mw.WORKER_REGS[bm], STORE_A=store_a, VOTE=vote)
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
               for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(ptr) + strides}
        src = gluon._runtime.GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                                                  for k, v in const.items()}, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": mw.LAUNCH_REGS[bm]})
        fmt = CacheFormat(PathFormat(512, cb, 64), PathFormat(64, 4, 64))
        need = mw.smem_bytes(fmt, q_split, bm)
        assert kernel.metadata.shared <= need <= mg.SMEM_LIMIT, (cb, bm, q_split, kernel.metadata.shared, need)
        ptx = kernel.asm["ptx"]
        assert "setmaxnreg" in ptx and "cp.async" not in ptx
        mma = rf"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.f16.f16 \\{{[^}}]*\\}}, "
        per = 2 if q_split else 1
        # scores, A from registers: the leader's 4 content units + RoPE and the worker's 4, 4 k-steps each, in the
        # packed loop and the two copy loops
        n_reg = len(re.findall(mma + r"\\{", ptx))
        assert n_reg == 3 * 9 * 4 * per, (cb, bm, n_reg)
        # values, A (the stored keys) from shared memory: 4 units per warpgroup, 4 k-steps, three loops
        n_smem = len(re.findall(mma + r"%rd", ptx))
        assert n_smem == 3 * 8 * 4, (cb, bm, n_smem)
        # the default launch (32 rows, vote): no local memory (Triton 3.9 keeps one 8-byte value of the option
        # without the vote in local memory)
        if bm == mw.BLOCK_M and vote and os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                                      check=True).stdout
            assert not re.search(r"\\b(LDL|STL)\\b", sass), (cb, bm, q_split)
    print("compiled")
    """
)


@pytest.mark.skipif(not mg.HAVE_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)")
def test_wide_kernel_compiles_for_sm90_two_warpgroups():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(not mg.HAVE_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)")
def test_sass_script_counts_both_packed_loops():
    """`benchmarks/sass_decode.py --wide` (the command behind the SASS figures of docs/KERNELS.md) finds one packed
    loop per warpgroup: the leader unpacks 5 units (4 content + RoPE: 80 multiplies per thread, one per pair) and
    issues their 20 score `wgmma`s, the worker 4 units (64, 16), each plus the 16 value `wgmma`s of its units."""
    import re

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled cuobjdump")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "sass_decode.py")
    out = subprocess.run([sys.executable, script, "C4R4", "--wide"], env=dict(os.environ, TRITON_INTERPRET="0"),
                         capture_output=True, text=True, timeout=900, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^leader packed loop: \d+ .*\(80 unpacking multiplies\)\n.*HGMMA\.64x32x16 36", out.stdout, re.M), \
        out.stdout
    assert re.search(r"^worker packed loop: \d+ .*\(64 unpacking multiplies\)\n.*HGMMA\.64x32x16 32", out.stdout, re.M), \
        out.stdout
    assert "STACK:0" in out.stdout, out.stdout


def test_wide_shared_memory_and_default_block():
    c4r4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    # tiles 64 KB + queries (9 x BM x 64 fp16) + P + partial scores + factors, 1/l, row scales + 1 KB scratch
    assert mw.smem_bytes(c4r4, False, 32) == 65536 + 9 * 32 * 128 + 64 * 32 * 2 + 64 * 32 * 4 + 2 * 32 * 4 + 16 + 1024
    assert mw.smem_bytes(c4r4, True, 32) - mw.smem_bytes(c4r4, False, 32) == 9 * 32 * 128
    assert mw.smem_bytes(c4r4, False, 64) <= mg.SMEM_LIMIT < mw.smem_bytes(c4r4, True, 64)
    assert mw.default_block_m(c4r4, False) == mw.BLOCK_M == 32
    assert mw.default_block_m(c4r4, True) == 32


def test_wide_launch_rejects_bad_arguments():
    c4r4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    args = (None,) * 4 + (c4r4,) + (None,) * 12 + (1.0,)  # q .. rp, fmt, sink_c .. NS, qk_scale
    with pytest.raises(ValueError, match="block_m must be one of"):
        mw.launch_wide(*args, block_m=48)
    with pytest.raises(ValueError, match="inflight must be 0, 1 or 2"):
        mw.launch_wide(*args, inflight=3)
    with pytest.raises(ValueError, match="launch_regs must be a multiple of 8"):
        mw.launch_wide(*args, launch_regs=250)
    with pytest.raises(ValueError, match="worker_regs must be a multiple of 8"):
        mw.launch_wide(*args, launch_regs=128, worker_regs=240)


def test_wide_dispatch_rules():
    # measured faster than the scaled-tile kernel at 128 heads from batch 16 (C4R4, C2R4); not below, not at 16 heads
    assert gluon_wide_measured_faster(4, 4, 128, 16) and gluon_wide_measured_faster(2, 4, 128, 64)
    assert not gluon_wide_measured_faster(4, 4, 128, 8)
    assert not gluon_wide_measured_faster(4, 4, 128, None)
    assert not gluon_wide_measured_faster(4, 4, 16, 64)
    assert not gluon_wide_measured_faster(8, 8, 128, 32)
    assert not gluon_wide_measured_faster(4, 2, 128, 32)
