"""The scaled-tile Gluon (sm_90) decode kernel `kernels/mla_decode_gluon_scaled.py` on a machine without a GPU.

Gluon kernels do not run in the Triton interpreter. Here: the kernel and its unpacking helper compile for sm_90 (in
a subprocess: the test session runs Triton in interpreter mode) with the shared memory that lets two programs share
one SM, the unpacking is the packed `lop3` / `sub.f16x2` / `mul.f16x2` sequence, the column order it produces
(emulated bit for bit in PyTorch from the PTX it runs) holds the dequantized elements the queries and outputs are
permuted by, and the dispatch rules. On the H200, `benchmarks/bench_decode.py --check --check-kernels gluon-scaled`
runs `unpack_scaled_kernel` against the reference dequantization and the kernel against the fp64 reference
(docs/BENCHMARKS.md "Gluon kernel on scaled tiles").
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_gluon as mg
from quantmla_hf.kernels import mla_decode_gluon_scaled as ms
from quantmla_hf.kernels.mla_decode_fast import gluon_default_launch, gluon_scaled_measured_faster, use_gluon
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref, quantize_ref

COMPILE = textwrap.dedent(
    """
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_gluon_scaled as ms

    def build(fn, const, ptr, num_warps, aligned=()):
        sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32")
               for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(ptr) + list(aligned)}
        src = gluon._runtime.GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v
                                                                  for k, v in const.items()}, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    for bits in (2, 4):
        ptx = build(ms.unpack_scaled_kernel, dict(W=2 * bits, BITS=bits, NW=4),
                    dict(w_ptr="*i32", z_ptr="*i8", s_ptr="*fp16", out_ptr="*fp16"), 4).asm["ptx"]
        # 64 tokens x 2*bits words, 16/bits fp16 pairs per word, one lop3 + sub.f16x2 + mul.f16x2 per pair
        n_pairs = 64 * 2 * bits * (16 // bits) // 128
        for op in ("lop3.b32", "sub.f16x2", "mul.f16x2"):
            assert len(re.findall(re.escape(op), ptx)) == n_pairs, (bits, op, len(re.findall(re.escape(op), ptx)))
    fn = ms.mla_decode_gluon_scaled_kernel
    ptr = dict(q_ptr="*bf16", qr_ptr="*bf16", cc_ptr="*i32", cs_ptr="*fp16", cz_ptr="*i8", rc_ptr="*i32",
               rs_ptr="*fp16", rz_ptr="*i8", snc_ptr="*bf16", snr_ptr="*bf16", rcc_ptr="*bf16", rcr_ptr="*bf16",
               lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    strides = [n for n in fn.arg_names if n.startswith("s_")]  # all multiples of 16 at DeepSeek widths
    for cb, bm, nw in ((4, 16, 4), (2, 64, 8)):
        const = dict(GC=8, C_BITS=cb, R_BITS=4, S=4, R=128, BM=bm, Q_SPLIT=False, STAGES=1,
                     CPV_C=ms.exact.cp_vec(2 * cb, nw), CPV_R=ms.exact.cp_vec(8, nw), NW=nw)
        kernel = build(fn, const, ptr, nw, strides)
        fmt = CacheFormat(PathFormat(512, cb, 64), PathFormat(64, 4, 64))
        # the host's estimate covers what the compiler allocates; 16-row blocks: two programs per SM
        assert kernel.metadata.shared <= ms.smem_bytes(fmt, bm, 1, False), (cb, bm, kernel.metadata.shared)
        if bm == 16:
            assert ms.programs_per_sm(fmt, bm, 1, False) == 2
        ptx = kernel.asm["ptx"]
        # one chain of 9 score groups + 8 value groups, 4 k-steps each, in the packed loop and the two dense loops
        n_mma = len(re.findall(r"wgmma.mma_async.sync.aligned.m64n%dk16.f32.f16.f16" % (bm // (nw // 4)), ptx))
        assert n_mma == 3 * (9 + 8) * 4, (cb, n_mma)
        assert "sub.f16x2" in ptx and "mul.f16x2" in ptx
    print("compiled")
    """
)


@pytest.mark.skipif(not mg.HAVE_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)")
def test_scaled_kernel_compiles_for_sm90_two_programs_per_sm():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def _emulate_pair_asm(words: torch.Tensor, zf: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """What `pair_asm(bits)` computes, instruction by instruction, on `words: [T, W]` int32 with per-token fp16
    `zf = 1024 + z` and `s`: `[T, W, 16 / bits, 2]` fp16 (output k of word i, low and high half)."""
    n = 16 // bits
    mask2 = ((1 << bits) - 1) * 0x10001
    w = words.to(torch.int64) & 0xFFFFFFFF
    outs = []
    for k in range(n):
        t = ((w >> (bits * k)) & mask2) | 0x64006400  # lop3 (a & b) | c after the shift
        halves = torch.stack([t & 0xFFFF, t >> 16], dim=-1).to(torch.int16)  # little-endian fp16x2
        x = halves.view(torch.float16)
        x = x - zf[:, None, None]  # sub.f16x2 (exact: both are fp16 integers below 2048)
        outs.append(x * s[:, None, None])  # mul.f16x2: one rounding of the exact product
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("bits", [2, 4])
def test_pairs_in_column_order_hold_the_dequantized_group(bits):
    """Pair p = (16 / bits) * i + k of word i is stored as fp16 columns 2p, 2p + 1: read that way, column c holds
    element `column_order(bits)[c]` of the group, dequantized with one fp16 rounding, for every code and zero."""
    g = torch.Generator().manual_seed(bits)
    f = PathFormat(64, bits, 64)
    codes, scale, zero = quantize_ref(torch.randn(37, 64, generator=g) * 3, f)
    words = codes.view(torch.int32)
    zf = (zero.to(torch.int32) + 1024 + (1 << (bits - 1))).to(torch.float16)[:, 0]
    pairs = _emulate_pair_asm(words, zf, scale[:, 0], bits)
    tile = pairs.reshape(37, 64)  # [T, W, n, 2] -> columns 2 * (n * i + k) + h
    exact = dequantize_ref(codes, torch.ones_like(scale), zero, f, torch.float32)  # code - z
    ref = (exact.half() * scale).float()  # one rounding of (code - z) * s, as the kernel
    pi = ms.column_order(bits)
    assert sorted(pi.tolist()) == list(range(64))  # a permutation of the group
    assert torch.equal(tile.float(), ref[:, pi])
    # and the kernel's dequantized keys differ from fp32 dequantization by at most one fp16 rounding
    full = dequantize_ref(codes, scale, zero, f, torch.float32)
    assert ((tile.float() - full[:, pi]).abs() <= full[:, pi].abs() * 2.0**-11 + 1e-7).all()


def test_pair_asm_operands():
    for bits in (2, 4):
        n = 16 // bits
        asm = ms.pair_asm(bits)
        assert len(re.findall(r"mul\.f16x2 \$(\d+),", asm)) == n  # one output register per pair
        assert sorted(int(x) for x in re.findall(r"mul\.f16x2 \$(\d+),", asm)) == list(range(n))
        assert f"${n + 1}" in asm and f"${n + 2}" in asm and f"${n + 3}" not in asm  # word, 1024 + z, s


def test_scaled_dispatch_rules():
    fmt = lambda cb, rb: CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64))  # noqa: E731
    # measured faster (H200, docs/BENCHMARKS.md "Gluon kernel on scaled tiles"): C4R4 everywhere timed (batch 1 to
    # 64, 16 and 128 heads); C2R4 at batch >= 8 and above 16 rows; 8-bit content never (its keys would round past
    # the 1e-4 LSE bound)
    assert gluon_scaled_measured_faster(4, 4, 16, 8) and gluon_scaled_measured_faster(4, 4, 16, 64)
    assert gluon_scaled_measured_faster(4, 4, 16, 1) and gluon_scaled_measured_faster(4, 4, 16)
    assert gluon_scaled_measured_faster(2, 4, 16, 32) and gluon_scaled_measured_faster(4, 4, 128, 1)
    assert not gluon_scaled_measured_faster(2, 4, 16, 1) and not gluon_scaled_measured_faster(2, 4, 16)
    assert not gluon_scaled_measured_faster(8, 8, 16, 32) and not gluon_scaled_measured_faster(16, 16, 128, 32)
    assert not ms.scaled_handles(fmt(4, 4), torch.bfloat16, "cpu")  # sm_90 only
    q = torch.zeros(8, 16, 1, 512, dtype=torch.bfloat16)
    assert not use_gluon(fmt(4, 4), q, {}, {}, q)  # CPU tensors: the Triton kernels
    # launches: 16 rows two programs per SM, 128 heads 64-row blocks over two warpgroups
    assert gluon_default_launch(16, scaled=True) == dict(block_m=16, num_warps=4, stages=1, waves=8, scaled=True)
    assert gluon_default_launch(128, scaled=True)["block_m"] == 64
    assert gluon_default_launch(32, scaled=True)["block_m"] == 32
    c4 = fmt(4, 4)
    assert ms.programs_per_sm(c4, 16, 1, False) == 2 and ms.programs_per_sm(c4, 16, 2, False) == 1
    assert ms.smem_bytes(c4, 64, 1, True) > ms.SMEM_LIMIT >= ms.smem_bytes(c4, 32, 1, True)  # fp32 q: 32-row blocks
