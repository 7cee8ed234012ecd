"""Instruction mix of the register-operand Gluon decode kernel (`kernels/mla_decode_gluon_regs.py`), compiled for
sm_90 on any machine (no GPU needed): the SASS of its packed-tile loop, per warp and 64-token tile, counted by
opcode, plus the registers and spills of the kernel (the compile facts of docs/KERNELS.md "The Gluon register
kernel"). `--wide` does the same for its two-warpgroup form (`kernels/mla_decode_gluon_wide.py`, C4R4, C2R4, C8R8): one
packed loop per warpgroup (the leader's unpacks the RoPE unit too).

    python benchmarks/sass_decode.py [C4R4|C2R4|C8R8] [--fp32-queries] [--inflight N] [--paged] [--wide]
    python benchmarks/sass_decode.py --dump DIR

`--paged`: the paged launch (`PAGED`: page pools read through a page table) of either kernel. `--dump DIR`: the
whole SASS (addresses removed) of every launch in `DUMP_LAUNCHES`, one file each, so that two trees' kernels can be
compared with `diff -r` (a change whose SASS is identical needs no timing).

It compiles with the Triton in the environment and disassembles with that Triton's bundled `cuobjdump`; the figures
in the docs came from Triton 3.6 (the H200's version; another version schedules and allocates differently).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon

from quantmla_hf.kernels import mla_decode_gluon_common as mc
from quantmla_hf.kernels import mla_decode_gluon_regs as mr
from quantmla_hf.kernels import mla_decode_gluon_wide as mw

FORMATS = {"C4R4": (4, 4), "C2R4": (2, 4), "C8R8": (8, 8)}
UNPACK_MUL = "HMUL2"  # the unpacking's `mul.f16x2`, one per pair of elements (the copies' loops have none)


# (content bits, RoPE bits, content groups, fp32 queries, paged, two warpgroups): DeepSeek (8 groups) and MiniCPM3
# (4 groups) widths, every format and launch the dispatch sends to the Gluon kernels
DUMP_LAUNCHES = ([(c, r, 8, q, p, w) for c, r in ((4, 4), (2, 4), (8, 8)) for w in (False, True)
                  for q, p in ((False, False), (False, True), (True, False))]
                 + [(c, r, 4, False, p, False) for c, r in ((4, 4), (8, 8)) for p in (False, True)]
                 + [(2, 2, 8, False, False, False)])


def compile_regs(content_bits: int, rope_bits: int, q_split: bool = False, inflight: int = 1, paged: bool = False,
                 groups: int = 8):
    """The kernel's one-warpgroup program compiled for sm_90 at DeepSeek widths (`groups` = 8 content groups, 4 sink
    + 128 recent tokens, 16 rows)."""
    return _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide=False, groups=groups)


def compile_wide(content_bits: int, rope_bits: int, q_split: bool = False, inflight: int = mw.INFLIGHT,
                 paged: bool = False):
    """The kernel's two-warpgroup program compiled for sm_90 at DeepSeek widths with its registers."""
    return _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide=True)


def _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide, groups=8):
    regs = mw.REGS[content_bits] if wide else 0
    const = dict(GC=groups, C_BITS=content_bits, R_BITS=rope_bits, S=4, R=128, BM=mw.BLOCK_M if wide else mr.BLOCK_M,
                 Q_SPLIT=q_split, INFLIGHT=inflight, WIDE=wide, W_REGS=regs, WC_L=mc.words_layout(content_bits // 2),
                 WP_L=mc.words_layout(content_bits), WR_L=mc.words_layout(rope_bits // 2), XL=mc.words_layout(16),
                 PAGED=paged)
    index = "*i32" if paged else "*i64"  # the paged launch's lengths, copy rows and page numbers
    options = {"num_warps": 4, "maxnreg": min(regs, mw.MAX_REGS)} if wide else {"num_warps": 4}
    return _compile(mr.mla_decode_gluon_kernel, const, q_split, options, dict(lp_ptr=index, len_ptr=index,
                                                                              pt_ptr=index))


def _compile(fn, const: dict, q_split: bool, options: dict, index_ptrs: dict | None = None):
    qd = "*fp32" if q_split else "*bf16"
    ptr = dict(q_ptr=qd, qr_ptr=qd, cc_ptr="*i32", cs_ptr="*fp16", cz_ptr="*i8", rc_ptr="*i32", rs_ptr="*fp16",
               rz_ptr="*i8", snc_ptr="*bf16", snr_ptr="*bf16", rcc_ptr="*bf16", rcr_ptr="*bf16", lp_ptr="*i64",
               len_ptr="*i64", pt_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    ptr.update(index_ptrs or {})
    strides = [n for n in fn.arg_names if n.startswith("s_")]  # multiples of 16 at DeepSeek widths
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(ptr) + strides if n in fn.arg_names}
    src = gluon._runtime.GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                                        attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump() -> str:
    """The `cuobjdump` bundled with this Triton (raises FileNotFoundError where there is none)."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no cuobjdump at {path}: this Triton has no bundled CUDA tools")
    return path


def disassemble(cubin: bytes, *flags: str) -> str:
    """`cuobjdump FLAGS` of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), *flags, f.name], capture_output=True, text=True, check=True).stdout


def _instructions_and_loops(sass: str):
    """`(instructions, loops)`: the SASS instruction texts in address order and the loops as `(first, last)` index
    pairs (a backward branch to an earlier address)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) in index and index[int(m.group(1), 16)] < i:
            loops.append((index[int(m.group(1), 16)], i))
    if not loops:
        raise ValueError("no loop found in the SASS")
    return [t for _, t in ins], loops


def _unpacks(body: list[str]) -> int:
    return sum(re.sub(r"^@!?U?P\w+\s+", "", t).startswith(UNPACK_MUL) for t in body)


def packed_loop(sass: str) -> list[str]:
    """The instructions of the packed-tile loop: of the loops, the one with the most unpacking multiplies
    (`HMUL2`)."""
    ins, loops = _instructions_and_loops(sass)
    start, end = max(loops, key=lambda se: _unpacks(ins[se[0]:se[1] + 1]))
    return ins[start:end + 1]


def packed_loops(sass: str) -> list[list[str]]:
    """The innermost loops that unpack (one per warpgroup in the two-warpgroup kernel), in address order."""
    ins, loops = _instructions_and_loops(sass)
    unpacking = [(s, e) for s, e in loops if _unpacks(ins[s:e + 1])]
    inner = [(s, e) for s, e in unpacking
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in unpacking)]
    return [ins[s:e + 1] for s, e in sorted(inner)]


def opcode_counts(instructions: list[str]) -> collections.Counter:
    """Opcodes (predicate dropped, first modifier kept: `IMAD.MOV`, `LOP3.LUT`) of a list of SASS instructions."""
    ops = (re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in instructions)
    return collections.Counter(".".join(op.split(".")[:2]) for op in ops)


def dump(out_dir: str, launches=DUMP_LAUNCHES) -> None:
    """Write the SASS of every launch in `launches` to `out_dir` (instruction addresses removed)."""
    os.makedirs(out_dir, exist_ok=True)
    for cb, rb, groups, q_split, paged, wide in launches:
        if wide:
            kernel = compile_wide(cb, rb, q_split=q_split, paged=paged)
        else:
            kernel = compile_regs(cb, rb, q_split, mr.INFLIGHT[cb], paged, groups)
        sass = disassemble(kernel.asm["cubin"], "-sass")
        name = (f"C{cb}R{rb}_{groups}groups_{'fp32' if q_split else 'bf16'}_{'paged' if paged else 'contiguous'}_"
                f"{'wide' if wide else 'regs'}.sass")
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(re.sub(r"/\*[0-9a-f]{4,}\*/", "", sass))
        print(f"{name}: {len(_instructions_and_loops(sass)[0])} instructions", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("format", nargs="?", default="C4R4", choices=sorted(FORMATS))
    ap.add_argument("--fp32-queries", action="store_true")
    ap.add_argument("--inflight", type=int, default=None, choices=(0, 1), help="default: the kernel's (`INFLIGHT`)")
    ap.add_argument("--paged", action="store_true", help="the paged launch")
    ap.add_argument("--wide", action="store_true", help="the two-warpgroup kernel")
    ap.add_argument("--dump", default="", help="write the SASS of every launch (DUMP_LAUNCHES) to this directory")
    a = ap.parse_args()
    if a.dump:
        dump(a.dump)
        return
    if a.wide:
        main_wide(a)
        return
    a.inflight = mr.INFLIGHT[FORMATS[a.format][0]] if a.inflight is None else a.inflight
    kernel = compile_regs(*FORMATS[a.format], q_split=a.fp32_queries, inflight=a.inflight, paged=a.paged)
    usage = disassemble(kernel.asm["cubin"], "-res-usage")
    loop = packed_loop(disassemble(kernel.asm["cubin"], "-sass"))
    counts = opcode_counts(loop)
    print(f"triton {triton.__version__} | {a.format} | {'fp32' if a.fp32_queries else 'bf16'} queries | "
          f"inflight {a.inflight} | {'paged' if a.paged else 'contiguous'} | shared memory {kernel.metadata.shared} B")
    print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|LOCAL:\d+)", usage)))
    print(f"packed loop: {len(loop)} SASS instructions per warp and 64-token tile "
          f"({counts[UNPACK_MUL]} unpacking multiplies, one per pair of elements)")
    for op, n in counts.most_common():
        print(f"{op:28s} {n:5d}")


def main_wide(a):
    inflight = mw.INFLIGHT if a.inflight is None else a.inflight
    kernel = compile_wide(*FORMATS[a.format], q_split=a.fp32_queries, inflight=inflight, paged=a.paged)
    usage = disassemble(kernel.asm["cubin"], "-res-usage")
    sass = disassemble(kernel.asm["cubin"], "-sass")
    print(f"triton {triton.__version__} | {a.format} two warpgroups | {mw.BLOCK_M} rows | "
          f"{'fp32' if a.fp32_queries else 'bf16'} queries | inflight {inflight} | "
          f"{'paged' if a.paged else 'contiguous'} | shared memory "
          f"{kernel.metadata.shared} B")
    print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|LOCAL:\d+)", usage)))
    loops = sorted(packed_loops(sass), key=lambda body: -opcode_counts(body)[UNPACK_MUL])
    for name, loop in zip(("leader", "worker"), loops):
        counts = opcode_counts(loop)
        print(f"{name} packed loop: {len(loop)} SASS instructions per warp and 64-token tile "
              f"({counts[UNPACK_MUL]} unpacking multiplies)")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))


if __name__ == "__main__":
    main()
