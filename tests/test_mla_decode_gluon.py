"""The Hopper (sm_90) Gluon decode kernels (`kernels/mla_decode_gluon_regs.py`, `kernels/mla_decode_gluon_wide.py`,
shared pieces in `kernels/mla_decode_gluon_common.py`) on a machine without a GPU.

Gluon kernels do not run in the Triton interpreter. Here: each kernel compiles for sm_90 (in a subprocess: the test
session runs Triton in interpreter mode) within its shared memory, with the score `wgmma`s taking the unpacked keys
from registers and no cp.async; the unit layout (which thread unpacks which code words, and the two register
relabellings the kernels make of them, emulated here with the same permutes and reshapes, and the asm instruction by
instruction) puts the dequantized keys at the channels that `score_channel` and `value_channel` say; the SASS
script finds the packed loops. On the H200, `benchmarks/bench_decode.py --check` runs them against the fp64
reference.
"""

import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap

import gluon_layout
import pytest
import torch
import triton

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_gluon_common as mc
from quantmla_hf.kernels import mla_decode_gluon_regs as mr
from quantmla_hf.kernels import mla_decode_gluon_split as ms
from quantmla_hf.kernels import mla_decode_gluon_wide as mw
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref, quantize_ref

NO_GLUON = "this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)"


def _compile(script: str):
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


# the compile scripts below build their launches with benchmarks/sass_decode.py (the SASS figures' command)
COMPILE_PREFIX = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")!r})
    import sass_decode as sd
    """
)

COMPILE_REGS = COMPILE_PREFIX + textwrap.dedent(
    """
    import re
    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_gluon_common as mc
    from quantmla_hf.kernels import mla_decode_gluon_regs as mr

    # (content bits, RoPE bits, fp32 queries, paged): the launch of each format
    # and the paged launch (page pools read through a page table: int32 lengths, copy rows and page numbers)
    for cb, rb, q_split, paged in ((4, 4, False, False), (2, 4, False, False), (4, 4, True, False),
                                   (8, 8, False, False), (4, 8, False, False), (4, 4, False, True),
                                   (2, 4, False, True)):
        kernel = sd.compile_regs(cb, rb, q_split=q_split, inflight=mr.INFLIGHT[cb], paged=paged)
        assert not sd.wgmma_serialized(kernel), (cb, rb, paged, sd.ptxas_facts(kernel))  # the tensor pipe kept full
        fmt = CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64))
        need = mr.smem_bytes(fmt, q_split)
        assert kernel.metadata.shared <= need, (cb, q_split, kernel.metadata.shared, need)
        assert mc.SMEM_PER_SM // (need + 1024) >= 2, need  # two programs per SM
        ptx = kernel.asm["ptx"]
        mma = r"wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 \\{[^}]*\\}, "
        per = 2 if q_split else 1
        # scores: 9 units x 4 k-steps with the A operand in registers, in the packed loop and the copy loop (the
        # sink's or the recent ring's tile, `_copy_tile`) (8-bit RoPE: the unit's integer codes)
        codes8 = 1 if rb == 8 else 0  # the RoPE unit as integer codes (no step)
        n_reg = 2 * 9 * 4 * per
        assert len(re.findall(mma + r"\\{", ptx)) == n_reg, (cb, len(re.findall(mma + r"\\{", ptx)))
        # values: 8 units x 4 k-steps with the A operand (the stored keys) from shared memory
        assert len(re.findall(mma + r"%rd", ptx)) == 2 * 8 * 4, (cb, len(re.findall(mma + r"%rd", ptx)))
        assert "cp.async" not in ptx  # the code words go straight to registers
        # the metadata's fp16x2 pairs by `meta_asm`: one per step, i.e. per thread and tile groups q, q + 4 and RoPE
        # of its two tokens, in the packed loop
        n_meta = len(re.findall(r"xor\\.b32 [^;]*0x64806480", ptx))
        assert n_meta == 3 * 2, (cb, n_meta)
        # the P tile goes to shared memory by one stmatrix.x4 per loop, twice (at once, and again in the voted
        # branch where a row's reference moves); the content keys by plain stores
        n_stm = len(re.findall(r"stmatrix", ptx))
        assert n_stm == 2 * 2, (cb, n_stm)
        # below 8 bits the next tile's words are asked of L2 at the top of each packed tile (`_prefetch_rows`): per
        # thread and token every 128-byte line its row pointers start, of the content row's two halves at 4 bits
        # (one 128-byte row at 2) and of the RoPE row
        n_pf = 2 * ((2 if cb == 4 else 1) + 1) if cb < 8 else 0
        assert ptx.count("prefetch.global.L2") == n_pf, (cb, paged, ptx.count("prefetch.global.L2"))
        # the content keys go to eight separate buffers: no barrier between the units' stores (one buffer indexed
        # per unit took one before each store, 46 in all with Triton 3.6)
        assert ptx.count("bar.sync") <= 27, (cb, ptx.count("bar.sync"))
        # one lop3 + mul.f16x2 per pair: 9 units x 2 tokens x 8 pairs per thread and tile; at 2 and 4 bits half the
        # pairs made code - z by sub.f16x2, half by fma.rn.f16x2 (`half_asm`), at 8 bits every pair by sub.f16x2 (the
        # RoPE unit's integer codes: no mul.f16x2)
        per, per8, perc = 9 * 2 * 8, (8 if cb == 8 else 0) * 2 * 8, codes8 * 2 * 8
        want = {"0x64006400": per, "mul.f16x2": per - perc, "sub.f16x2": per8 + perc + (per - per8 - perc) // 2,
                "fma.rn.f16x2": (per - per8 - perc) // 2}
        for op, n_op in want.items():
            assert len(re.findall(re.escape(op), ptx)) == n_op, (cb, op, len(re.findall(re.escape(op), ptx)))
    print("compiled")
    """
)


COMPILE_WIDE = COMPILE_PREFIX + textwrap.dedent(
    """
    import re
    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_gluon_common as mc
    from quantmla_hf.kernels import mla_decode_gluon_wide as mw

    bm = mw.BLOCK_M
    # (content bits, RoPE bits, fp32 queries, paged): the launch of each format and the paged launch
    for cb, rb, q_split, paged in ((4, 4, False, False), (2, 4, False, False), (2, 4, True, False),
                                   (4, 4, False, True), (8, 8, False, False), (4, 8, False, True)):
        kernel = sd.compile_wide(cb, rb, q_split=q_split, paged=paged)
        assert not sd.wgmma_serialized(kernel), (cb, rb, paged, sd.ptxas_facts(kernel))  # the tensor pipe kept full
        fmt = CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64))
        need = mw.smem_bytes(fmt, q_split)
        assert kernel.metadata.shared <= need <= mc.SMEM_LIMIT, (cb, bm, q_split, kernel.metadata.shared, need)
        ptx = kernel.asm["ptx"]
        assert "setmaxnreg" in ptx and "cp.async" not in ptx
        mma = rf"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.f16.f16 \\{{[^}}]*\\}}, "
        per = 2 if q_split else 1
        # scores, A from registers: the leader's 4 content units + RoPE and the worker's 4, 4 k-steps each, in the
        # packed loop (8-bit RoPE on its integer codes) and the copy tile
        n_reg = len(re.findall(mma + r"\\{", ptx))
        assert n_reg == 2 * 9 * 4 * per, (cb, rb, bm, n_reg)
        # values, A (the stored keys) from shared memory: 4 units per warpgroup, 4 k-steps, packed loop and copy tile
        n_smem = len(re.findall(mma + r"%rd", ptx))
        assert n_smem == 2 * 8 * 4, (cb, bm, n_smem)
        # no local memory in the launches of bf16 queries on 2/4-bit contiguous planes (where this Triton bundles
        # cuobjdump); Triton 3.6 spills a few registers in the fp32-query, paged and 8-bit launches, 3.9 does not
        if q_split or paged or cb == 8:
            continue
        try:
            sass = sd.disassemble(kernel.asm["cubin"], "-sass")
        except FileNotFoundError:
            continue
        assert not re.search(r"\\b(LDL|STL)\\b", sass), (cb, bm, q_split)
    print("compiled")
    """
)


COMPILE_SPLIT = COMPILE_PREFIX + textwrap.dedent(
    r"""
    import re
    from quantmla_hf import CacheFormat, PathFormat
    from quantmla_hf.kernels import mla_decode_gluon_common as mc
    from quantmla_hf.kernels import mla_decode_gluon_split as mp

    def split_ptx(cb, rb, paged):
        # the launch's PTX, once its wgmmas are not serialized (the tensor pipe kept full), its shared memory is
        # within its budget and its warpgroups take their registers (the scorer gives registers back, the value
        # worker takes them, the default warps keep the rest)
        kernel = sd.compile_split(cb, rb, paged=paged)
        assert not sd.wgmma_serialized(kernel), (cb, rb, paged, sd.ptxas_facts(kernel))
        fmt = CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64))
        need = mp.smem_bytes(fmt, False)
        assert kernel.metadata.shared <= need <= mc.SMEM_LIMIT, (cb, paged, kernel.metadata.shared, need)
        ptx = kernel.asm["ptx"]
        v_regs, s_regs = mp.registers(fmt, paged)
        for n in (s_regs, v_regs):
            assert f"setmaxnreg.inc.sync.aligned.u32 \t{n};" in ptx, (cb, rb, paged, n)
        if cb != 16:
            assert f"setmaxnreg.dec.sync.aligned.u32 \t{512 - 8 - v_regs - s_regs};" in ptx
        return ptx

    mma = rf"wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 \{{[^}}]*\}}, "
    for cb, rb, paged in ((2, 4, False), (4, 4, False), (2, 4, True), (4, 4, True), (4, 8, False), (2, 8, True),
                          (8, 8, False), (8, 8, True)):
        ptx = split_ptx(cb, rb, paged)
        # the scores with the keys in registers: 9 units x 4 k-steps in the loop and as many for the copy tile; the
        # values from shared memory: 4 units x 4 k-steps per value warpgroup
        assert len(re.findall(mma + r"\{", ptx)) == 2 * 9 * 4, (cb, paged)
        assert len(re.findall(mma + r"%rd", ptx)) == 2 * 4 * 4, (cb, paged)
        assert "stmatrix.sync.aligned" in ptx  # the keys stored as their A fragments are
        assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive" in ptx
    # 16-bit planes (C16R16): the content keys copied into the value stages (cp.async, 16 bytes), scored from there;
    # only the RoPE unit's keys are register operands; nothing unpacked, no keys stored from registers
    # (paged: page pools, no copies, S = R = 0)
    mma = rf"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 \{{[^}}]*\}}, "
    for paged in (False, True):
        ptx = split_ptx(16, 16, paged)
        assert len(re.findall(mma + r"\{", ptx)) == 2 * 4  # the RoPE unit, in the loop and the copy tile
        assert len(re.findall(mma + r"%rd", ptx)) == 2 * 8 * 4 + 2 * 4 * 4  # content scores (both), values
        assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
        assert "stmatrix" not in ptx and "mul.f16x2" not in ptx
    print("compiled")
    """
)


PTXAS_NOTES = COMPILE_PREFIX + textwrap.dedent(
    """
    import types

    # ptxas 13.4's -v notes on a consumer warpgroup 8 registers short, then on one with enough
    short = types.SimpleNamespace(ptxas_log=(
        "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the function 'mla_decode_split_kernel'\\n"
        "ptxas info    : Function properties for mla_decode_split_kernel\\n"
        "    64 bytes stack frame, 76 bytes spill stores, 100 bytes spill loads\\n"))
    assert sd.wgmma_serialized(short) == ["C7512"], sd.wgmma_serialized(short)
    assert sd.ptxas_facts(short) == "ptxas: wgmmas serialized (C7512), spills 76 B stored, 100 B loaded"
    enough = types.SimpleNamespace(ptxas_log="    80 bytes stack frame, 152 bytes spill stores, 198 bytes spill loads")
    assert not sd.wgmma_serialized(enough)
    assert sd.ptxas_facts(enough) == "ptxas: wgmmas not serialized, spills 152 B stored, 198 B loaded"
    print("compiled")
    """
)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_ptxas_notes_of_serialized_wgmmas_are_read():
    """`sass_decode.ptxas_facts` reads ptxas's note that it serialized a kernel's wgmmas (the compile tests assert
    that no launch has one) and its spill bytes."""
    _compile(PTXAS_NOTES)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_regs_kernel_compiles_for_sm90_register_operands():
    _compile(COMPILE_REGS)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_wide_kernel_compiles_for_sm90_two_warpgroups():
    _compile(COMPILE_WIDE)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_split_kernel_compiles_for_sm90_scorer_and_value_warpgroups():
    _compile(COMPILE_SPLIT)


def test_split_shared_memory_and_formats():
    c2r4 = CacheFormat(PathFormat(512, 2, 64), PathFormat(64, 4, 64))
    # queries (9 units x 64 rows x 64 fp16) + content keys (2 stages x 8 units x 64 x 64 fp16) + scores (64 x 64 fp32)
    # + P (64 x 64 fp16) + three row factors, 8 votes, 9 barriers + 1 KB scratch: under the 227 KB of one program
    assert ms.smem_bytes(c2r4, False) == 9 * 8192 + 2 * 8 * 8192 + 64 * 64 * 6 + 3 * 256 + 32 + 72 + 1024
    assert ms.smem_bytes(c2r4, False) <= mc.SMEM_LIMIT
    for c, r in ((2, 4), (4, 4), (4, 8), (2, 8)):  # 8-bit RoPE: its integer codes scored apart
        f = CacheFormat(PathFormat(512, c, 64), PathFormat(64, r, 64))
        assert ms.split_handles(f) and ms.registers(f, False) == ms.REGS[c, r, False]
    c8r8 = CacheFormat(PathFormat(512, 8, 64), PathFormat(64, 8, 64))  # 8-bit keys: taken
    assert ms.split_handles(c8r8) and ms.registers(c8r8, True) == ms.REGS[8, 8, True]
    for c, r, dc in ((8, 4, 512), (4, 4, 256)):  # 8-bit content with 4-bit RoPE, 4 content groups: not this kernel's
        assert not ms.split_handles(CacheFormat(PathFormat(dc, c, 64), PathFormat(64, r, 64)))
    assert ms.registers(CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 2, 64)), True) == ms.REGS[4, 4, True]
    # 16-bit planes at DeepSeek's widths (copied into the value stages: the same shared memory), none at others
    c16 = CacheFormat(PathFormat(512, 16, 64), PathFormat(64, 16, 64))
    assert ms.split_handles(c16) and ms.dense(c16) and ms.registers(c16, False) == ms.REGS[16, 16, False]
    assert ms.registers(c16, True) == ms.REGS[16, 16, True]
    assert ms.smem_bytes(c16, False) == ms.smem_bytes(c2r4, False)
    assert not ms.split_handles(CacheFormat(PathFormat(256, 16, 64), PathFormat(64, 16, 64)))
    assert not ms.dense(CacheFormat(PathFormat(512, 16, 64), PathFormat(64, 4, 64)))


def test_wide_shared_memory():
    c4r4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64))
    # tiles 64 KB + queries (9 x BM x 64 fp16) + P + partial scores + factors, 1/l, row scales + 1 KB scratch
    assert mw.smem_bytes(c4r4, False) == 65536 + 9 * 32 * 128 + 64 * 32 * 2 + 64 * 32 * 4 + 2 * 32 * 4 + 16 + 1024
    assert mw.smem_bytes(c4r4, True) - mw.smem_bytes(c4r4, False) == 9 * 32 * 128
    assert mw.smem_bytes(c4r4, True) <= mc.SMEM_LIMIT


def _emulate_half_asm(words: torch.Tensor, zf: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """What `half_asm(bits)` computes, instruction by instruction, on `words: [...]` int32 with fp16 `zf = 1024 + z`
    and `s` broadcast against them: `[..., 2, 16 / bits]` fp16, element `(16 / bits) * e + k` of each word at
    `[..., e, k]` (output k + n * e: half e of the k-th register). At 2 and 4 bits the odd elements of a shift group
    are masked one field higher and brought back by `fma.rn.f16x2` with `2**-bits` and `zh = -(1024 / 2**bits + z)`
    (`meta_asm`'s `zh`, derived here from `zf`)."""
    n = 16 // bits
    mask = (1 << bits) - 1
    w = words.to(torch.int64) & 0xFFFFFFFF
    zh = -(zf.float() - 1024 + 1024 / 2**bits)  # exact integers
    outs = []
    for k in range(n):
        grp, odd = divmod(k, 2) if bits < 8 else (k, 0)
        shift, field = (2 * bits * grp, bits * odd) if bits < 8 else (bits * k, 0)
        t = (((w >> shift) & ((mask << field) * 0x10001)) | 0x64006400)  # shr, then lop3 (a & b) | c
        halves = torch.stack([t & 0xFFFF, t >> 16], dim=-1).to(torch.int16).view(torch.float16)  # mov {lo, hi}
        if odd:  # fma.rn.f16x2: exact (a power-of-two scaling plus an integer, to an integer)
            code_z = (halves.float() * 2.0**-bits + zh[..., None]).half()
            assert torch.equal(code_z.float(), halves.float() * 2.0**-bits + zh[..., None])
        else:
            code_z = halves - zf[..., None]  # sub.f16x2 (exact)
        outs.append(code_z * s[..., None])  # mul.f16x2 (one rounding)
    return torch.stack(outs, dim=-1)  # [..., e, k]


@pytest.mark.parametrize("content_bits,rope_bits", [(4, 4), (2, 4), (2, 2), (8, 8)])
@pytest.mark.parametrize("n_groups", [8, 4])
def test_unit_views_hold_the_channels_the_maps_say(content_bits, rope_bits, n_groups):
    """Emulate what the threads of one 64-token tile hold: thread q of unit u loads the words of its 16 channels
    from `unit_base(u, q)`, unpacks them (the asm, emulated), and the kernel views the registers as the score A
    operand (`_a_view`) and as the stored value tile (`_v_view`); the same permutes and reshapes here must put the
    dequantized key of channel `score_channel(u)[c]` / `value_channel(u)[c]` at column c, and the units cover
    every channel once."""
    T = 64
    g = torch.Generator().manual_seed(content_bits * 10 + rope_bits + n_groups)
    for u in range(n_groups + 1):
        rope = u == n_groups
        bits = rope_bits if rope else content_bits
        f = PathFormat(64 if rope else 64 * n_groups, bits, 64)
        codes, scale, zero = quantize_ref(torch.randn(T, f.dim, generator=g) * 3, f)
        zero = torch.randint(-3, 4, zero.shape, generator=g, dtype=torch.int8)  # also zeros outside the code range
        words = codes.view(torch.int32)  # [T, row words]
        wu, q = bits // 2, torch.arange(4)
        word_idx = (gluon_layout.unit_base(u, q, n_groups) * bits // 32)[:, None] + torch.arange(wu)  # [4, WU]
        w = words[:, word_idx]  # [T, 4, WU]
        grp = torch.zeros(4, dtype=torch.long) if rope else q + 4 * (u // 4)
        zf = (zero[:, grp].to(torch.int32) + 1024 + (1 << (bits - 1))).to(torch.float16)  # `meta_asm`'s zz, [T, 4]
        x5 = _emulate_half_asm(w, zf[:, :, None], scale[:, grp][:, :, None], bits)  # [T, 4, WU, 2, n]
        # `_a_view`
        a = x5.permute(0, 1, 2, 4, 3).reshape(T, 4, 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(T, 64)
        # `_v_view`
        v = x5.reshape(T, 4, wu, 2, x5.shape[-1] // 2, 2).permute(0, 1, 5, 2, 4, 3).reshape(T, 64)
        exact = dequantize_ref(codes, torch.ones_like(scale), zero, f, torch.float32)  # code - z
        ref = (exact.half() * scale.repeat_interleave(64, dim=1)).float()  # one rounding, as the kernel
        sc = gluon_layout.score_channel(u, bits, n_groups)
        assert torch.equal(a.float(), ref[:, sc]), u
        # the stored tile of the register kernels' values (the split kernel stores its A fragments, `a`)
        vc = gluon_layout.value_channel(u, bits, n_groups)
        assert torch.equal(v.float(), ref[:, vc]), u
        # `_store_o`: a thread's rows c and c + 8 (c % 16 < 8) are adjacent channels, stored as one pair
        lead = vc.reshape(4, 2, 8)
        assert torch.equal(lead[:, 1], lead[:, 0] + 1), u
    for bits in (2, 4):
        content = torch.cat([gluon_layout.score_channel(u, bits, n_groups) for u in range(n_groups)])
        values = torch.cat([gluon_layout.value_channel(u, bits, n_groups) for u in range(n_groups)])
        assert sorted(content.tolist()) == list(range(64 * n_groups))
        assert sorted(values.tolist()) == list(range(64 * n_groups))
        assert sorted(gluon_layout.score_channel(n_groups, bits, n_groups).tolist()) == list(range(64))
        assert sorted(gluon_layout.value_channel(n_groups, bits, n_groups).tolist()) == list(range(64))


@pytest.mark.parametrize("bits", [2, 4])
def test_split_kernel_writes_each_thread_a_contiguous_run(bits):
    """The split kernel's output store (`_store_unit`): the 16 accumulator columns a thread of a quad holds, put in
    its order, are 16 contiguous channels from `unit_base(u, q)`, and the four threads cover the unit's 64."""
    for u in range(8):
        run = gluon_layout.run_channel(u, bits, 8)
        for q in range(4):
            assert torch.equal(run[q], gluon_layout.unit_base(u, q, 8) + torch.arange(16)), (u, q)
        assert sorted(run.flatten().tolist()) == sorted(gluon_layout.score_channel(u, bits, 8).tolist())


def _emulate_meta_asm(z: torch.Tensor, s: torch.Tensor, bits: int):
    """What `meta_asm(bits)` computes, instruction by instruction, from stored zero points `z` int8 and steps `s`
    fp16: `(zz, ss, zh)` as `[..., 2]` fp16 halves."""
    asm = mc.meta_asm(bits)
    c1, c2 = (int(x, 16) for x in re.findall(r"mov\.b32 c, (0x[0-9a-f]+);", asm))
    b = z.to(torch.int32) & 0xFF  # the byte, zero-extended (the kernel's uint8 -> int32)
    x = (b | (b << 16)) ^ 0x64806480  # prmt 0x4040 with 0, then xor

    def halves(v):
        v = torch.as_tensor(v, dtype=torch.int64) & 0xFFFFFFFF
        return torch.stack([v & 0xFFFF, v >> 16], dim=-1).to(torch.int32).to(torch.int16).view(torch.float16)

    zz = (halves(x).float() + halves(c1).float()).half()  # add.rn.f16x2
    zh = (halves(c2).float() - zz.float()).half()  # sub.rn.f16x2
    ss = torch.stack([s, s], dim=-1)  # mov.b32 {s, s}
    return zz, ss, zh


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_meta_asm_gives_the_pairs_of_the_unpacking(bits):
    """Every stored zero point (all 256 int8 values, also those outside the code range) and a spread of steps: the
    pairs are exactly `(1024 + z, 1024 + z)`, `(s, s)` and `-(1024 / 2**bits + z)` with `z = stored + 2**(bits - 1)`,
    the operands `half_asm` expects, all exact fp16 integers."""
    z = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    s = (torch.rand(256, generator=torch.Generator().manual_seed(bits)) * 4 + 1e-3).half()
    zz, ss, zh = _emulate_meta_asm(z, s, bits)
    true_z = z.double() + (1 << (bits - 1))
    assert torch.equal(zz.double(), torch.stack([1024 + true_z] * 2, dim=-1))
    assert torch.equal(zh.double(), torch.stack([-(1024 / 2**bits + true_z)] * 2, dim=-1))
    assert torch.equal(ss, torch.stack([s, s], dim=-1))
    assert len(re.findall(r"^(prmt|xor|add|sub|mov)", mc.meta_asm(bits), flags=re.M)) == 7  # 5 + 2 constants


def test_half_asm_operands():
    for bits in (2, 4):
        n = 16 // bits
        asm = mc.half_asm(bits)
        outs = [int(x) for pair in re.findall(r"mov\.b32 \{\$(\d+), \$(\d+)\}", asm) for x in pair]
        assert sorted(outs) == list(range(2 * n))  # every fp16 output written once
        assert f"${2 * n + 4}" in asm and f"${2 * n + 5}" not in asm  # word, 1024 + z, s, zh, 2**-bits
        assert len(re.findall(r"lop3\.b32", asm)) == len(re.findall(r"mul\.f16x2", asm)) == n
        # one shift per group of two elements after the first: half of masking every element at bit 0
        assert len(re.findall(r"shr\.u32", asm)) == n // 2 - 1
        assert len(re.findall(r"sub\.f16x2", asm)) == len(re.findall(r"fma\.rn\.f16x2", asm)) == n // 2


@pytest.mark.parametrize("n_groups", [8, 4])
def test_unit_pairs_are_contiguous_in_a_group(n_groups):
    """The kernel loads units u and u + 1 (u even) of a thread with one vector load from `unit_base(u, q)`: that is
    only right if unit u + 1's 16 channels follow unit u's, in the same quantization group (one step and zero point
    for both)."""
    for q in range(4):
        for u in range(0, n_groups, 2):
            lo, hi = gluon_layout.unit_base(u, q, n_groups), gluon_layout.unit_base(u + 1, q, n_groups)
            assert hi == lo + 16, (q, u, lo, hi)
            assert lo // 64 == (hi + 15) // 64, (q, u, lo, hi)


def _sass_script(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`benchmarks/sass_decode.py ARGS` in a subprocess (compiling, not interpreting); skips the test where this
    Triton bundles no `cuobjdump`."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled cuobjdump")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "sass_decode.py")
    return subprocess.run([sys.executable, script, *args], env=dict(os.environ, TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=timeout, cwd="/")


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_sass_script_counts_the_packed_loop(tmp_path):
    """`benchmarks/sass_decode.py` (the command behind the SASS figures of docs/KERNELS.md) finds the packed-tile loop
    of the compiled kernel: one unpacking multiply per pair of elements (9 units x 2 tokens x 8 pairs per thread) and
    the 68 `wgmma`s of a tile (36 score, 32 value). Run with `--tree DIR` (how a change is compiled before it is
    timed) on a copy of this tree whose 4-bit launch keeps one score unit in flight (this tree's keeps none): the
    copy's kernel with the copy's own settings."""
    assert mr.INFLIGHT[4] == 0
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    tree = tmp_path / "tree"
    for folder in ("kernels", "quantmla_hf"):
        shutil.copytree(os.path.join(root, folder), tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "assets"))
    regs = tree / "kernels" / "mla_decode_gluon_regs.py"
    text = regs.read_text()
    assert text.count("INFLIGHT = {4: 0,") == 1
    regs.write_text(text.replace("INFLIGHT = {4: 0,", "INFLIGHT = {4: 1,"))
    out = _sass_script("C4R4", "--tree", str(tree))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"C4R4 of {tree} | bf16 queries | inflight 1 |" in out.stdout, out.stdout
    assert re.search(r"^packed loop: \d+ .*\(144 unpacking multiplies, .*, 0 local-memory\)", out.stdout, re.M), \
        out.stdout
    floor = re.search(r"^packed loop: (\d+) SASS .*; issue floor (\d+) cycles$", out.stdout, re.M)
    assert floor and int(floor.group(2)) >= int(floor.group(1)), out.stdout  # a stall count of at least 1 each
    assert re.search(r"^HGMMA\.64x16x16\s+68$", out.stdout, re.M), out.stdout
    # barriers per tile: the first unit's (the previous tile's value reads), P's, the vote's read-back and its rare
    # branch; none between the units' key stores (11 per tile with one key buffer indexed per unit, Triton 3.6)
    bars = re.search(r"^BAR\.SYNC\s+(\d+)$", out.stdout, re.M)
    assert bars and int(bars.group(1)) <= 5, out.stdout


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_shared_bytes_counts_wgmma_operands_and_warp_accesses():
    """`sass_decode.shared_bytes`: a wgmma reads B (`N x K` fp16) from shared memory, and A (`M x K`) too where its
    first source is a descriptor, not registers; a warp's store or load moves 32 lanes at its width, its `stmatrix`
    128 bytes a matrix."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import sass_decode as sd

    loop = ["HGMMA.64x64x16.F32 R24, gdesc[UR4].tnspA.tnspB, R24",  # A and B from shared: 2 * 16 * (64 + 64)
            "HGMMA.64x32x16.F32 R24, R120, gdesc[UR8], R24, gsb0",  # A from registers: 2 * 16 * 32
            "@!P0 STS.128 [R10+UR31+0x400], R4", "STS [R3], R2", "LDS.64 R4, [R7]", "LDSM.16.M88.4 R4, [R7]",
            "STL [R1+0x10], R9", "LDG.E.128 R44, desc[UR24][R2.64]", "STSM.16.M88.4 [R116+0x2000], R56"]
    assert sd.shared_bytes(loop) == dict(wgmma=4096 + 1024, stores=32 * 16 + 32 * 4 + 4 * 128, loads=32 * 8)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_load_lead_counts_round_the_loop_to_the_first_use():
    """`sass_decode.load_lead`: how many instructions after a wide load its words are first used, going round the
    loop; the zeroing before a masked load and the load itself are not uses, a register of another number is not one
    of its registers."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import sass_decode as sd

    loop = ["LOP3.LUT R9, R41, 0xf000f, R20, 0xea, !PT",  # reads R41, a register of the second load
            "CS2R R44, SRZ", "@!P4 LDG.E.128 R44, desc[UR38][R22.64]",
            "IADD3 R140, R4, R1, RZ",  # R140 and R4: not R44..R47
            "HMUL2 R5, R46, R7.H0_H0",  # the first use of the first load, two after it
            "@!P4 LDG.E.64 R40, desc[UR38][R24.64]", "FADD R1, R2, R3", "SHF.R.U32.HI R8, RZ, 0x8, R12"]
    assert sd.load_lead(loop) == [(2, 44, 2), (5, 40, 3)]
    assert sd.load_lead(["@!P4 LDG.E.128 R44, desc[UR38][R22.64]", "FADD R1, R2, R3"]) == [(0, 44, None)]


def _control(wb=7, rb=7, wait=0, stall=1):
    """sm_70+ control bits of one instruction (the high 64 bits of its encoding shifted right by 41)."""
    return stall | wb << 5 | rb << 8 | wait << 11


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_scoreboard_waits_cover_every_load_pending_on_the_scoreboard():
    """`sass_decode.scoreboard_waits`: a wait on a scoreboard covers every global load set on it since it was last
    waited on, going round the loop (the load at the end of the loop is pending at the next pass's wait); a wait on
    a shared load's scoreboard is not reported; the lead counts from the youngest load covered. The waits for the
    loads' data (write scoreboards) and for their address registers (read scoreboards) are told apart."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import sass_decode as sd

    loop = ["LDG.E.U16 R5, desc[UR4][R2.64]", "@!P4 LDG.E.128 R8, desc[UR4][R3.64]", "IADD3 R1, R1, 0x1, RZ",
            "SEL R5, R5, RZ, P0", "LDS R9, [R4]", "FADD R9, R9, R1", "LDG.E.64 R12, desc[UR4][R6.64]",
            "IADD3 R6, R6, 0x40, RZ"]
    controls = [_control(wb=5), _control(wb=5), _control(), _control(wait=1 << 5), _control(wb=0),
                _control(wait=1), _control(wb=5, rb=1), _control(wait=1 << 1)]
    assert sd.scoreboard_waits(loop, controls) == [(3, [(0, "LDG.E.U16"), (1, "LDG.E.128"), (6, "LDG.E.64")], 2)]
    # the last instruction overwrites load 6's address register: it waits for that load's read scoreboard only
    assert sd.scoreboard_waits(loop, controls, operands=True) == [(7, [(6, "LDG.E.64")], 1)]
    # the same loop in `cuobjdump -sass` form (each instruction's high encoding bits on the line after it)
    sass = "\n".join(f"        /*{16 * i:04x}*/  {t} ;  /* 0x{i:016x} */\n  /* 0x{c << 41:016x} */"
                     for i, (t, c) in enumerate(zip(loop + ["HMUL2 R1, R2, R3", "BRA 0x0"], controls + [0, 0])))
    got_loop, got_controls = sd.packed_loop(sass)
    assert got_loop == loop + ["HMUL2 R1, R2, R3", "BRA 0x0"] and got_controls == controls + [0, 0]


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_issue_floor_sums_the_stall_counts_alone():
    """`sass_decode.issue_floor`: the cycles a warp needs to issue a loop with nothing to wait for are the stall
    counts (bits 0-3 of the control bits), whatever scoreboards the instructions set or wait on."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import sass_decode as sd

    controls = [_control(stall=1), _control(wb=2, stall=4), _control(wait=0b101001, rb=3, stall=15), _control()]
    assert sd.issue_floor(controls) == 1 + 4 + 15 + 1
    assert sd.issue_floor([c | 1 << 4 for c in controls]) == 21  # the yield bit is no stall


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_sass_dump_writes_comparable_sass(tmp_path):
    """`sass_decode.py --dump` (how two trees' kernels are compared without a GPU) writes one file per launch with
    the instruction addresses removed, so that the same code compiled twice gives identical files."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled cuobjdump")
    launch = [(4, 4, 8, False, False, False)]  # the C4R4 register program (compiled by the test above too)
    portable = [(4, 4, 64, 16, False, 0)]  # and the portable kernel's C4R4 launch at 16 rows
    for d in ("a", "b"):
        _compile(COMPILE_PREFIX + f"sd.dump({str(tmp_path / d)!r}, {launch!r}, {portable!r}, split_launches=[])\n"
                 "print('compiled')\n")
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == ["C4R4_8groups_bf16_contiguous_regs.sass", "combine_512cols_1tail.sass", "combine_64cols_3tail.sass",
                     "portable_C4R4_rope64_16rows_bf16_page0.sass", "quant_pack_2bit_512wide_slots.sass",
                     "quant_pack_4bit_512wide_start.sass", "quant_pack_4bit_64wide_slots.sass"]
    for name in files:
        a, b = ((tmp_path / d / name).read_text() for d in ("a", "b"))
        assert a == b and "EXIT" in a and not re.search(r"/\*[0-9a-f]{4,}\*/", a)
    assert "HGMMA" in (tmp_path / "a" / files[0]).read_text()
    assert "HMMA" in (tmp_path / "a" / files[3]).read_text()


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_sass_script_counts_both_packed_loops():
    """`benchmarks/sass_decode.py --wide` (the command behind the SASS figures of docs/KERNELS.md) finds one packed
    loop per warpgroup: the leader unpacks 5 units (4 content + RoPE: 80 multiplies per thread, one per pair) and
    issues their 20 score `wgmma`s, the worker 4 units (64, 16), each plus the 16 value `wgmma`s of its units."""
    out = _sass_script("C4R4", "--wide")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^leader packed loop: \d+ .*\(80 unpacking multiplies, 0 local-memory\)\n.*HGMMA\.64x32x16 36",
                     out.stdout, re.M), out.stdout
    assert re.search(r"^worker packed loop: \d+ .*\(64 unpacking multiplies, 0 local-memory\)\n.*HGMMA\.64x32x16 32",
                     out.stdout, re.M), out.stdout
    assert "STACK:0" in out.stdout, out.stdout


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
def test_sass_script_reads_the_split_kernels_loops():
    """`benchmarks/sass_decode.py --split` finds each value warpgroup's main loop (per tile: its 4 units x 4 k-steps
    of values, no unpacking) and the scorer's (9 units x 4 k-steps of scores, 9 units x 16 pairs per thread: 144
    unpacking multiplies; 16-bit keys: none, 8 units x 4 copies of 16 bytes per thread), and reports the
    warpgroups' registers; with `--waits`, the scorer's waits for its code words' data and, apart, for their
    address registers."""
    out = _sass_script("C4R4", "--split", "--waits")
    assert out.returncode == 0, out.stderr[-3000:]
    floors = re.findall(r"^\w+ loop: (\d+) SASS .*; issue floor (\d+) cycles$", out.stdout, re.M)
    assert len(floors) == 3 and all(int(c) >= int(n) for n, c in floors), out.stdout
    values = re.findall(r"^value loop: \d+ .*\((\d+) HGMMA, (\d+) unpacking", out.stdout, re.M)
    scorers = re.findall(r"^scorer loop: \d+ .*\((\d+) HGMMA, (\d+) unpacking", out.stdout, re.M)
    assert values == [("16", "0"), ("16", "0")], out.stdout
    assert scorers == [("36", "144")], out.stdout
    assert f"value worker {ms.REGS[4, 4, False][0]}, scorer {ms.REGS[4, 4, False][1]}" in out.stdout, out.stdout
    assert re.search(r"^ptxas: wgmmas not serialized, spills \d+ B stored, \d+ B loaded$", out.stdout, re.M), out.stdout
    scorer = out.stdout[out.stdout.index("scorer loop:"):]
    data = scorer.index("  waits for global loads' data")
    addresses = scorer.index("  waits for global loads' address registers")
    assert data < addresses and re.search(r"^  \d+ \S+: .*LDG\.E\.128 x\d+.*; \d+ since the youngest$",
                                          scorer[data:addresses], re.M), out.stdout
    dense = _sass_script("C16R16", "--split")  # 16-bit keys: copied into the value stages (32 cp.async a thread)
    assert dense.returncode == 0, dense.stderr[-3000:]
    assert re.findall(r"^scorer loop: \d+ .*\((\d+) HGMMA, (\d+) unpacking multiplies, (\d+) key copies", dense.stdout,
                      re.M) == [("36", "0", "32")], dense.stdout
    bad = _sass_script("C4R4", "--split", "--fp32-queries")
    assert bad.returncode == 2 and "takes bf16/fp16 queries" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.skipif(not mc.HAVE_GLUON, reason=NO_GLUON)
@pytest.mark.parametrize("which", ["regs", "wide", "split"])
def test_launchers_pass_exactly_the_kernels_parameters(monkeypatch, which):
    """`launch_gluon` and `launch_split` (through `launch_flat`) give their kernel every parameter of its signature,
    by name, once, and launch `flat_grid` programs: the kernel is replaced by a binder of its own signature, since it
    cannot launch without a GPU."""
    module = {"regs": mr, "wide": mw, "split": ms}[which]
    owner, name = (ms, "mla_decode_split_kernel") if which == "split" else (mr, "mla_decode_gluon_kernel")
    kernel = getattr(owner, name)
    params = inspect.signature(kernel.fn).parameters
    seen = {}

    class Binder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {k: kwargs.pop(k) for k in ("num_warps", "maxnreg") if k in kwargs}
                seen.update(grid=grid, bound=inspect.signature(kernel.fn).bind(*args, **kwargs), options=options)
            return launch

    monkeypatch.setattr(owner, name, Binder())
    fmt = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64), 4, 128)
    B, M, cap, NS = 2, 16 if which == "regs" else 128, 300, 5
    cp = {"codes": torch.zeros(B, cap, 256, dtype=torch.uint8), "scale": torch.zeros(B, cap, 8, dtype=torch.float16),
          "zero": torch.zeros(B, cap, 8, dtype=torch.int8)}
    rp = {"codes": torch.zeros(B, cap, 32, dtype=torch.uint8), "scale": torch.zeros(B, cap, 1, dtype=torch.float16),
          "zero": torch.zeros(B, cap, 1, dtype=torch.int8)}
    copies = [torch.zeros(B, n, d, dtype=torch.bfloat16) for n, d in ((4, 512), (4, 64), (128, 512), (128, 64))]

    def launcher(*args, **kwargs):
        if which == "split":
            ms.launch_split(*args, **kwargs)
        else:
            mr.launch_gluon(*args, wide_program=which == "wide", **kwargs)

    launcher(torch.zeros(B, M, 512, dtype=torch.bfloat16), torch.zeros(B, M, 64, dtype=torch.bfloat16), cp, rp, fmt,
             *copies, torch.zeros(B, dtype=torch.int64), torch.tensor([cap]), torch.zeros(B, M, NS + 3, 512),
             torch.zeros(B, M, NS + 3), M, 1, 8, NS, 0.1)
    assert set(seen["bound"].arguments) == set(params), set(params) ^ set(seen["bound"].arguments)
    assert seen["grid"] == mc.flat_grid(NS, fmt, M, module.BLOCK_M, B)
    assert seen["bound"].arguments["BM"] == module.BLOCK_M and seen["options"]["num_warps"] == 4
    if which == "split":  # three warpgroups: the launch's registers for all 12 warps, the partitions' as set
        assert seen["options"]["maxnreg"] == ms.LAUNCH_REGS and 12 * 32 * ms.LAUNCH_REGS <= 65536
        assert (seen["bound"].arguments["V_REGS"], seen["bound"].arguments["S_REGS"]) == ms.REGS[4, 4, False]
        assert all(2 * v + s <= 3 * ms.LAUNCH_REGS for v, s in ms.REGS.values())  # the default warps get the rest
    else:
        assert seen["bound"].arguments["WIDE"] == (which == "wide")
    # the paged launch: pools from their first row (batch strides 0), the page table's stride
    assert not seen["bound"].arguments["PAGED"]
    table = torch.zeros(B, 7, dtype=torch.int32)
    launcher(torch.zeros(B, M, 512, dtype=torch.bfloat16), torch.zeros(B, M, 64, dtype=torch.bfloat16), cp, rp,
             fmt, *copies, torch.arange(B, dtype=torch.int32), torch.tensor([cap, 70], dtype=torch.int32),
             torch.zeros(B, M, NS + 3, 512), torch.zeros(B, M, NS + 3), M, 1, 8, NS, 0.1, page_table=table)
    args = seen["bound"].arguments
    assert args["PAGED"] and args["pt_ptr"] is table and args["s_pt"] == 7
    if which == "split":  # the paged launch's own register split
        assert (args["V_REGS"], args["S_REGS"]) == ms.REGS[4, 4, True]
    assert args["s_ccb"] == args["s_csb"] == args["s_rcb"] == args["s_rsb"] == 0
