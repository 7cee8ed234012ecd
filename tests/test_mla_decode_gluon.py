"""The Gluon (sm_90) decode kernel `kernels/mla_decode_gluon.py` on a machine without a GPU.

Gluon kernels do not run in the Triton interpreter, so the CPU suite checks what it can: the kernel and its
unpacking helper compile for sm_90 with this machine's Triton (wgmma, cp.async and the unpacking order as built by
the compiler; in a subprocess because the test session runs Triton in interpreter mode), the code-word order the
unpacking assumes matches the reference packing, and the dispatch rules. The kernel itself is run and checked
against the fp64 reference on the H200 by `benchmarks/bench_decode.py --check --check-kernels gluon`
(docs/BENCHMARKS.md), which also runs `unpack_group_kernel` against `dequantize_ref` bit for bit.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_gluon as mg
from quantmla_hf.kernels.mla_decode_fast import gluon_measured_faster, use_gluon
from quantmla_hf.kernels.quant_pack_ref import quantize_ref, unpack_codes

COMPILE = textwrap.dedent(
    """
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from quantmla_hf.kernels import mla_decode_gluon as mg

    def build(fn, const, ptr, num_warps, aligned=()):
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
               for n in fn.arg_names}
        # what the launcher specialises at run time: 16-byte aligned tensors, strides that are multiples of 16
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(ptr) + list(aligned)}
        src = gluon._runtime.GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                                                  for k, v in const.items()}, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    for bits in (2, 4, 8):
        ptx = build(mg.unpack_group_kernel, dict(W=2 * bits, BITS=bits, NW=4),
                    dict(w_ptr="*i32", z_ptr="*i8", out_ptr="*fp16"), 4).asm["ptx"]
        assert ".target sm_90" in ptx
    fn = mg.mla_decode_gluon_kernel
    const = dict(GC=8, C_BITS=4, R_BITS=4, S=4, R=128, BM=16, Q_SPLIT=False, STAGES=3, CPV_C=mg.cp_vec(8, 4),
                 CPV_R=mg.cp_vec(8, 4), NW=4, ASYNC=False)
    ptr = dict(q_ptr="*bf16", qr_ptr="*bf16", cc_ptr="*i32", cs_ptr="*fp16", cz_ptr="*i8", rc_ptr="*i32",
               rs_ptr="*fp16", rz_ptr="*i8", snc_ptr="*bf16", snr_ptr="*bf16", rcc_ptr="*bf16", rcr_ptr="*bf16",
               lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    strides = [n for n in fn.arg_names if n.startswith("s_")]  # all multiples of 16 at DeepSeek widths
    kernel = build(fn, const, ptr, 4, strides)
    ptx = kernel.asm["ptx"]
    # the host's shared-memory estimate (what `fit_stages` lowers the stages by) covers what the compiler allocates
    from quantmla_hf import CacheFormat, PathFormat
    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    assert kernel.metadata.shared <= mg.smem_bytes(fmt, 16, 3, False) <= mg.SMEM_LIMIT, kernel.metadata.shared
    n_mma = len(re.findall(r"wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16", ptx))
    n_cp = len(re.findall(r"cp\.async\.cg\.shared\.global [^;]*, 0x10,", ptx))  # 16-byte copies
    # 9 score groups + 8 value groups, 4 k-steps of 16 each, in the packed loop and the two dense loops
    assert n_mma == 3 * (9 + 8) * 4, n_mma
    assert n_cp >= 9, n_cp  # 16-byte copies: 8 content rows of words + 1 RoPE row per thread and issued tile
    print("compiled", n_mma, n_cp)
    """
)


@pytest.mark.skipif(not mg.HAVE_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)")
def test_gluon_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_code_words_hold_the_elements_in_the_order_the_kernel_unpacks(bits):
    """A codes plane viewed as 32-bit words (what the kernel copies) holds element `32 / bits * i + k` at bit
    `k * bits` of word i: the same codes as the reference unpacking, for every width."""
    g = torch.Generator().manual_seed(bits)
    f = PathFormat(512, bits, 64)
    codes, _, _ = quantize_ref(torch.randn(3, 7, 512, generator=g), f)
    words = codes.view(torch.int32)
    assert words.shape == (3, 7, 512 * bits // 32)
    assert torch.equal(mg.codes_from_words(words, bits), unpack_codes(codes, bits).long())


def test_dispatch_rules():
    fmt = lambda cb, rb, dc=512, dr=64, group=64: CacheFormat(PathFormat(dc, cb, group), PathFormat(dr, rb, group))  # noqa: E731
    # Gluon runs on sm_90 only: never on CPU
    assert not mg.gluon_handles(fmt(4, 4), torch.bfloat16, "cpu")
    assert mg.cp_vec(8, 4) == 4 and mg.cp_vec(4, 4) == 2 and mg.cp_vec(16, 8) == 4 and mg.cp_vec(4, 8) == 1
    q = torch.zeros(1, 16, 1, 512, dtype=torch.bfloat16)
    assert not use_gluon(fmt(4, 4), q, {}, {}, q)  # CPU tensors: the Triton kernels


def test_gluon_is_the_default_only_where_it_was_measured_faster():
    # H200 timings (docs/BENCHMARKS.md "Gluon kernel"): 8-bit content at any row count; 2/4-bit content only above
    # 16 query rows (128 heads), where the Triton fast kernel loses; 16-bit paths never (not handled)
    assert gluon_measured_faster(8, 8, 1) and gluon_measured_faster(8, 8, 128)
    assert gluon_measured_faster(4, 4, 128) and gluon_measured_faster(2, 4, 32)
    assert not gluon_measured_faster(4, 4, 16) and not gluon_measured_faster(2, 4, 1)
    # 16 heads: C4R4 measured faster through Gluon at batch 8 and 32 only; C2R4 stays on the Triton fast kernel
    assert gluon_measured_faster(4, 4, 16, 8) and gluon_measured_faster(4, 4, 16, 32)
    assert not gluon_measured_faster(4, 4, 16, 1) and not gluon_measured_faster(4, 4, 16, 64)
    assert not gluon_measured_faster(2, 4, 16, 32)
    assert not gluon_measured_faster(16, 16, 128) and not gluon_measured_faster(4, 8, 128)


def test_contiguous_planes_are_recognised():
    f = fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))

    def planes(p, cap=32, pad=0):
        return {"codes": torch.zeros(2, cap, p.code_bytes + pad, dtype=torch.uint8)[..., : p.code_bytes],
                "scale": torch.ones(2, cap, p.n_groups, dtype=torch.float16),
                "zero": torch.zeros(2, cap, p.n_groups, dtype=torch.int8)}

    assert mg.planes_contiguous(fmt, planes(f.content), planes(f.rope))
    assert not mg.planes_contiguous(fmt, planes(f.content, pad=16), planes(f.rope))  # strided token rows
