"""`benchmarks/split_ceilings.py`: the split kernel's timing-only variants are this tree's kernel with exactly their
edits, load beside this tree and each other for `bench_decode.py --repeat --baseline-path`, stop where the kernel no
longer holds the text an edit names, and compile for sm_90 without the work they take out."""

import filecmp
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import triton

from quantmla_hf.kernels import mla_decode_gluon_common as mc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _unload_trees():
    """Forget every tree loaded beside this one (`quantmla_baseline*` packages), so that a test may load another tree
    under the same names (a name that holds a tree is not given to another)."""
    for name in [m for m in sys.modules if m.startswith("quantmla_baseline")]:
        del sys.modules[name]


@pytest.fixture
def ceilings(monkeypatch):
    """The script's module, with no tree loaded beside this one before or after the test."""
    monkeypatch.syspath_prepend(BENCH)
    import split_ceilings

    _unload_trees()
    yield split_ceilings
    _unload_trees()


def _changed_files(tree: str) -> set[str]:
    """The files of `tree` that differ from this tree's (relative paths under kernels/ and quantmla_hf/)."""
    changed = set()
    for folder in ("kernels", "quantmla_hf"):
        for base, _, files in os.walk(os.path.join(tree, folder)):
            for name in files:
                rel = os.path.relpath(os.path.join(base, name), tree)
                if not filecmp.cmp(os.path.join(tree, rel), os.path.join(ROOT, rel), shallow=False):
                    changed.add(rel)
    return changed


def test_each_variant_is_this_trees_kernel_with_its_edits(ceilings, tmp_path):
    """Every variant (and a combination) changes only the files its edits name, and each edit is in them: the
    2- and 4-bit unpacking replaced by register moves, the scorer's key stores off, the values' softmax gone."""
    trees = {spec: ceilings.write_variant(spec, str(tmp_path))
             for spec in ("no_unpack", "no_key_stores", "no_softmax", "no_fence", "no_unpack+no_key_stores")}
    assert os.path.basename(trees["no_unpack+no_key_stores"]) == "no_unpack_and_no_key_stores"
    assert _changed_files(trees["no_unpack"]) == {ceilings.COMMON}
    assert _changed_files(trees["no_key_stores"]) == {ceilings.SPLIT}
    assert _changed_files(trees["no_softmax"]) == {ceilings.SPLIT}
    assert _changed_files(trees["no_fence"]) == {ceilings.SPLIT}
    assert _changed_files(trees["no_unpack+no_key_stores"]) == {ceilings.COMMON, ceilings.SPLIT}
    assert not os.path.exists(os.path.join(trees["no_unpack"], "quantmla_hf", "assets"))

    common = open(os.path.join(trees["no_unpack"], ceilings.COMMON)).read()
    assert "half_asm(4))" not in common and "half_asm(2))" not in common
    assert repr(ceilings.moved_words_asm(4)) in common and "lop3" not in ceilings.moved_words_asm(4)
    # the moves keep half_asm's operands: E outputs, then the word
    assert ceilings.moved_words_asm(2).count("mov.b32") == 8 and "$16;" in ceilings.moved_words_asm(2)
    assert ceilings.moved_words_asm(4).count("mov.b32") == 4 and "$8;" in ceilings.moved_words_asm(4)
    split = open(os.path.join(trees["no_key_stores"], ceilings.SPLIT)).read()
    assert "vbuf[u].index(st), u == 0, False, dot_a)" in split
    assert "vbuf[u + 1].index(st), False, False, dot_a)" in split
    assert "index(st), u == 0, True" not in split and "index(st), False, True" not in split  # (copy tiles still store)
    values = open(os.path.join(trees["no_softmax"], ceilings.SPLIT)).read()
    body = values[values.index("def _values("):values.index("def mla_decode_split_kernel(")]
    assert "_references(" not in body and "sbuf.slice(" not in body
    assert body.count("mbarrier.arrive(bars.index(S_EMPTY), count=1)") == 1  # the scorer is still released
    fenced = open(os.path.join(ROOT, ceilings.SPLIT)).read()
    unfenced = open(os.path.join(trees["no_fence"], ceilings.SPLIT)).read()
    assert unfenced.count("fence_async_shared()") == fenced.count("fence_async_shared()") - 1


def test_variants_load_beside_this_tree_and_each_other(ceilings, tmp_path, monkeypatch):
    """`bench_decode.py --baseline-path A,B`: each tree under a package of its own, its rows named by its folder;
    folders of one name are refused, and so is a package name that holds another tree already."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_decode
    import tree_compare

    a = ceilings.write_variant("no_unpack", str(tmp_path))
    b = ceilings.write_variant("no_softmax", str(tmp_path))
    trees = bench_decode.load_baselines(f"{a},{b}")
    assert [label for label, _ in trees] == ["old-no_unpack", "old-no_softmax"]
    packages = [f"{tree_compare.BASELINE_PACKAGE}_{i}" for i in range(2)]
    for package, tree in zip(packages, (a, b)):
        module = sys.modules[package + ".kernels.mla_decode_gluon_split"]
        assert module.__file__ == os.path.join(tree, ceilings.SPLIT)
    assert [label for label, _ in bench_decode.load_baselines(a)] == ["old"]

    twin = os.path.join(tmp_path, "elsewhere", "no_unpack")
    shutil.copytree(a, twin)
    with pytest.raises(SystemExit, match="folders of different names"):
        bench_decode.load_baselines(f"{a},{twin}")
    with pytest.raises(ValueError, match="under another package name"):
        tree_compare.load_baseline_decode(twin, packages[0])


def test_an_edit_the_kernel_no_longer_matches_says_which_to_update(ceilings, tmp_path):
    """A kernel whose text an edit names has changed: the script stops and names the edit, rather than writing a
    variant that is this tree's kernel unchanged (a ceiling of nothing)."""
    root = tmp_path / "tree"
    for folder in ("kernels", "quantmla_hf"):
        shutil.copytree(os.path.join(ROOT, folder), root / folder, ignore=shutil.ignore_patterns("assets"))
    split = root / ceilings.SPLIT
    split.write_text(split.read_text().replace("vbuf[u + 1].index(st), False, True, dot_a)", "vbuf[u + 1].index(st))"))
    with pytest.raises(SystemExit, match=r"bring EDITS\['no_key_stores'\] up to date"):
        ceilings.write_variant("no_key_stores", str(tmp_path / "out"), root=str(root))
    with pytest.raises(SystemExit, match="unknown variant 'no_scores'"):
        ceilings.write_variant("no_scores", str(tmp_path / "out"))


COMPILE = textwrap.dedent(
    r"""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import sass_decode as sd

    loops = {}
    for tree in sys.argv[2:]:
        module = sd.tree_modules(tree)[2]
        sass = sd.disassemble(sd.compile_split(4, 4, module=module).asm["cubin"], "-sass")
        counts = [sd.opcode_counts(loop) for loop, _ in sd.main_loops(sass)]
        loops[tree] = [{op: n for op, n in c.items()} for c in counts if any(op.startswith("HGMMA") for op in c)]
    print(json.dumps(loops))
    """
)


@pytest.mark.skipif(not mc.HAVE_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon, Triton >= 3.5)")
def test_variants_compile_for_sm90_without_the_work_they_take_out(ceilings, tmp_path):
    """Every variant at once, its C4R4 split kernel compiled for sm_90 (`sass_decode.py --split --tree`): a scorer
    with no unpacking multiply (this tree's has 144 a tile), no `stmatrix` and no `MEMBAR`, value loops with no
    exponential but their own fences, and every loop keeps its `wgmma`s (36 in the scorer, 16 in each value
    warpgroup)."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled cuobjdump")
    tree = ceilings.write_variant("+".join(ceilings.EDITS), str(tmp_path))
    out = subprocess.run([sys.executable, "-c", COMPILE, BENCH, tree], capture_output=True, text=True, cwd="/",
                         env=dict(os.environ, TRITON_INTERPRET="0"), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    loops = json.loads(out.stdout.splitlines()[-1])[tree]

    def count(c, prefix):
        return sum(n for op, n in c.items() if op.startswith(prefix))

    assert sorted(count(c, "HGMMA") for c in loops) == [16, 16, 36], loops
    (scorer,) = [c for c in loops if count(c, "HGMMA") == 36]
    values = [c for c in loops if count(c, "HGMMA") == 16]
    assert count(scorer, "HMUL2") == count(scorer, "STSM") == count(scorer, "MEMBAR") == 0, scorer
    assert all(count(c, "MUFU.EX2") == 0 and count(c, "MEMBAR") == 1 for c in values), values


def test_repeat_times_several_trees_in_turns_and_names_each_ratio(ceilings, tmp_path, monkeypatch):
    """`bench_decode.py --repeat --baseline-path A,B`: every round times this tree and each tree in turn on the same
    cache, and each tree gets its own rows and its own new / tree ratio (here on the CPU: a replay is the call itself
    and each method's clock reads a time of its own, in the order the methods are captured)."""
    monkeypatch.syspath_prepend(BENCH)
    import bench_decode

    a = ceilings.write_variant("no_unpack", str(tmp_path))
    b = ceilings.write_variant("no_softmax", str(tmp_path))
    trees = bench_decode.load_baselines(f"{a},{b}")
    clock = iter([0.2, 0.1, 0.4, 1.0])  # this tree, no_unpack, no_softmax, the torch bmm
    calls = []

    def captured(fn):
        ms = next(clock)

        def replay():
            calls.append(ms)
            fn()
            return ms
        return replay

    monkeypatch.setattr(bench_decode, "graphed", captured)
    monkeypatch.setattr(bench_decode, "bench", lambda replay: replay())
    lines = []
    rows = bench_decode.run_repeats(lines, [(4, 1, 200)], ["C4R4"], baselines=trees, rounds=3)
    timed = {r["method"]: r["ms"]["value"] for r in rows if "ms" in r}
    assert timed == pytest.approx({"new-C4R4": 0.2, "old-no_unpack-C4R4": 0.1, "old-no_softmax-C4R4": 0.4,
                                   "torch-bmm-bf16": 1.0})
    assert sorted(calls) == sorted([0.2, 0.1, 0.4, 1.0] * 3)  # every method once a round
    ratios = {r["method"]: r["ratio"]["value"] for r in rows if r["method"].startswith("new/")}
    assert ratios == pytest.approx({"new/old-no_unpack-C4R4": 2.0, "new/old-no_softmax-C4R4": 0.5})
    assert any(line.startswith("new/old-no_unpack H=  4") and "x2.000" in line for line in lines), lines
