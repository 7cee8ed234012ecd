"""Instruction mix of the register-operand Gluon decode kernel (`kernels/mla_decode_gluon_regs.py`), compiled for
sm_90 on any machine (no GPU needed): the SASS of its packed-tile loop, per warp and 64-token tile, counted by
opcode, plus the registers and spills of the kernel (the compile facts of docs/KERNELS.md "The Gluon register
kernel"). `--wide` does the same for its two-warpgroup form (`kernels/mla_decode_gluon_wide.py`, C4R4, C2R4, C4R8,
C8R8): one packed loop per warpgroup (the leader's unpacks the RoPE unit too). `--split`: the split kernel
(`kernels/mla_decode_gluon_split.py`, C4R4, C2R4, C4R8): each warpgroup's registers and the main loop of the scorer
and of each value warpgroup, with its `wgmma`s, unpacking multiplies, local-memory (spill) instructions and the
shared memory it moves (`shared_bytes`). Each also prints what ptxas said (`ptxas_facts`): whether it serialized the
wgmmas (each waiting for the one before, which a kernel short of registers gets without failing) and the spill bytes.

    python benchmarks/sass_decode.py [C4R4|C2R4|C4R8|C8R8|C16R16] [--fp32-queries] [--inflight N] [--paged]
        [--wide|--split] [--tree DIR] [--loads] [--waits]
    python benchmarks/sass_decode.py --dump DIR

`--paged`: the paged launch (`PAGED`: page pools read through a page table) of any of them. `--tree DIR`: that
kernel of the tree at DIR (`kernels/` and `quantmla_hf/`: an older tree, a variant `split_ceilings.py` wrote, or a
copy with a change, to see what it does to the loop before timing it) with that tree's settings. `--dump DIR`: the whole
SASS (addresses removed) of every Gluon launch in `DUMP_LAUNCHES` and `SPLIT_LAUNCHES` and every portable Triton
launch in `PORTABLE_LAUNCHES`, one file each, so that two trees' kernels can be compared with `diff -r` (a change
whose SASS is identical needs no timing). It prints each launch's ptxas facts beside its instruction count.

It compiles with the Triton in the environment and disassembles with that Triton's bundled `cuobjdump`; the figures
in the docs came from Triton 3.6 (the H200's version; another version schedules and allocates differently).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon

from quantmla_hf.format import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_combine as combine
from quantmla_hf.kernels import mla_decode_gluon_regs as mr
from quantmla_hf.kernels import mla_decode_gluon_split as ms
from quantmla_hf.kernels import mla_decode_gluon_wide as mw
from quantmla_hf.kernels import mla_decode_triton as portable
from quantmla_hf.kernels import quant_pack
from quantmla_hf.kernels.quant_pack_ref import SCALE_MIN
import tree_compare

FORMATS = {"C4R4": (4, 4), "C2R4": (2, 4), "C4R8": (4, 8), "C8R8": (8, 8), "C16R16": (16, 16)}
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+[^;]*;", re.M)  # one SASS instruction line
SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")  # a partition's registers (PTX)
UNPACK_MUL = "HMUL2"  # the unpacking's `mul.f16x2`, one per pair of elements (the copies' loops have none)
COPY_ASYNC = "LDGSTS.E"  # a 16-byte `cp.async` (the 16-bit scorer's key copies)
# ptxas's notes (`-v`) on a kernel whose wgmmas it runs one at a time (C7510-C7515: registers short, accumulators
# touched between wgmmas, ...), and on its spills
WGMMA_SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


# (content bits, RoPE bits, content groups, fp32 queries, paged, two warpgroups): DeepSeek (8 groups) and MiniCPM3
# (4 groups) widths, every format and launch the dispatch sends to the Gluon kernels
DUMP_LAUNCHES = ([(c, r, 8, q, p, w) for c, r in ((4, 4), (2, 4), (4, 8), (8, 8)) for w in (False, True)
                  for q, p in ((False, False), (False, True), (True, False))]
                 + [(c, r, 4, False, p, False) for c, r in ((4, 4), (8, 8)) for p in (False, True)]
                 + [(2, 2, 8, False, False, False)])
# (content bits, RoPE bits, paged): the split kernel's launches
SPLIT_LAUNCHES = ([(c, r, p) for c in (4, 2) for r in (4, 8) for p in (False, True)] + [(8, 8, False), (8, 8, True)]
                  + [(16, 16, False), (16, 16, True)])


# (content bits, RoPE bits, RoPE width, query rows, fp32 model, page size): the portable kernel's launches, every
# dtype path (bf16 packed, bf16 `NATIVE` C16R16, fp32 `NATIVE`), contiguous and paged, and a tiny model's 16-dim RoPE
PORTABLE_LAUNCHES = ([(c, r, 64, m, f32, page) for c, r in ((4, 4), (2, 4), (8, 8), (16, 16)) for m in (16, 128)
                      for f32 in (False, True) for page in (0, 64)]
                     + [(c, r, 16, 16, False, page) for c, r in ((4, 4), (16, 16)) for page in (0, 64)])


def compile_portable(content_bits: int, rope_bits: int, rope_dim: int, rows: int, fp32: bool, page: int):
    """The portable Triton kernel compiled for sm_90 as `launch_triton` launches it (d_c 512, 4 sink + 128 recent
    tokens): its tiling, warps and stages for `rows` query rows, bf16 or fp32 operands, page pools of `page` tokens
    (0: contiguous planes)."""
    fmt = CacheFormat(PathFormat(512, content_bits, 64), PathFormat(rope_dim, rope_bits, 64), 4, 128)
    dt = torch.float32 if fp32 else torch.bfloat16
    groups, group = portable.path_tiling(fmt.content, 8)
    tile, warps, stages = portable.launch_shape(fmt, rows)
    const = dict(D_C=512, GC=groups, GROUP_C=group, C_BITS=content_bits, D_R=rope_dim, R_BITS=rope_bits, S=4, R=128,
                 PAGE=page, BLOCK_M=portable.block_rows(rows), BLOCK_T=tile, Q_SPLIT=fp32,
                 NATIVE=portable.native_operands(fmt, dt, dt, dt))
    copy = "*fp32" if fp32 else "*bf16"
    plane, scale, zero = (copy, copy, copy) if content_bits == 16 else ("*u8", "*fp16", "*i8")
    index = "*i32" if page else "*i64"
    ptr = dict(q_ptr=copy, qr_ptr=copy, cc_ptr=plane, cs_ptr=scale, cz_ptr=zero, rc_ptr=plane, rs_ptr=scale,
               rz_ptr=zero, snc_ptr=copy, snr_ptr=copy, rcc_ptr=copy, rcr_ptr=copy, len_ptr=index, lp_ptr="*i64",
               pt_ptr=index, rows_ptr=index, cu_q_ptr=index, tok_req_ptr=index, o_ptr="*fp32", lse_ptr="*fp32",
               qk_scale="fp32")
    return _compile_triton(portable.mla_decode_triton_kernel, const, ptr, "i32",
                           dict(num_warps=warps, num_stages=stages))


# the other kernels of a decode step: quantize-and-pack (bits, width, page slots) and the combine (columns, copy slots)
QUANT_PACK_LAUNCHES = [(4, 512, False), (2, 512, True), (4, 64, True)]
COMBINE_LAUNCHES = [(512, 1), (64, 3)]


def compile_quant_pack(bits: int, width: int, slots: bool):
    """`quant_pack_fwd_kernel` compiled for sm_90: one `width`-wide path of bf16 rows in groups of 64, written at
    consecutive positions from a device-side start or (`slots`) at page slots."""
    fn = quant_pack.quant_pack_fwd_kernel
    const = dict(G=width // 64, BLOCK_G=triton.next_power_of_2(width // 64), GROUP=64, BITS=bits, S_MIN=SCALE_MIN,
                 START_FROM_PTR=True, SLOTS=slots)
    ptr = dict(x_ptr="*bf16", codes_ptr="*u8", scale_ptr="*fp16", zero_ptr="*i8", start_ptr="*i64")
    return _compile_triton(fn, const, ptr, "i64", dict(num_warps=4))


def compile_combine(block_d: int, n_tail: int, partials: str = "fp16"):
    """`combine_kernel` compiled for sm_90 as it launches there (a dependent launch) over d_c 512 in `block_d`-column
    programs with `n_tail` copy slots, of `partials` (fp16: the split kernel's over quantized content, or fp32)."""
    unscale = 1.0 / combine.partial_scale(torch.float16 if partials == "fp16" else torch.float32)
    const = dict(D_C=512, BLOCK_S=combine.CHUNK, BLOCK_D=block_d, N_TAIL=n_tail, LSE_BLOCK=combine.LSE_BLOCK,
                 DEPENDENT=True, UNSCALE=unscale)
    ptr = dict(o_part_ptr=f"*{partials}", lse_part_ptr="*fp32", o_ptr="*fp32", lse_ptr="*fp32")
    return _compile_triton(combine.combine_kernel, const, ptr, "i32", dict(num_warps=4, launch_pdl=True))


def _compile_triton(fn, const: dict, ptr: dict, default: str, options: dict):
    sig = {n: "constexpr" if n in const else ptr.get(n, default) for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return compile_sm90(src, options)


def compile_sm90(src, options: dict):
    """`triton.compile` of `src` for sm_90, past Triton's cache so that ptxas runs, its `-v` log kept as the
    kernel's `ptxas_log` (`ptxas_facts`)."""
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    kernel.ptxas_log = log.getvalue()
    if not SPILLS.search(kernel.ptxas_log):
        raise RuntimeError(f"Triton {triton.__version__} printed no ptxas -v log (TRITON_DUMP_PTXAS_LOG)")
    return kernel


def wgmma_serialized(kernel) -> list[str]:
    """The codes of ptxas's notes that it serialized the kernel's wgmmas (each waits for the one before: the
    tensor-core pipeline runs empty), none when it did not."""
    return WGMMA_SERIALIZED.findall(kernel.ptxas_log)


def ptxas_facts(kernel) -> str:
    """One line of what ptxas said of a kernel (`compile_sm90`): whether its wgmmas are serialized and its spill
    bytes."""
    codes = wgmma_serialized(kernel)
    stores, loads = SPILLS.search(kernel.ptxas_log).groups()
    return (f"ptxas: wgmmas {'serialized (' + ', '.join(sorted(set(codes))) + ')' if codes else 'not serialized'}, "
            f"spills {stores} B stored, {loads} B loaded")


def compile_regs(content_bits: int, rope_bits: int, q_split: bool = False, inflight: int = 1, paged: bool = False,
                 groups: int = 8, modules=None):
    """The kernel's one-warpgroup program compiled for sm_90 at DeepSeek widths (`groups` = 8 content groups, 4 sink
    + 128 recent tokens, 16 rows). `modules`: another tree's `(regs, wide)` kernel modules (`tree_modules`)."""
    return _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide=False, groups=groups,
                          modules=modules)


def compile_wide(content_bits: int, rope_bits: int, q_split: bool = False, inflight: int = mw.INFLIGHT,
                 paged: bool = False, modules=None):
    """The kernel's two-warpgroup program compiled for sm_90 at DeepSeek widths with its registers (`modules`: as
    `compile_regs`)."""
    return _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide=True, modules=modules)


def compile_split(content_bits: int, rope_bits: int, paged: bool = False, module=ms):
    """The split kernel (`kernels/mla_decode_gluon_split.py`: a scorer and two value warpgroups, 64 rows; `module`:
    another tree's, `tree_modules`) compiled for sm_90 at DeepSeek widths with its registers and partials
    (`backends.partial_dtype`)."""
    fmt = CacheFormat(PathFormat(512, content_bits, 64), PathFormat(64, rope_bits, 64))
    v_regs, s_regs = module.registers(fmt, paged)
    copies = (0, 0) if content_bits == 16 and paged else (4, 128)  # the paged 16-bit cache keeps no copies
    const = dict(GC=8, C_BITS=content_bits, R_BITS=rope_bits, S=copies[0], R=copies[1], BM=module.BLOCK_M,
                 Q_SPLIT=False, PAGED=paged, V_REGS=v_regs, S_REGS=s_regs)
    index = "*i32" if paged else "*i64"
    ptrs = dict(lp_ptr=index, len_ptr=index, pt_ptr=index, o_ptr="*fp32" if content_bits == 16 else "*fp16")
    if content_bits == 16:  # bf16 planes (C16R16); the steps' and zero points' pointers are the planes'
        ptrs.update({n: "*bf16" for n in ("cc_ptr", "cs_ptr", "cz_ptr", "rc_ptr", "rs_ptr", "rz_ptr")})
    return _compile(module.mla_decode_split_kernel, const, False, {"num_warps": 4, "maxnreg": module.LAUNCH_REGS},
                    ptrs)


def tree_modules(tree: str) -> tuple:
    """The Gluon kernel modules `(regs, wide, split)` of the tree at `tree` (an older tree, a variant
    `split_ceilings.py` wrote, or a copy with a change to compile before timing it), imported beside this tree's
    (`tree_compare.load_baseline_decode`, a package of its own for each call)."""
    package = f"quantmla_sass_tree_{sum(m.startswith('quantmla_sass_tree_') and '.' not in m for m in sys.modules)}"
    tree_compare.load_baseline_decode(tree, package)
    return tuple(importlib.import_module(f"{package}.kernels.mla_decode_gluon_{name}")
                 for name in ("regs", "wide", "split"))


def _compile_gluon(content_bits, rope_bits, q_split, inflight, paged, wide, groups=8, modules=None):
    regs_m, wide_m = modules or (mr, mw)
    regs = wide_m.REGS[content_bits] if wide else 0
    const = dict(GC=groups, C_BITS=content_bits, R_BITS=rope_bits, S=4, R=128,
                 BM=wide_m.BLOCK_M if wide else regs_m.BLOCK_M, Q_SPLIT=q_split, INFLIGHT=inflight, WIDE=wide,
                 W_REGS=regs, PAGED=paged)
    index = "*i32" if paged else "*i64"  # the paged launch's lengths, copy rows and page numbers
    options = {"num_warps": 4, "maxnreg": min(regs, wide_m.MAX_REGS)} if wide else {"num_warps": 4}
    return _compile(regs_m.mla_decode_gluon_kernel, const, q_split, options, dict(lp_ptr=index, len_ptr=index,
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
    return compile_sm90(src, options)


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


INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")  # an instruction line of `cuobjdump -sass`
ENCODING = re.compile(r"/\* (0x[0-9a-f]+) \*/")  # a 64-bit half of an instruction's encoding


def _instructions_and_loops(sass: str):
    """`(instructions, controls, loops)`: the SASS instruction texts in address order, each one's control bits (the
    high 64 bits of its encoding, on the line after it, shifted right by 41: `scoreboard_waits` reads them; 0 where
    the text has no encodings) and the loops as `(first, last)` index pairs (a backward branch to an earlier
    address)."""
    lines = sass.splitlines()
    ins, controls = [], []
    for i, line in enumerate(lines):
        m = INSTRUCTION.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
            high = ENCODING.search(lines[i + 1]) if i + 1 < len(lines) else None
            controls.append(int(high.group(1), 16) >> 41 if high else 0)
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) in index and index[int(m.group(1), 16)] < i:
            loops.append((index[int(m.group(1), 16)], i))
    if not loops:
        raise ValueError("no loop found in the SASS")
    return [t for _, t in ins], controls, loops


def _unpacks(body: list[str]) -> int:
    return sum(re.sub(r"^@!?U?P\w+\s+", "", t).startswith(UNPACK_MUL) for t in body)


def packed_loop(sass: str) -> tuple[list[str], list[int]]:
    """The instructions of the packed-tile loop (of the loops, the one with the most unpacking multiplies, `HMUL2`)
    and their control bits (`_instructions_and_loops`)."""
    ins, controls, loops = _instructions_and_loops(sass)
    start, end = max(loops, key=lambda se: _unpacks(ins[se[0]:se[1] + 1]))
    return ins[start:end + 1], controls[start:end + 1]


def packed_loops(sass: str) -> list[list[str]]:
    """The innermost loops that unpack (one per warpgroup in the two-warpgroup kernel), in address order."""
    ins, _, loops = _instructions_and_loops(sass)
    unpacking = [(s, e) for s, e in loops if _unpacks(ins[s:e + 1])]
    inner = [(s, e) for s, e in unpacking
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in unpacking)]
    return [ins[s:e + 1] for s, e in sorted(inner)]


def opcode_counts(instructions: list[str]) -> collections.Counter:
    """Opcodes (predicate dropped, first modifier kept: `IMAD.MOV`, `LOP3.LUT`) of a list of SASS instructions."""
    ops = (re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in instructions)
    return collections.Counter(".".join(op.split(".")[:2]) for op in ops)


HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.F32(?:\.BF16)?\s+R\d+,\s+(R\d+|gdesc)")  # M, N, K, A operand
SHARED_ACCESS = re.compile(r"\b(STS|LDS)(?:\.U?(8|16|32|64|128))?\b")  # a shared store/load and its width in bits
STMATRIX = re.compile(r"\bSTSM\.16\.M88(?:\.(\d))?\b")  # `stmatrix`: 1, 2 or 4 8x8 fp16 matrices a warp


def local_accesses(counts: collections.Counter) -> int:
    """Local-memory loads and stores (`LDL`, `STL`: spilled registers) among `opcode_counts`."""
    return sum(n for op, n in counts.items() if op.split(".")[0] in ("LDL", "STL"))


def shared_bytes(instructions: list[str]) -> dict:
    """The shared-memory bytes a loop moves, per pass: `wgmma` operands (each HGMMA counted once, as the
    warpgroup's: 16-bit A `M x K` when it is read from shared memory (`gdesc` first) and B `N x K`, which always is) and
    stores and loads of one warp (`STS`/`LDS` of 32 lanes at their width, 32 bits where none is written; `STSM`
    128 bytes a matrix), so that a warpgroup's total is `wgmma + 4 * (stores + loads)`. A multiprocessor moves 128
    bytes of shared memory a cycle, which bounds a tile's time from below by the sum over its warpgroups divided by
    128."""
    out = dict(wgmma=0, stores=0, loads=0)
    for t in instructions:
        m = HGMMA.search(t)
        if m:
            rows, cols, depth = (int(g) for g in m.groups()[:3])
            out["wgmma"] += 2 * depth * (cols + (rows if m.group(4) == "gdesc" else 0))
            continue
        m = STMATRIX.search(t)
        if m:
            out["stores"] += 128 * int(m.group(1) or 1)
            continue
        m = SHARED_ACCESS.search(re.sub(r"^@!?U?P\w+\s+", "", t))
        if m:
            out["stores" if m.group(1) == "STS" else "loads"] += 32 * int(m.group(2) or 32) // 8
    return out


WIDE_LOAD = re.compile(r"\bLDG\.E\.(64|128)\s+R(\d+),")  # a 64- or 128-bit global load and its first register


def load_lead(loop: list[str]) -> list[tuple[int, int, int | None]]:
    """Per 64- or 128-bit global load of a loop (the next tile's code words): `(index, first register, lead)`, the
    lead being how many instructions later, going round the loop, an instruction first names one of its registers,
    i.e. uses the loaded words (None: none does). Zeroing them before a masked load (`CS2R`) and loads do not
    count."""
    out = []
    for i, t in enumerate(loop):
        m = WIDE_LOAD.search(t)
        if not m:
            continue
        r0, width = int(m.group(2)), int(m.group(1)) // 32
        reads = re.compile(r"(?<![\w.])R(" + "|".join(str(r0 + j) for j in range(width)) + r")(?!\d)")
        order = loop[i + 1:] + loop[:i + 1]
        lead = next((d + 1 for d, x in enumerate(order) if reads.search(x) and not re.search(r"\b(LDG|CS2R)", x)),
                    None)
        out.append((i, r0, lead))
    return out


GLOBAL_LOAD = re.compile(r"\bLDG(\.[\w.]+)?\b")


def scoreboard_waits(loop: list[str], controls: list[int], operands: bool = False
                     ) -> list[tuple[int, list[tuple[int, str]], int]]:
    """The instructions of a loop that wait for some global load of the loop (sm_70+ control bits: stall 0-3, yield
    4, write scoreboard 5-7, read scoreboard 8-10, wait mask 11-16; 7 is none): per such instruction `(index, loads,
    lead)`, the loads `(index, opcode)` still pending on the scoreboards it waits on (set since each was last waited
    on, going round the loop: the steady state) and how many instructions after the youngest of them it comes. A
    load sets its write scoreboard, released when its data arrives (a memory latency), and may set a read scoreboard,
    released once its address registers are read (tens of cycles, so that they may be overwritten). `operands`
    False: the waits for the data (write scoreboards); True: the waits for the address registers (read scoreboards).
    A wait covers every operation pending on its scoreboard, so an instruction that needs one load waits for every
    load set on the same scoreboard before it."""
    n = len(loop)
    field_shift = 8 if operands else 5
    pending = {j: [] for j in range(6)}
    out = []
    for rnd in range(2):
        for i, (t, c) in enumerate(zip(loop, controls)):
            wait = (c >> 11) & 63
            if wait:
                covered = [p for j in range(6) if wait >> j & 1 for p in pending[j]]
                for j in range(6):
                    if wait >> j & 1:
                        pending[j] = []
                loads = [(p, m.group(0)) for p in covered if (m := GLOBAL_LOAD.search(loop[p]))]
                if rnd and loads:
                    out.append((i, sorted(loads), min((i - p) % n for p, _ in loads)))
            field = (c >> field_shift) & 7
            if field != 7:
                pending[field].append(i)
    return out


def dump(out_dir: str, launches=DUMP_LAUNCHES, portable_launches=PORTABLE_LAUNCHES, quant_pack_launches=
         QUANT_PACK_LAUNCHES, combine_launches=COMBINE_LAUNCHES, split_launches=SPLIT_LAUNCHES) -> None:
    """Write the SASS of every Gluon launch in `launches` and `split_launches`, every portable launch in
    `portable_launches` and the quantize-and-pack and combine launches to `out_dir` (instruction addresses
    removed)."""
    os.makedirs(out_dir, exist_ok=True)

    def gluon(cb, rb, groups, q_split, paged, wide):
        if wide:
            return compile_wide(cb, rb, q_split=q_split, paged=paged)
        return compile_regs(cb, rb, q_split, mr.INFLIGHT[cb], paged, groups)

    jobs = ([(gluon, a, "C{}R{}_{}groups_{}_{}_{}.sass".format(
        *a[:3], "fp32" if a[3] else "bf16", "paged" if a[4] else "contiguous", "wide" if a[5] else "regs"))
             for a in launches]
            + [(compile_split, a, "C{}R{}_8groups_bf16_{}_split.sass".format(
                *a[:2], "paged" if a[2] else "contiguous"))
               for a in split_launches]
            + [(compile_portable, a, "portable_C{}R{}_rope{}_{}rows_{}_page{}.sass".format(
                *a[:4], "fp32" if a[4] else "bf16", a[5])) for a in portable_launches]
            + [(compile_quant_pack, a, "quant_pack_{}bit_{}wide_{}.sass".format(*a[:2], "slots" if a[2] else "start"))
               for a in quant_pack_launches]
            + [(compile_combine, a, "combine_{}cols_{}tail.sass".format(*a)) for a in combine_launches])
    for compile_fn, args, name in jobs:
        kernel = compile_fn(*args)
        sass = disassemble(kernel.asm["cubin"], "-sass")
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(re.sub(r"/\*[0-9a-f]{4,}\*/", "", sass))
        print(f"{name}: {len(INSTRUCTION.findall(sass))} instructions; {ptxas_facts(kernel)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("format", nargs="?", default="C4R4", choices=sorted(FORMATS))
    ap.add_argument("--fp32-queries", action="store_true")
    ap.add_argument("--inflight", type=int, default=None, choices=(0, 1), help="default: the kernel's (`INFLIGHT`)")
    ap.add_argument("--paged", action="store_true", help="the paged launch")
    ap.add_argument("--wide", action="store_true", help="the two-warpgroup kernel")
    ap.add_argument("--split", action="store_true",
                    help="the split kernel (C4R4, C2R4, C4R8, C8R8, C16R16; bf16 queries)")
    ap.add_argument("--tree", default="",
                    help="the kernels of the tree at this folder (an older tree, a variant split_ceilings.py wrote, "
                    "or a copy with a change) instead of this one's")
    ap.add_argument("--dump", default="", help="write the SASS of every launch (DUMP_LAUNCHES) to this directory")
    ap.add_argument("--loads", action="store_true",
                    help="also each wide global load of the packed loop (--split: the scorer's) and its lead "
                         "(`load_lead`)")
    ap.add_argument("--waits", action="store_true",
                    help="also the packed loop's (--split: the scorer's) waits for its global loads' data and, "
                         "apart, for their address registers (`scoreboard_waits`)")
    a = ap.parse_args()
    if a.dump:
        dump(a.dump)
        return
    regs_m, wide_m, split_m = tree_modules(a.tree) if a.tree else (mr, mw, ms)
    if a.wide:
        main_wide(a, (regs_m, wide_m))
        return
    if a.split:
        if a.fp32_queries:
            ap.error("--split: the split kernel takes bf16/fp16 queries")
        main_split(a, split_m)
        return
    if a.format == "C16R16":
        ap.error("C16R16: only the split kernel (--split) takes 16-bit planes")
    a.inflight = regs_m.INFLIGHT[FORMATS[a.format][0]] if a.inflight is None else a.inflight
    kernel = compile_regs(*FORMATS[a.format], q_split=a.fp32_queries, inflight=a.inflight, paged=a.paged,
                          modules=(regs_m, wide_m))
    usage = disassemble(kernel.asm["cubin"], "-res-usage")
    loop, controls = packed_loop(disassemble(kernel.asm["cubin"], "-sass"))
    counts = opcode_counts(loop)
    print(f"triton {triton.__version__} | {a.format}{' of ' + a.tree if a.tree else ''} | "
          f"{'fp32' if a.fp32_queries else 'bf16'} queries | inflight {a.inflight} | "
          f"{'paged' if a.paged else 'contiguous'} | shared memory {kernel.metadata.shared} B")
    print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|LOCAL:\d+)", usage)))
    print(ptxas_facts(kernel))
    print(f"packed loop: {len(loop)} SASS instructions per warp and 64-token tile "
          f"({counts[UNPACK_MUL]} unpacking multiplies, one per pair of elements, {local_accesses(counts)} "
          f"local-memory); issue floor {issue_floor(controls)} cycles")
    for op, n in counts.most_common():
        print(f"{op:28s} {n:5d}")
    if a.loads:
        print("wide loads (instruction: first register -> instructions until first read):")
        print(" ".join(f"{i}: R{r} -> {lead}" for i, r, lead in load_lead(loop)))
    if a.waits:
        print_waits(loop, controls, "")


def print_waits(loop: list[str], controls: list[int], indent: str) -> None:
    """The loop's waits for its global loads (`scoreboard_waits`): for their data, then for their address
    registers."""
    for operands, what in ((False, "data"), (True, "address registers")):
        print(f"{indent}waits for global loads' {what} (instruction: loads covered; instructions since the youngest "
              "of them):")
        for i, loads, lead in scoreboard_waits(loop, controls, operands):
            kinds = collections.Counter(op for _, op in loads)
            print(f"{indent}{i} {loop[i].split()[0]}: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
                  + f"; {lead} since the youngest")


def main_wide(a, modules):
    wide_m = modules[1]
    inflight = wide_m.INFLIGHT if a.inflight is None else a.inflight
    kernel = compile_wide(*FORMATS[a.format], q_split=a.fp32_queries, inflight=inflight, paged=a.paged,
                          modules=modules)
    usage = disassemble(kernel.asm["cubin"], "-res-usage")
    sass = disassemble(kernel.asm["cubin"], "-sass")
    print(f"triton {triton.__version__} | {a.format} two warpgroups{' of ' + a.tree if a.tree else ''} | "
          f"{wide_m.BLOCK_M} rows | "
          f"{'fp32' if a.fp32_queries else 'bf16'} queries | inflight {inflight} | "
          f"{'paged' if a.paged else 'contiguous'} | shared memory "
          f"{kernel.metadata.shared} B")
    print(" ".join(re.findall(r"(REG:\d+|STACK:\d+|LOCAL:\d+)", usage)))
    print(ptxas_facts(kernel))
    loops = sorted(packed_loops(sass), key=lambda body: -opcode_counts(body)[UNPACK_MUL])
    for name, loop in zip(("leader", "worker"), loops):
        counts = opcode_counts(loop)
        print(f"{name} packed loop: {len(loop)} SASS instructions per warp and 64-token tile "
              f"({counts[UNPACK_MUL]} unpacking multiplies, {local_accesses(counts)} local-memory)")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))


def main_loops(sass: str, min_len: int = 100) -> list[tuple[list[str], list[int]]]:
    """The loops of at least `min_len` instructions that hold no other such loop, in address order (the short
    loops inside them are mbarrier waits), each as `(instructions, control bits)` (`_instructions_and_loops`). A loop
    ends in a conditional branch: the unconditional one back from an mbarrier wait's retry code (placed after the
    kernel's body) is no loop."""
    ins, bits, loops = _instructions_and_loops(sass)
    big = [(s, e) for s, e in loops if e - s + 1 >= min_len and ins[e].startswith("@")]
    inner = [(s, e) for s, e in big if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in big)]
    return [(ins[s:e + 1], bits[s:e + 1]) for s, e in sorted(set(inner))]


def issue_floor(controls: list[int]) -> int:
    """The cycles one warp takes to issue a loop once with nothing to wait for: the sum of the stall counts ptxas
    encodes in the instructions' control bits (bits 0-3: cycles before the warp's next instruction may issue, the
    fixed latencies it schedules around). Waits on scoreboards (loads, shared memory, `wgmma`s), barriers and other
    warps' issue slots come on top, so a loop that takes much longer than its floor is bound by those waits."""
    return sum(c & 15 for c in controls)


def main_split(a, module):
    cb, rb = FORMATS[a.format]
    kernel = compile_split(cb, rb, paged=a.paged, module=module)
    sass = disassemble(kernel.asm["cubin"], "-sass")
    v_regs, s_regs = module.registers(CacheFormat(PathFormat(512, cb, 64), PathFormat(64, rb, 64)), a.paged)
    print(f"triton {triton.__version__} | {a.format} split{' of ' + a.tree if a.tree else ''} | {module.BLOCK_M} "
          f"rows | {'paged' if a.paged else 'contiguous'} | shared memory {kernel.metadata.shared} B")
    print(f"registers: launch {module.LAUNCH_REGS}, value worker {v_regs}, scorer {s_regs}; setmaxnreg "
          + " ".join(f"{k} {n}" for k, n in SETMAXNREG.findall(kernel.asm["ptx"])))
    local = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    print(f"local memory instructions in the kernel: {local}")
    print(ptxas_facts(kernel))
    for loop, controls in main_loops(sass):
        counts = opcode_counts(loop)
        if not any(op.startswith("HGMMA") for op in counts):
            continue  # the epilogue's waits
        mma = sum(n for op, n in counts.items() if op.startswith("HGMMA"))
        name = "scorer" if mma > 16 else "value"  # the scores: 9 units x 4 k-steps; a value warpgroup's: 4 x 4
        spills = local_accesses(counts)
        print(f"{name} loop: {len(loop)} SASS instructions per warp and 64-token tile ({mma} HGMMA, "
              f"{counts[UNPACK_MUL]} unpacking multiplies, {counts[COPY_ASYNC]} key copies, {spills} local-memory); "
              f"issue floor {issue_floor(controls)} cycles")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))
        moved = shared_bytes(loop)
        total = moved["wgmma"] + 4 * (moved["stores"] + moved["loads"])
        print(f"  shared memory per warpgroup and pass: {total / 1024:.1f} KiB (wgmma operands "
              f"{moved['wgmma'] / 1024:.1f}, stores {4 * moved['stores'] / 1024:.1f}, loads "
              f"{4 * moved['loads'] / 1024:.1f})")
        if a.loads and name == "scorer":
            print("  wide loads (instruction: first register -> instructions until first read): "
                  + " ".join(f"{i}: R{r} -> {lead}" for i, r, lead in load_lead(loop)))
        if a.waits and name == "scorer":
            print_waits(loop, controls, "  ")


if __name__ == "__main__":
    main()
