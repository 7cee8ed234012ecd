"""Ceilings of the split kernel (`kernels/mla_decode_gluon_split.py`, 128 heads): copies of this tree's decode with one
part of the kernel's work taken out, for `bench_decode.py --repeat` to time beside this tree in one process. What a
variant without a part saves bounds what making that part cheaper can save; a variant that saves little says that
part does not set the kernel's time. Their outputs are wrong (they skip work the result needs): they are only timed.

    python benchmarks/split_ceilings.py --out DIR [--variants no_unpack,no_key_stores,no_unpack+no_key_stores,...]
    python benchmarks/bench_decode.py --repeat 3 --baseline-path DIR/no_unpack,DIR/no_key_stores,... \\
        --formats C4R4,C2R4 --points 128:8:32768,128:32:32768
    python benchmarks/sass_decode.py C4R4 --split --tree DIR/no_unpack        # a variant's loops, compiled on the CPU

Each variant is a set of edits of this tree's kernel sources (`EDITS`), `a+b` several at once, written as a tree
(`kernels/` and `quantmla_hf/`) in `DIR/a` (`DIR/a_and_b`). An edit names the text it replaces; where the kernel no
longer holds that text exactly once, the script stops and says which edit to bring up to date.

- `no_unpack`: the scorer's 2- and 4-bit code words go into the key registers as they are, no `lop3`, `sub`, `fma`
  or `mul` (`half_asm` replaced by register moves): the scorer with free unpacking.
- `no_key_stores`: the scorer stores no content keys (`stmatrix`) for the value warpgroups, which read the stages as
  they were: the scorer without its shared-memory stores.
- `no_softmax`: the value warpgroups keep every barrier, wait and product but load no scores and run no softmax (P a
  constant): the value chain without its softmax.
- `no_fence`: the scorer hands a tile's keys and scores over without the proxy fence before it
  (`fence_async_shared`, which compiles to `MEMBAR.ALL.CTA` and `FENCE.VIEW.ASYNC.S` right after the next tile's
  code-word loads are issued): what the fence and any wait it makes on those loads cost.
"""

from __future__ import annotations

import argparse
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT = "kernels/mla_decode_gluon_split.py"
COMMON = "kernels/mla_decode_gluon_common.py"


def moved_words_asm(bits: int) -> str:
    """PTX with `half_asm(bits)`'s operands (outputs `$0 .. $(E-1)`, then the word and four pair operands) that moves
    the word into every output pair: no unpacking instruction."""
    n = 16 // bits
    return "{\n" + "".join(f"mov.b32 {{${k}, ${k + n}}}, ${2 * n};\n" for k in range(n)) + "}"


_SOFTMAX_START = "        s = gl.permute(sbuf.slice(HF * HM, HM, dim=0).load(sr_l), (1, 0))  # [64 tokens, HM rows]\n"
_SOFTMAX_END = "        m_i = m_new\n"
_NO_SOFTMAX = """        _cta_barrier()
        mbarrier.arrive(bars.index(S_EMPTY), count=1)
        p = gl.full([BT, HM], 0.015625, gl.float32, s_l)
        alpha = gl.full([HM], 1.0, gl.float32, row_l)
        move = gl.full([HM], 0, gl.int32, row_l) > 0
        l_i = l_i + 1.0
        m_i = gl.zeros([HM], gl.float32, row_l)
"""

# variant -> edits `(file, old, new)` (`old` held exactly once) or `(file, (first line, last line), new)` (the lines
# from the first through the last replaced)
EDITS = {
    "no_unpack": [
        (COMMON, "_HALF_ASM_2 = gl.constexpr(half_asm(2))", f"_HALF_ASM_2 = gl.constexpr({moved_words_asm(2)!r})"),
        (COMMON, "_HALF_ASM_4 = gl.constexpr(half_asm(4))", f"_HALF_ASM_4 = gl.constexpr({moved_words_asm(4)!r})"),
    ],
    "no_key_stores": [
        (SPLIT, "vbuf[u].index(st), u == 0, True, dot_a)", "vbuf[u].index(st), u == 0, False, dot_a)"),
        (SPLIT, "vbuf[u + 1].index(st), False, True, dot_a)", "vbuf[u + 1].index(st), False, False, dot_a)"),
    ],
    "no_softmax": [(SPLIT, (_SOFTMAX_START, _SOFTMAX_END), _NO_SOFTMAX)],
    "no_fence": [(SPLIT, "    fence_async_shared()  # this warpgroup's key stores visible to the value wgmmas\n", "")],
}


def apply_edit(text: str, old, new: str, variant: str, path: str) -> str:
    """`text` with one edit of `variant` applied (`EDITS`); stops where the kernel no longer holds its text once."""
    first, last = (old, "") if isinstance(old, str) else old  # a region: from `first` through the next `last`
    start = text.find(first)
    end = text.find(last, start + len(first))
    if text.count(first) != 1 or end < 0:
        raise SystemExit(f"split_ceilings: {path} no longer holds the text that variant {variant!r} edits "
                         f"({first.strip()[:60]!r}, {text.count(first)} times): bring EDITS[{variant!r}] up to date "
                         "with the kernel")
    return text[:start] + new + text[end + len(last):]


def folder_name(spec: str) -> str:
    """The folder of variant `spec` (`a+b` -> `a_and_b`)."""
    return spec.replace("+", "_and_")


def write_variant(spec: str, out: str, root: str = ROOT) -> str:
    """Write the tree of variant `spec` (`EDITS` names joined by `+`) under `out`: this tree's `kernels/` and
    `quantmla_hf/` (its assets left out) with the edits applied. Returns the tree's folder."""
    names = [n for n in spec.split("+") if n]
    unknown = [n for n in names if n not in EDITS]
    if unknown or not names:
        raise SystemExit(f"split_ceilings: unknown variant {spec!r}: combine {sorted(EDITS)} with '+'")
    dest = os.path.join(out, folder_name(spec))
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "assets")
    for folder in ("kernels", "quantmla_hf"):
        shutil.copytree(os.path.join(root, folder), os.path.join(dest, folder), ignore=ignore)
    for name in names:
        for path, old, new in EDITS[name]:
            target = os.path.join(dest, path)
            with open(target) as f:
                text = f.read()
            with open(target, "w") as f:
                f.write(apply_edit(text, old, new, name, path))
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to write the variants' trees into")
    ap.add_argument("--variants", default="no_unpack,no_key_stores,no_softmax,no_fence,no_unpack+no_key_stores",
                    help="comma list of variants, each EDITS names joined by '+'")
    a = ap.parse_args()
    trees = [write_variant(v, a.out) for v in a.variants.split(",") if v]
    print("\n".join(trees))
    print("time them: python benchmarks/bench_decode.py --repeat 3 --baseline-path " + ",".join(trees)
          + " --formats C4R4 --points 128:8:32768,128:32:32768")


if __name__ == "__main__":
    main()
