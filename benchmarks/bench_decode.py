"""Decode attention of one MLA layer: `mla_decode_static` (the library's one dispatch, `select_backend`, or one named
backend) on the packed cache vs BF16 baselines on a BF16 latent cache: PyTorch absorbed attention (two bmm), a
public BF16 MLA Triton decode kernel when one is given (`--bf16-kernel FILE`: vLLM's `triton_decode_attention.py`,
fetched separately and never committed) and the stock transformers step (`--stock`). DeepSeek-V2-Lite dims.

    python benchmarks/bench_decode.py --check [--backends default,gluon_regs,gluon_wide,gluon_split,triton]
        every backend vs the fp64 reference at real sizes (d_c 512, 16/128 heads, B 1-64, up to 128K, Tq up to 16,
        bf16/fp32/1e6-scaled queries, bf16/fp16/fp32 models, B x N x 576 > 2^31), each launch replayed from a CUDA
        graph as well (bitwise the eager result), and capacity invariance (bitwise)
    python benchmarks/bench_decode.py --bench [--graph] [--points H:B:N,...] [--formats C4R4,...] --out DIR
        timing table with the copy-bandwidth ceiling
    python benchmarks/bench_decode.py --repeat ROUNDS --points H:B:N,... --formats C4R4,... [--baseline-path DIR]
        every method replayed from a CUDA graph, in turns, ROUNDS times: 95% intervals of each time and of the
        ratio new / baseline (`--baseline-path`: the kernels of an older tree, e.g. `git archive REV | tar -x -C DIR`,
        or of several, `DIR,DIR,...` (the variants `split_ceilings.py` writes, say), each row named by its folder,
        imported side by side in the same process and run through that tree's dispatch, or both trees through one
        backend with `--repeat-backend NAME`, e.g. `triton` for the portable kernel; `--also-backends A,B`: those
        backends beside the default on the same cache, e.g. `gluon_wide,gluon_regs`; `--splits 8,16`: the default
        decode with those split targets beside it; `--paged`:
        the paged kernels, the default choice and the others that take the case, on the same cache laid out in pages
        of 64). The interval is over the rounds: where each tree's buffers land is not in it, and two trees running
        the same launch measured up to 3% apart at batch 1 (docs/BENCHMARKS.md, "Copy programs in the first wave")
    python benchmarks/bench_decode.py --repeat ROUNDS --placements K --points H:B:N,... --formats C4R4,C2R4
        each format's default decode on K caches allocated one after the other, in turns: the spread between
        allocations of the same kernel (which one allocation's rounds do not show) and each format's ratio to the
        first format's with its interval over the allocations
    python benchmarks/bench_decode.py --check --paged
        also the paged backends (the Gluon kernels where they apply, triton) vs the fp64 paged reference: requests of
        unequal lengths (page edges, shorter than sink + recent) with pages and copy rows shuffled
    python benchmarks/bench_decode.py --repeat ROUNDS --flashmla DIR --points H:B:N,... --formats C4R4,...
        also DeepSeek's FlashMLA (its BF16 dense decode, built from source into DIR: `flash_mla_cuda*.so`, never
        committed) on the same history as a BF16 page pool, replayed from a CUDA graph beside every format: each
        format's ratio to FlashMLA with its interval, and the outputs compared (`--bench` gets a FlashMLA row too)
    python benchmarks/bench_decode.py --profile H:B:N:FORMAT [--backends B] [--iters 20] [--paged]
        one point run a few times for a profiler to attach (`ncu -k regex:mla_decode -s 2 -c 1 ...`)
    python benchmarks/bench_decode.py --kernel-times H:B:N:FORMAT,... [--flashmla DIR] [--iters 50]
        each kernel a decode step launches (eager, `torch.profiler`) with its device time per step: the decode
        kernel and the merge, and FlashMLA's two on the same history where `--flashmla` is given
    python benchmarks/bench_decode.py --rounding-effect [--check-cases FORMAT:H:B:N:Tq,...]
        no kernel: the LSE shift that rounding the packed score keys once to fp16 (the Gluon kernels below 8 bits,
        `score_rounding`) causes on the --check cases, per path, against the exact fp64 reference (CPU or GPU)
    TRITON_INTERPRET=1 python benchmarks/bench_decode.py --tiny     # CPU smoke run of the script itself

Times are `triton.testing.do_bench` medians (L2 flushed between runs). "bytes" are the cache bytes the method must
read once (packed tokens + BF16 sink/recent copies for ours, the BF16 latent for the others).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time

import torch
import transformers
import triton
from transformers import AutoConfig, DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from triton.testing import do_bench

from quantmla_hf.ops.backends import (
    BACKENDS,
    PAGED_BACKENDS,
    mla_decode_paged,
    mla_decode_static,
    score_rounding,
    select_backend,
    select_paged_backend,
)
from quantmla_hf.format import CacheFormat, PathFormat
from quantmla_hf.evaluation.intervals import t_interval
from quantmla_hf.kernels.mla_decode_ref import mla_decode_paged_ref
from quantmla_hf.kernels.mla_decode_ref import history_ref, mla_decode_ref
from tree_compare import BASELINE_PACKAGE, load_baseline_decode, ratio_word, summarize_rounds

D_C, D_R, D_NOPE, D_V, HIDDEN = 512, 64, 128, 128, 2048
SCALING = (D_NOPE + D_R) ** -0.5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {"C4R4": (4, 4), "C2R4": (2, 4), "C4R8": (4, 8), "C2R8": (2, 8), "C8R8": (8, 8), "C16R16": (16, 16)}
POINTS = [(16, 1, 4096), (16, 8, 32768), (16, 32, 32768), (16, 64, 32768), (16, 8, 131072), (128, 8, 32768),
          (128, 32, 32768)]


def make_cache(name, B, N, S=4, R=128, dtype=torch.bfloat16, device=None, seed=0):
    """Random packed planes `[B, N, .]` (codes, positive fp16 scales, int8 zeros) or BF16 values, plus sink/recent
    copies. N is the planes' capacity (the decoded length may be smaller)."""
    cb, rb = CONFIGS[name]
    device = device or DEVICE
    fmt = CacheFormat(PathFormat(D_C, cb, 64), PathFormat(D_R, rb, 64), S, R)
    g = torch.Generator(device=device).manual_seed(seed)

    def planes(f):
        if not f.quantized:
            return {"values": torch.randn(B, N, f.dim, generator=g, device=device, dtype=dtype)}
        return {
            "codes": torch.randint(0, 256, (B, N, f.code_bytes), generator=g, device=device, dtype=torch.uint8),
            "scale": (torch.rand(B, N, f.n_groups, generator=g, device=device) * 0.1 + 0.01).half(),
            "zero": torch.randint(-3, 4, (B, N, f.n_groups), generator=g, device=device, dtype=torch.int8),
        }

    dense = lambda n, d: torch.randn(B, n, d, generator=g, device=device, dtype=dtype)  # noqa: E731
    return fmt, planes(fmt.content), planes(fmt.rope), dense(S, D_C), dense(S, D_R), dense(R, D_C), dense(R, D_R)


def cache_bytes(fmt, B, N):
    S, R = fmt.sink_tokens, fmt.recent_tokens
    packed = max(0, N - S - R)
    return B * (packed * fmt.packed_bytes_per_token() + (N - packed) * fmt.dense_bytes_per_token())


def decode_fn(backend, N, capacity=None, num_splits=None):
    """`(args of mla_decode_ref) -> (o, lse)` through `mla_decode_static` with a device-side length `N` and the planes'
    `capacity` (default N): `backend` "default" takes `select_backend`'s choice; `num_splits` overrides the split
    target (`split_plan`)."""
    length = torch.tensor([N], dtype=torch.int64, device=DEVICE)
    cap = capacity or N
    chosen = None if backend == "default" else backend

    def run(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, n, scaling):
        return mla_decode_static(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, length, cap, scaling, backend=chosen,
                                 num_splits=num_splits)

    return run


def load_baseline(path, package=BASELINE_PACKAGE):
    """The decode operation of another tree at `path` (`tree_compare.load_baseline_decode`, under `package`), run
    beside this tree's: a `decode_fn`-like factory, with the tree's paged decode (or None) as its `paged`."""
    decode = load_baseline_decode(path, package)

    def factory(N, capacity=None, backend=None):
        length = torch.tensor([N], dtype=torch.int64, device=DEVICE)
        cap = capacity or N
        named = {"backend": backend} if backend else {}  # else the tree's own dispatch

        def run(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, n, scaling):
            return decode.static(q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, length, cap, scaling, **named)

        return run

    factory.paged = decode.paged
    return factory


def load_baselines(paths: str) -> list[tuple[str, object]]:
    """`--baseline-path DIR[,DIR...]` -> `[(label, load_baseline factory)]`, each tree under a package of its own:
    one tree is "old"; several are "old-NAME" by their folders' names, which must differ."""
    roots = [p for p in paths.split(",") if p]
    if len(roots) == 1:
        return [("old", load_baseline(roots[0]))]
    names = [os.path.basename(os.path.normpath(p)) for p in roots]
    if len(set(names)) < len(names):
        raise SystemExit(f"--baseline-path: the trees' folders {names} share names; each tree's rows are named by its "
                         "folder, so give them folders of different names")
    return [(f"old-{n}", load_baseline(p, f"{BASELINE_PACKAGE}_{i}")) for i, (n, p) in enumerate(zip(names, roots))]


CHECK_CASES = [  # (format, heads, batch, length, query tokens)
    ("C4R4", 16, 1, 4096, 1), ("C4R4", 16, 64, 4133, 1), ("C2R4", 16, 8, 32768, 1), ("C2R4", 16, 1, 4096, 1),
    ("C8R8", 16, 4, 32768, 1), ("C16R16", 16, 4, 32768, 1), ("C4R4", 128, 8, 32768, 1), ("C8R8", 128, 4, 32768, 1),
    ("C16R16", 128, 2, 20000, 1), ("C4R4", 128, 2, 131072, 1), ("C4R4", 16, 2, 131072, 4), ("C2R4", 128, 1, 5000, 16),
    ("C4R4", 16, 32, 131072, 1),  # B * N * 576 = 2.4e9 > 2**31 elements
    ("C8R8", 16, 3, 9000, 16), ("C4R4", 16, 5, 20000, 3),
    ("C4R8", 16, 8, 32768, 1), ("C4R8", 128, 4, 20000, 1), ("C4R8", 16, 3, 9000, 16), ("C4R8", 16, 2, 150, 1),
    ("C4R4", 16, 3, 100, 1), ("C2R4", 16, 2, 197, 4),  # shorter than sink + recent; a few packed positions
]
# the default cases whose queries are also scaled by 1e6 (one query token): one per Gluon launch at 16, 48 and 128 heads
ONE_HOT_CASES = [("C4R4", 16, 64, 4133), ("C8R8", 48, 2, 9000), ("C4R8", 128, 4, 20000), ("C8R8", 128, 4, 32768)]


class CheckCase:
    """One `--check` case: planes of `N` positions plus 67 of spare capacity (splits past the device-side length must
    stay empty), queries `[B, H, Tq, .]` of kind `qdt` ("bf16", "fp32", "bf16x1e6", "model": the copies' dtype),
    unequal left padding (row 0 none), and the fp64 references of rows 0 and B - 1 (`reference`)."""

    SPARE = 67

    def __init__(self, name, H, B, N, Tq, qdt, dtype, R=128):
        self.name, self.H, self.B, self.N, self.Tq, self.qdt, self.dtype = name, H, B, N, Tq, qdt, dtype
        self.fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N + self.SPARE, R=R, dtype=dtype, seed=B + N)
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q_lat = torch.randn(B, H, Tq, D_C, device=DEVICE, generator=g)
        q_rot = torch.randn(B, H, Tq, D_R, device=DEVICE, generator=g)
        if qdt.startswith("bf16"):
            mult = 1e6 if qdt == "bf16x1e6" else 1.0
            q_lat, q_rot = (q_lat * mult).bfloat16(), (q_rot * mult).bfloat16()
        elif qdt == "model":
            q_lat, q_rot = q_lat.to(dtype), q_rot.to(dtype)
        lp = torch.randint(0, 40, (B,), device=DEVICE, generator=g)
        lp[0] = 0
        self.args = (q_lat, q_rot, cp, rp, self.fmt, sc, sr, rc, rr, lp, N, SCALING)
        self.refs = {}  # score rounding (content, RoPE) -> {row: fp64 (o, lse)}

    def reference(self, rounding=(False, False)) -> dict:
        """`{row: (o, lse)}` of `mla_decode_ref` in fp64 on rows 0 and B - 1, scoring with `rounding`."""
        if rounding not in self.refs:
            q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, _ = self.args
            self.refs[rounding] = {}
            for b in sorted({0, self.B - 1}):
                row = slice(b, b + 1)
                self.refs[rounding][b] = mla_decode_ref(
                    q_lat[row], q_rot[row], {k: v[row] for k, v in cp.items()}, {k: v[row] for k, v in rp.items()},
                    fmt, sc[row], sr[row], rc[row], rr[row], lp[row], N, SCALING, dtype=torch.float64,
                    score_rounding=rounding)
        return self.refs[rounding]


def check_cases(cases=None) -> list[tuple]:
    """`(format, H, B, N, Tq, query kind, copies dtype)` of `run_check`: each case with bf16 queries, the first four
    with fp32, 1e6-scaled bf16 (one query token) on `ONE_HOT_CASES` by default or on the second given case, and fp16
    and fp32 models: for the default cases C4R4 and C16R16 at 16 heads and C16R16 at 128 in fp16 (the split kernel's
    fp16 planes), for given cases each C16R16 case in fp16."""
    if cases:  # a 16-bit case also in an fp16 model: its planes are in the model's dtype
        models = [c[:5] + ("model", torch.float16) for c in cases if c[0] == "C16R16"]
    else:
        models = ([(f, 16, 3, 1000, 1, "model", dt) for f in ("C4R4", "C16R16")
                   for dt in (torch.float16, torch.float32)]
                  + [("C16R16", 128, 2, 1000, 1, "model", torch.float16)])  # fp16 planes on the split kernel
    one_hot = [cases[min(1, len(cases) - 1)][:4]] if cases else ONE_HOT_CASES
    cases = cases or CHECK_CASES
    return ([c + ("bf16", torch.bfloat16) for c in cases] + [c + ("fp32", torch.bfloat16) for c in cases[:4]]
            + [c + (1, "bf16x1e6", torch.bfloat16) for c in one_hot] + models)


def run_check(out_lines, cases=None, R=128, backends=("default",)):
    """Each backend vs the fp64 reference on rows 0 and B-1 (the kernel runs on the whole batch) of every
    `check_cases` case (`CheckCase`): queries in bf16 (what the attention swap passes), fp32 (high/low split) and
    bf16 x 1e6 (the per-row power of two); model dtypes bf16, fp16 and fp32 (the exact fp32 path). A backend that
    does not take a case says so and is skipped. On a GPU each launch replayed from a CUDA graph must give the eager
    result bit for bit. The output is held to the exact reference; the LSE to the reference
    that scores as the backend does (`score_rounding`: the Gluon kernels round packed keys below 8 bits once to
    fp16), with `lse_vs_exact` beside it, that rounding's effect (`--rounding-effect` shows it per path). With |q| ~
    1e6 the softmax picks one token, and the keys' rounding (a relative 1e-4 of the scores) can pick the other token
    of a near tie: that row's output is held to the rounding reference too, with `out_vs_exact` beside it (random
    C8R8 caches flip a head in about one row in 80 at 48 heads and 9000 positions).

    An fp32 reference is itself off by ~1e-4 in the LSE when scores reach ~100 (C8R8 with random codes)."""
    worst_o, worst_lse, all_ok = 0.0, 0.0, True
    for name, H, B, N, Tq, qdt, dtype in check_cases(cases):
        case = CheckCase(name, H, B, N, Tq, qdt, dtype, R)
        fmt, args, spare = case.fmt, case.args, case.SPARE
        for backend in backends:
            chosen = backend if backend != "default" else select_backend(fmt, H * Tq, B, dtype, DEVICE, args[0].dtype)
            label = backend if backend != "default" else f"default={chosen}"
            exact, design = case.reference(), case.reference(score_rounding(chosen, fmt))
            try:
                o, lse = decode_fn(backend, N, N + spare)(*args)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            except ValueError as e:  # a backend that does not take this case
                out_lines.append(f"check {label} {name} H={H} B={B} N={N} Tq={Tq} q={qdt}: skipped ({e})")
                print(out_lines[-1], flush=True)
                continue
            except RuntimeError as e:  # reported as a failed row; a CUDA fault still ends the process
                all_ok = False
                out_lines.append(f"check {label} {name} H={H} B={B} N={N} Tq={Tq} q={qdt}: ERROR {str(e)[:300]}")
                print(out_lines[-1], flush=True)
                continue
            if DEVICE == "cuda":  # the same launch replayed from a CUDA graph (its dependent merge included)
                run = decode_fn(backend, N, N + spare)
                replayed = replay_once(lambda: run(*args))
                same = torch.equal(o, replayed[0]) and torch.equal(lse, replayed[1])
                all_ok = all_ok and same
                out_lines.append(f"check {label} {name} H={H} B={B} N={N} Tq={Tq} q={qdt}: CUDA-graph replay "
                                 f"{'bitwise identical' if same else 'DIFFERS'}")
                print(out_lines[-1], flush=True)
                del replayed
            for b, (ref_o, ref_lse) in exact.items():
                out_ref = design[b][0] if qdt == "bf16x1e6" else ref_o
                rel = ((o[b : b + 1] - out_ref).norm() / out_ref.norm()).item()
                rel_exact = ((o[b : b + 1] - ref_o).norm() / ref_o.norm()).item()
                lse_exact = (lse[b : b + 1] - ref_lse).abs().max().item()
                lse_err = (lse[b : b + 1] - design[b][1]).abs().max().item()
                lse_tol = 1e-4 * max(1.0, ref_lse.abs().max().item() / 100) if qdt == "bf16x1e6" else 1e-4
                ok = rel < 2e-3 and lse_err < lse_tol and torch.isfinite(o).all().item()
                worst_o = max(worst_o, rel)
                if qdt != "bf16x1e6":
                    worst_lse = max(worst_lse, lse_err)
                all_ok = all_ok and ok
                line = (f"check {label:18s} {name:6s} H={H:3d} B={B:2d} N={N:6d} Tq={Tq:2d} q={qdt:8s} "
                        f"copies={str(dtype)[6:]:8s} row={b:2d} out_rel={rel:.2e} lse_abs={lse_err:.2e} "
                        f"lse_vs_exact={lse_exact:.2e} "
                        + (f"out_vs_exact={rel_exact:.2e} " if qdt == "bf16x1e6" else "") + ("OK" if ok else "FAIL"))
                print(line, flush=True)
                out_lines.append(line)
            del o, lse
        del case, args
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    line = f"check worst out_rel={worst_o:.2e} (limit 2e-3) lse_abs={worst_lse:.2e} (limit 1e-4)"
    print(line, flush=True)
    out_lines.append(line)
    return all_ok


def run_rounding_effect(out_lines, cases=None, R=128):
    """What rounding the packed keys of the scores once to fp16 (`score_rounding`) does to the LSE on `run_check`'s
    cases with bf16 queries (and its 1e6-scaled one), no kernel involved: per case the largest LSE shift over rows 0
    and B - 1 from rounding the content keys, the RoPE keys, and both, against the exact fp64 reference. Runs on the
    CPU as on a GPU."""
    header = f"{'format':6s} {'H':>4s} {'B':>3s} {'N':>7s} {'Tq':>3s} {'queries':8s} {'|lse|':>10s} " \
             f"{'content':>9s} {'rope':>9s} {'both':>9s}"
    print(header, flush=True)
    out_lines.append(header)
    for name, H, B, N, Tq, qdt, dtype in check_cases(cases):
        if qdt not in ("bf16", "bf16x1e6"):
            continue
        case = CheckCase(name, H, B, N, Tq, qdt, dtype, R)
        exact = case.reference()
        shift = {}
        for label, rounding in (("content", (True, False)), ("rope", (False, True)), ("both", (True, True))):
            rounded = case.reference(rounding)
            shift[label] = max((rounded[b][1] - exact[b][1]).abs().max().item() for b in exact)
        size = max(lse.abs().max().item() for _, lse in exact.values())
        line = (f"{name:6s} {H:4d} {B:3d} {N:7d} {Tq:3d} {qdt:8s} {size:10.4g} "
                + " ".join(f"{shift[k]:9.2e}" for k in ("content", "rope", "both")))
        print(line, flush=True)
        out_lines.append(line)


def check_capacity_invariance(out_lines, backends, cases=None):
    """The same positions decoded from planes of two capacities (N + 67, as a growing cache holds them, and 4N, a
    larger static cache): the split boundaries follow the length, not the capacity, so `(o, lse)` must be bitwise
    identical (what lets the growing and static caches give the same greedy tokens)."""
    cases = cases or [("C4R4", 16, 1, 4096, 1), ("C4R4", 16, 32, 32768, 1), ("C4R4", 128, 2, 32768, 1),
                      ("C2R4", 16, 3, 20000, 3), ("C8R8", 16, 2, 9000, 1), ("C16R16", 16, 2, 9000, 1)]
    all_ok = True
    for name, H, B, N, Tq in cases:
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, 4 * N, seed=B + N)
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q_lat = torch.randn(B, H, Tq, D_C, device=DEVICE, generator=g).bfloat16()
        q_rot = torch.randn(B, H, Tq, D_R, device=DEVICE, generator=g).bfloat16()
        lp = torch.randint(0, 40, (B,), device=DEVICE, generator=g)
        lp[0] = 0
        short = lambda d: {k: v[:, : N + 67].clone() for k, v in d.items()}  # noqa: E731
        for backend in backends:
            try:
                outs = [decode_fn(backend, N, cap)(q_lat, q_rot, pc, pr, fmt, sc, sr, rc, rr, lp, N, SCALING)
                        for cap, pc, pr in ((N + 67, short(cp), short(rp)), (4 * N, cp, rp))]
            except ValueError:
                continue
            ok = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            all_ok = all_ok and ok
            line = (f"capacity {backend:10s} {name:6s} H={H:3d} B={B:2d} N={N:6d} Tq={Tq:2d} capacities {N + 67} vs "
                    f"{4 * N}: {'bitwise identical' if ok else 'DIFFER'}")
            print(line, flush=True)
            out_lines.append(line)
        del cp, rp
    return all_ok


def bench(fn, slow=False):
    return do_bench(fn, warmup=5 if slow else 25, rep=30 if slow else 100, return_mode="median")


def capture(fn):
    """`fn` run once, then captured in a CUDA graph: `(graph, the captured call's result)`."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def graphed(fn):
    """`fn` captured once in a CUDA graph: the returned callable replays it (no Python or launch overhead)."""
    return capture(fn)[0].replay


def replay_once(fn):
    """`fn()`'s result as a CUDA graph that captured it computes it, replayed once on a poisoned output (the
    graph's own output tensors, filled with NaN first)."""
    graph, result = capture(fn)
    for t in result:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return result


def copy_ceiling():
    n = 2 * 1024**3
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n / ms / 1e6  # GB/s counting read + write


def torch_absorbed(q, kv, scaling):
    """Plain PyTorch absorbed decode on a BF16 latent cache `kv: [B, N, 576]`: two bmm and a softmax."""
    s = torch.matmul(q, kv.transpose(1, 2)).float() * scaling  # [B, H, N]
    p = torch.softmax(s, dim=-1).to(kv.dtype)
    return torch.matmul(p, kv[..., :D_C])


def stock_layer(H):
    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=HIDDEN, num_attention_heads=H, num_key_value_heads=H,
                               q_lora_rank=None, kv_lora_rank=D_C, qk_rope_head_dim=D_R, qk_nope_head_dim=D_NOPE,
                               v_head_dim=D_V, num_hidden_layers=1, rope_interleave=True)
    cfg._attn_implementation = "sdpa"
    attn = DeepseekV3Attention(cfg, layer_idx=0).to(DEVICE).to(torch.bfloat16).eval()
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg).to(DEVICE)


def stock_step_fn(cfg, attn, rope, B, N):
    cache = DynamicCache(config=cfg)
    cache.update(torch.randn(B, 1, N, D_C, device=DEVICE, dtype=torch.bfloat16),
                 torch.randn(B, 1, N, D_R, device=DEVICE, dtype=torch.bfloat16), 0)
    x = torch.randn(B, 1, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    pos = torch.full((B, 1), N, device=DEVICE)
    cos_sin = rope(x, pos)
    kw = "cache" if "cache" in inspect.signature(attn.forward).parameters else "past_key_values"

    def step():
        extra = cache.get_seq_length() - N
        if extra > 0:
            cache.crop(-extra)  # every timed step sees the same N-token history (negative: both API versions)
        return attn(x, position_embeddings=cos_sin, attention_mask=None, **{kw: cache})

    return step


def load_bf16_kernel(path):
    """vLLM's BF16 MLA Triton decode (`decode_attention_fwd`) from a local copy of its `triton_decode_attention.py`
    (fetched for the benchmark, never committed), or None."""
    if not path or not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("bf16_mla_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.decode_attention_fwd


def bf16_kernel_fn(decode_attention_fwd, B, H, N, kv):
    """One decode step of the BF16 kernel on the latent cache `kv: [B, N, 576]` (page size 1, identity block
    table), 16 splits as vLLM's MLA backend uses by default for decode."""
    q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
    k_buf = kv.view(B * N, 1, D_C + D_R)
    v_buf = k_buf[..., :D_C]
    o = torch.empty(B, H, D_C, device=DEVICE, dtype=torch.bfloat16)
    lse = torch.empty(B, H, device=DEVICE, dtype=torch.float32)
    req_to_token = torch.arange(B * N, device=DEVICE, dtype=torch.int32).view(B, N)
    seq_lens = torch.full((B,), N, device=DEVICE, dtype=torch.int32)
    splits = 16
    logits = torch.empty(B, H, splits, D_C + 1, device=DEVICE, dtype=torch.float32)
    return lambda: decode_attention_fwd(q, k_buf, v_buf, o, lse, req_to_token, seq_lens, logits, splits, SCALING, 1)


def load_flashmla(path):
    """DeepSeek's FlashMLA extension (`flash_mla_cuda`) from the folder `path` it was built in, or None."""
    if not path:
        return None
    if not os.path.isdir(path):
        raise SystemExit(f"--flashmla {path!r} is not a folder; build FlashMLA there (its README) and pass the folder")
    sys.path.insert(0, path)
    try:
        import flash_mla_cuda
    except ImportError as e:
        raise SystemExit(f"--flashmla {path!r}: could not import flash_mla_cuda ({e}); build it in that folder") from e
    return flash_mla_cuda


FLASHMLA_PAGE = 64  # FlashMLA's page size (page_block_size)


def flashmla_fn(flash_mla_cuda, q_lat, q_rot, history_c, history_r):
    """One FlashMLA decode step on the history `[B, N, d_c]`, `[B, N, d_R]` laid out as its BF16 page pool
    `[B * ceil(N / 64), 64, 1, 576]` (RoPE key in the last 64 columns, identity block table), queries
    `[B, 1, H, 576]`; the scheduler metadata is computed once, outside the timed call (as a server does per batch
    shape). Returns `(step, outputs)`: `step()` runs it, `outputs()` gives `(o [B, H, d_c] fp32, lse [B, H])`."""
    B, N, _ = history_c.shape
    H = q_lat.shape[1]
    pages = -(-N // FLASHMLA_PAGE)
    kv = torch.zeros(B, pages * FLASHMLA_PAGE, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
    kv[:, :N, :D_C] = history_c.to(torch.bfloat16)
    kv[:, :N, D_C:] = history_r.to(torch.bfloat16)
    pool = kv.view(B * pages, FLASHMLA_PAGE, 1, D_C + D_R)
    q = torch.cat([q_lat, q_rot], dim=-1).to(torch.bfloat16).transpose(1, 2).contiguous()  # [B, 1, H, 576]
    table = torch.arange(B * pages, device=DEVICE, dtype=torch.int32).view(B, pages)
    lengths = torch.full((B,), N, device=DEVICE, dtype=torch.int32)
    meta, splits = flash_mla_cuda.get_mla_metadata(lengths, H, 1)
    result = {}

    def step():
        result["out"] = flash_mla_cuda.fwd_kvcache_mla(q, pool, D_C, lengths, table, SCALING, False, meta, splits)

    def outputs():
        o, lse = result["out"]
        return o[:, 0].float(), lse[:, :, 0]

    return step, outputs


def flashmla_history(fmt, cp, rp, sc, sr, rc, rr, lp, N):
    """The `[B, N, d]` history the packed decode attends to (sink and recent copies, the rest dequantized), as
    FlashMLA's BF16 latent: both methods then compute the same function."""
    length = torch.tensor([N], dtype=torch.int64, device=DEVICE)
    S, R = fmt.sink_tokens, fmt.recent_tokens
    c = history_ref(cp, fmt.content, sc, rc, lp, length, S, R)
    r = history_ref(rp, fmt.rope, sr, rr, lp, length, S, R)
    return c[:, :N].to(torch.bfloat16), r[:, :N].to(torch.bfloat16)


def compare_flashmla(flash_mla_cuda, fmt, args, N):
    """Relative difference of this library's decode (`args` of `decode_fn`) and FlashMLA's on the same history:
    `(output, max |lse difference|)`; both read bf16 values, so they differ by bf16 rounding only."""
    q_lat, q_rot, cp, rp, _, sc, sr, rc, rr, lp, _, _ = args
    o, lse = decode_fn("default", N)(*args)
    step, outputs = flashmla_fn(flash_mla_cuda, q_lat, q_rot, *flashmla_history(fmt, cp, rp, sc, sr, rc, rr, lp, N))
    step()
    fo, flse = outputs()
    o = o[:, :, 0].float()
    return ((o - fo).norm() / fo.norm()).item(), (lse[:, :, 0] - flse).abs().max().item()


def _queries(B, H):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()  # bf16: what the attention swap passes
    q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
    return q_lat, q_rot, torch.zeros(B, dtype=torch.long, device=DEVICE)


def run_bench(out_lines, points, formats, bf16_kernel=None, stock=False, graph=False, flashmla=None):
    """Timing table: every point times the default dispatch per format, the torch bmm on a BF16 latent cache and,
    when given, the BF16 Triton kernel and FlashMLA (`flashmla`: the `flash_mla_cuda` module), in the same process. `graph`: every method replayed from a CUDA graph (no
    host or launch overhead; a method that cannot be captured is timed eagerly and says so)."""

    def timed(fn):
        if not graph:
            return bench(fn), ""
        try:
            return bench(graphed(fn)), "-graph"
        except Exception:  # not capturable (host synchronisation): eager, marked as such
            torch.cuda.synchronize()
            return bench(fn), "-eager"

    ceiling = copy_ceiling()
    out_lines.append(f"copy ceiling: {ceiling:.0f} GB/s (device-to-device copy of 2 GiB, read + write)")
    print(out_lines[-1], flush=True)
    rows = []
    for H, B, N in points:
        q_lat, q_rot, lp = _queries(B, H)
        here = []
        for name in formats:
            fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            fn = decode_fn("default", N)
            ms, sfx = timed(lambda: fn(*args))
            backend = select_backend(fmt, H, B, sc.dtype, DEVICE)
            here.append(dict(method=f"{name}-{backend}{sfx}", H=H, B=B, N=N, ms=ms, bytes=cache_bytes(fmt, B, N)))
            del cp, rp
        kv_bytes = B * N * (D_C + D_R) * 2
        kv = torch.randn(B, N, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        ms, sfx = timed(lambda: torch_absorbed(q, kv, SCALING))
        here.append(dict(method="torch-bmm-bf16" + sfx, H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
        if bf16_kernel is not None and B * N * (D_C + D_R) < 2**31:  # that kernel's int32 offsets
            ms, sfx = timed(bf16_kernel_fn(bf16_kernel, B, H, N, kv))
            here.append(dict(method="vllm-triton-bf16" + sfx, H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
        if flashmla is not None:
            step, _ = flashmla_fn(flashmla, q_lat, q_rot, kv[..., :D_C], kv[..., D_C:])
            ms, sfx = timed(step)
            here.append(dict(method="flashmla-bf16" + sfx, H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
            del step
        del kv
        if stock and B * N * H * (D_NOPE + D_V) * 2 * 3 < 60e9:
            step = stock_step_fn(*stock_layer(H), B, N)
            here.append(dict(method="stock-transformers", H=H, B=B, N=N, ms=bench(step, slow=True), bytes=kv_bytes))
            del step
        torch.cuda.empty_cache()
        for r in here:
            r["GBps"] = r["bytes"] / r["ms"] / 1e6
            r["pct_ceiling"] = 100 * r["GBps"] / ceiling
            out_lines.append(f"H={H:3d} B={B:2d} N={N:6d} {r['method']:24s} {r['ms']:8.4f} ms {r['GBps']:6.0f} GB/s "
                             f"{r['pct_ceiling']:5.1f}%")
            print(out_lines[-1], flush=True)
        rows += here
    return ceiling, rows


def paged_fn(args, page_size=64, num_splits=None, backend=None, decode=None):
    """The same cache laid out in pages (`quantmla_hf/ops/backends.py`'s `mla_decode_paged`, or `decode`, another
    tree's): each batch row one request of N positions in consecutive pages of `page_size`, one query token each; a
    callable returning `(o [B, H, d_c], lse)` (`num_splits`: the kernel's split target, default its own rule;
    `backend`: default `select_paged_backend`). A 16-bit cache in pages keeps no copies, as the paged cache's."""
    q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, scaling = args
    if not fmt.content.quantized:
        sc, sr, rc, rr = (t[:, :0] for t in (sc, sr, rc, rr))
    B, H = q_lat.shape[:2]
    if N % page_size:
        raise ValueError(f"--paged needs N divisible by the page size {page_size}, got {N}")
    pages = {k: {n: v.view(-1, page_size, v.shape[-1]) for n, v in planes.items()} for k, planes in
             (("c", cp), ("r", rp))}
    table = torch.arange(B * N // page_size, device=DEVICE, dtype=torch.int32).view(B, -1)
    rows = torch.arange(B, device=DEVICE, dtype=torch.int32)
    lens = torch.full((B,), N, device=DEVICE, dtype=torch.int32)
    ql, qr = q_lat[:, :, 0].contiguous(), q_rot[:, :, 0].contiguous()
    cu = torch.arange(B + 1, device=DEVICE, dtype=torch.int32)

    def run():
        return (decode or mla_decode_paged)(ql, qr, pages["c"], pages["r"], fmt, sc, sr, rc, rr, table, rows, cu, lens,
                                            scaling, token_request=rows, max_seq_len=N, num_splits=num_splits,
                                            backend=backend)

    return run


PAGED_CHECK_CASES = [("C4R4", 16, 5, 32768), ("C2R4", 16, 4, 9000), ("C8R8", 16, 3, 9000), ("C4R4", 128, 3, 20000),
                     ("C2R4", 128, 4, 9000), ("C4R4", 16, 6, 400), ("C16R16", 16, 3, 9000), ("C4R8", 16, 5, 32768),
                     ("C4R8", 128, 3, 9000), ("C16R16", 128, 3, 20000)]  # (format, heads, requests, longest length)


def check_paged(out_lines, cases=None, page_size=64):
    """The paged backends against the fp64 paged reference (`mla_decode_paged_ref`): one query token for each of B
    requests of unequal lengths (the longest N, a page edge past it, half, four pages and three tokens, shorter
    than sink + recent, one token), each request's pages drawn at random from the pool and the copy rows
    shuffled (a 16-bit cache keeps no copies, as the paged cache's). A backend that does not take a case says so and
    is skipped."""
    all_ok = True
    for name, H, B, N in cases or PAGED_CHECK_CASES:
        per = -(-N // page_size)
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, per * page_size, seed=B + N)
        if not fmt.content.quantized:
            sc, sr, rc, rr = (t[:, :0] for t in (sc, sr, rc, rr))
        pool = {k: {n: v.reshape(-1, page_size, v.shape[-1]) for n, v in planes.items()} for k, planes in
                (("c", cp), ("r", rp))}
        g = torch.Generator().manual_seed(N)
        table = torch.randperm(B * per, generator=g).view(B, per).to(torch.int32).to(DEVICE)
        rows = torch.randperm(B, generator=g).to(torch.int32).to(DEVICE)
        lens = ([N, N - page_size - 1, N // 2 + 1, 4 * page_size + 3, 100, 1] + [N - 7 * i for i in range(B)])[:B]
        seq = torch.tensor([max(1, x) for x in lens], dtype=torch.int32, device=DEVICE)
        cu = torch.arange(B + 1, dtype=torch.int32, device=DEVICE)
        ql = torch.randn(B, H, D_C, device=DEVICE).bfloat16()
        qr = torch.randn(B, H, D_R, device=DEVICE).bfloat16()
        args = (ql, qr, pool["c"], pool["r"], fmt, sc, sr, rc, rr, table, rows, cu, seq, SCALING)
        refs = {}  # score rounding (content, RoPE) -> fp64 (o, lse)
        for backend in PAGED_BACKENDS:
            label = f"paged {backend}" + (" (default)" if backend == select_paged_backend(
                fmt, H, B, B, page_size, sc.dtype, DEVICE) else "")
            rounding = score_rounding(backend, fmt)
            for r in {(False, False), rounding} - refs.keys():
                refs[r] = mla_decode_paged_ref(*args, dtype=torch.float64, score_rounding=r)
            (ref_o, ref_lse), design_lse = refs[(False, False)], refs[rounding][1]
            try:
                o, lse = mla_decode_paged(*args, max_seq_len=N, backend=backend)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
            except ValueError as e:
                out_lines.append(f"check {label} {name} H={H} B={B} N={N}: skipped ({e})")
                print(out_lines[-1], flush=True)
                continue
            rel = ((o - ref_o).norm() / ref_o.norm()).item()
            lse_exact = (lse - ref_lse).abs().max().item()
            lse_err = (lse - design_lse).abs().max().item()
            ok = rel < 2e-3 and lse_err < 1e-4 and torch.isfinite(o).all().item()
            all_ok = all_ok and ok
            out_lines.append(f"check {label:26s} {name:6s} H={H:3d} B={B:2d} N={N:6d} lengths={seq.tolist()} "
                             f"out_rel={rel:.2e} lse_abs={lse_err:.2e} lse_vs_exact={lse_exact:.2e} "
                             f"{'OK' if ok else 'FAIL'}")
            print(out_lines[-1], flush=True)
    return all_ok


def _against(got, want):
    """`(o, lse)` of a decode against another's on the same inputs: the output's relative distance and the largest
    LSE difference."""
    (o, lse), (o_w, lse_w) = got, want
    return ((o.float() - o_w.float()).norm() / o_w.float().norm()).item(), (lse - lse_w).abs().max().item()


def run_repeats(out_lines, points, formats, baselines=(), rounds=10, target=None, paged=False, backend="default",
                flashmla=None, also=(), splits=()):
    """Per point: the default dispatch (or the named `backend`) for each format (`new-FMT`), each baseline tree's
    (`baselines`: `load_baselines`' `(label, factory)` pairs, `LABEL-FMT`; the same named backend), the paged kernel on
    the same cache in pages (`paged-FMT`, given `paged`; with a baseline tree that has a paged decode also its
    `LABEL-paged-FMT`) and the torch bmm on a BF16 latent, each captured once in a CUDA graph, the replays timed
    `rounds` times in turns (the order rotated each round) in one process; reported by `summarize_rounds` (ratios to
    the first method) and, per format and baseline tree, the ratio new / LABEL with its interval and a verdict.
    `flashmla` (the `flash_mla_cuda` module): FlashMLA on the first format's history as a BF16 page pool
    (`flashmla-bf16`), each format's ratio to it with its interval, and each format's output against FlashMLA's on its
    own history. `also`: backends timed beside the default on the same cache (`BACKEND-FMT`, and with `paged` their
    paged launch, `paged-BACKEND-FMT`), where they take the case, each output against the default's on the same
    inputs. `splits`: split targets timed beside the default's (`splitsN-FMT`, the `num_splits` override of
    `split_plan`), each output against the default's and each time's ratio to the default's with its interval."""
    out = []
    for H, B, N in points:
        q_lat, q_rot, lp = _queries(B, H)
        replays, keep = {}, []
        for name in formats:
            fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            named = None if backend == "default" else backend
            makers = [("new", decode_fn(backend, N))] + [(label, tree(N, backend=named)) for label, tree in baselines]
            for tag, fn in makers:
                keep.append((fn, args))  # a graph reads the tensors it was captured with
                replays[f"{tag}-{name}"] = graphed(lambda fn=fn, args=args: fn(*args))
            want = decode_fn(backend, N)(*args) if also or splits else None  # what `also` and `splits` are held to
            for extra in also:
                fn = decode_fn(extra, N)
                try:  # (`graphed` runs it once before capturing: a backend that does not take the case raises)
                    replays[f"{extra}-{name}"] = graphed(lambda fn=fn, args=args: fn(*args))
                except ValueError as e:
                    out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} {extra}-{name}: skipped ({e})")
                    print(out_lines[-1], flush=True)
                    continue
                keep.append((fn, args))
                rel, lse_err = _against(fn(*args), want)
                out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} {extra}-{name} against {backend}: "
                                 f"out_rel={rel:.2e} lse_abs={lse_err:.2e}")
                print(out_lines[-1], flush=True)
            for count in splits:
                fn = decode_fn(backend, N, num_splits=count)
                replays[f"splits{count}-{name}"] = graphed(lambda fn=fn, args=args: fn(*args))
                keep.append((fn, args))
                rel, lse_err = _against(fn(*args), want)
                out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} splits{count}-{name} against {backend}: "
                                 f"out_rel={rel:.2e} lse_abs={lse_err:.2e}")
                print(out_lines[-1], flush=True)
            if paged:  # the default paged kernel, and the other ones that take the case
                choice = select_paged_backend(fmt, H, B, B, 64, sc.dtype, DEVICE)
                others = {"gluon_split": ("gluon_wide",), "gluon_wide": ("gluon_regs", "triton"),
                          "gluon_regs": ("triton",)}.get(choice, ())
                others = others + tuple(b for b in also if b != choice and b not in others)
                old_paged = [(f"{label}-paged", None, tree.paged) for label, tree in baselines if tree.paged]
                # (not named `backend`: that is the contiguous decode's, for every later format and point)
                for tag, paged_backend, decode in [("paged", None, None)] + old_paged + [(f"paged-{b}", b, None)
                                                                                         for b in others]:
                    run = paged_fn(args, backend=paged_backend, decode=decode)
                    try:
                        replays[f"{tag}-{name}"] = graphed(run)
                    except ValueError as e:  # an `also` backend that does not take the case
                        out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} {tag}-{name}: skipped ({e})")
                        print(out_lines[-1], flush=True)
                        continue
                    keep.append((run, args))
            if flashmla is not None:
                rel, lse_err = compare_flashmla(flashmla, fmt, args, N)
                out_lines.append(f"flashmla H={H:3d} B={B:2d} N={N:6d} {name:6s} vs FlashMLA on the same history: "
                                 f"out_rel={rel:.2e} lse_abs={lse_err:.2e}")
                print(out_lines[-1], flush=True)
                if "flashmla-bf16" not in replays:
                    step = flashmla_step(flashmla, args)
                    keep.append(step)
                    replays["flashmla-bf16"] = graphed(step)
        kv = torch.randn(B, N, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        replays["torch-bmm-bf16"] = graphed(lambda: torch_absorbed(q, kv, SCALING))
        names = list(replays)
        times = {k: [] for k in names}
        for r in range(rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(bench(replays[k]))
        rows, verdict = summarize_rounds(times, target)
        for row in rows:
            out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} {row['method']:16s} {row['ms'].fmt(4)} ms  "
                             f"x{row['ratio'].fmt(3)} of {names[0]}  ({rounds} rounds: "
                             f"{', '.join(f'{t:.4f}' for t in times[row['method']])})")
            print(out_lines[-1], flush=True)
            out.append(dict(method=row["method"], H=H, B=B, N=N, ms=row["ms"].to_dict(),
                            ratio_to_first=row["ratio"].to_dict(), times=times[row["method"]]))
        pairs = [(tag, name, name, "new", tag) for tag, _ in baselines for name in formats] + [
            (tag, f"paged {name}", name, "paged", f"{tag}-paged") for tag, _ in baselines for name in formats
            if f"{tag}-paged-{name}" in times]
        for tag, label, name, new_tag, old_tag in pairs:
            new, old = (torch.tensor(times[f"{t}-{name}"], dtype=torch.float64) for t in (new_tag, old_tag))
            ratio = t_interval(new / old)
            word = ratio_word(ratio)
            out_lines.append(f"new/{tag} H={H:3d} B={B:2d} N={N:6d} {label:12s} x{ratio.fmt(3)}: {word}")
            print(out_lines[-1], flush=True)
            out.append(dict(method=f"new/{tag}-{label.replace(' ', '-')}", H=H, B=B, N=N, ratio=ratio.to_dict(),
                            verdict=word))
        for name in formats:
            for count in splits:
                split, default = (torch.tensor(times[k], dtype=torch.float64) for k in (f"splits{count}-{name}",
                                                                                         f"new-{name}"))
                ratio = t_interval(split / default)
                word = ratio_word(ratio)
                out_lines.append(f"splits/default H={H:3d} B={B:2d} N={N:6d} {name:6s} target {count:4d} "
                                 f"x{ratio.fmt(3)}: {word}")
                print(out_lines[-1], flush=True)
                out.append(dict(method=f"splits{count}/new-{name}", H=H, B=B, N=N, ratio=ratio.to_dict(), verdict=word))
        for name in formats if "flashmla-bf16" in times else ():
            ours, theirs = (torch.tensor(times[k], dtype=torch.float64) for k in (f"new-{name}", "flashmla-bf16"))
            ratio = t_interval(ours / theirs)
            word = ratio_word(ratio)
            out_lines.append(f"vs FlashMLA H={H:3d} B={B:2d} N={N:6d} {name:6s} x{ratio.fmt(3)} of FlashMLA's time: {word}")
            print(out_lines[-1], flush=True)
            out.append(dict(method=f"new/flashmla-{name}", H=H, B=B, N=N, ratio=ratio.to_dict(), verdict=word))
        if verdict is not None:
            out_lines.append(f"repeat H={H:3d} B={B:2d} N={N:6d} {names[0]} against {target} ms: "
                             f"{rows[0]['ms'].fmt(4)}: {verdict}")
            print(out_lines[-1], flush=True)
        del replays, keep, kv
        torch.cuda.empty_cache()
    return out


def summarize_placements(times: dict) -> list[dict]:
    """Per-round replay times `{(format, allocation): [ms per round]}` -> per format (in order) `{format, ms,
    allocations, ratio}`: its mean over every allocation's rounds with its interval, each allocation's mean, and for
    the formats after the first the ratio of their allocation means to the first format's (allocation k against
    allocation k) with its interval over the allocations (None for the first). The rounds' interval of one
    allocation leaves out where the cache happens to lie in memory; this one holds it."""
    formats = list(dict.fromkeys(f for f, _ in times))
    means = {f: torch.tensor([sum(v) / len(v) for (g, _), v in times.items() if g == f], dtype=torch.float64)
             for f in formats}
    if len({m.numel() for m in means.values()}) != 1:
        raise ValueError(f"every format needs the same allocations, got {[(f, m.numel()) for f, m in means.items()]}")
    rows = []
    for f in formats:
        pooled = torch.tensor([t for (g, _), v in times.items() if g == f for t in v], dtype=torch.float64)
        ratio = None if f == formats[0] else t_interval(means[f] / means[formats[0]])
        rows.append(dict(format=f, ms=t_interval(pooled), allocations=means[f].tolist(), ratio=ratio))
    return rows


def run_placements(out_lines, points, formats, allocations, rounds):
    """Per point: the default dispatch of each format on `allocations` caches allocated one after the other (seeds
    0, 1, ..., a spacer allocation of k MiB after the k-th so that the next lands elsewhere), each captured in its
    own CUDA graph, the replays timed `rounds` times in turns; reported by `summarize_placements`."""
    out = []
    for H, B, N in points:
        q_lat, q_rot, lp = _queries(B, H)
        replays, keep = {}, []
        for k in range(allocations):
            for name in formats:
                fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N, seed=k)
                args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
                fn = decode_fn("default", N)
                keep.append((fn, args, torch.empty((k + 1) << 20, dtype=torch.uint8, device=DEVICE)))
                replays[(name, k)] = graphed(lambda fn=fn, args=args: fn(*args))
        names = list(replays)
        times = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                times[n].append(bench(replays[n]))
        for row in summarize_placements(times):
            ratio = "" if row["ratio"] is None else f"  x{row['ratio'].fmt(3)} of {formats[0]} over the allocations"
            out_lines.append(f"placements H={H:3d} B={B:2d} N={N:6d} {row['format']:7s} {row['ms'].fmt(4)} ms"
                             f"{ratio}  (allocation means: {', '.join(f'{t:.4f}' for t in row['allocations'])})")
            print(out_lines[-1], flush=True)
            out.append(dict(format=row["format"], H=H, B=B, N=N, ms=row["ms"].to_dict(), allocations=row["allocations"],
                            ratio=None if row["ratio"] is None else row["ratio"].to_dict()))
        del replays, keep
        torch.cuda.empty_cache()
    return out


def point_args(point: str):
    """`H:B:N:FORMAT` -> `(H, B, N, FORMAT, args)`: `make_cache`'s cache and `_queries`' queries at that point as the
    arguments of `decode_fn`'s step (`--profile`, `--kernel-times`)."""
    H, B, N, name = point.split(":")
    H, B, N = int(H), int(B), int(N)
    q_lat, q_rot, lp = _queries(B, H)
    fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
    return H, B, N, name, (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)


def flashmla_step(flash_mla_cuda, args):
    """FlashMLA's step (`flashmla_fn`) on the history that `decode_fn`'s `args` attend to."""
    q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, _ = args
    return flashmla_fn(flash_mla_cuda, q_lat, q_rot, *flashmla_history(fmt, cp, rp, sc, sr, rc, rr, lp, N))[0]


def run_profile(point: str, backend: str, iters: int, flashmla_path: str = "", paged: bool = False):
    """`H:B:N:FORMAT` decoded `iters` times through `backend` (eager launches, synchronised at the end); backend
    "flashmla": FlashMLA (built in `flashmla_path`) on the same history as a BF16 page pool; `paged`: the same
    cache in pages through the paged launch (`paged_fn`; backend "default" is `select_paged_backend`'s)."""
    if backend == "flashmla" and not flashmla_path:
        raise SystemExit("--profile with backend flashmla needs --flashmla DIR (FlashMLA's build folder)")
    H, B, N, name, args = point_args(point)
    fmt, sc = args[4], args[5]
    if backend == "flashmla":
        step = flashmla_step(load_flashmla(flashmla_path), args)
    elif paged:
        step = paged_fn(args, backend=None if backend == "default" else backend)
    else:
        run = decode_fn(backend, N)
        step = lambda: run(*args)  # noqa: E731
    for _ in range(iters):
        step()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    chosen = select_backend(fmt, H, B, sc.dtype, DEVICE) if backend == "default" and not paged else backend
    print(f"profile {name} H={H} B={B} N={N} {backend} ({chosen}{', paged' if paged else ''}): {iters} calls")


def kernel_times(step, iters: int) -> dict[str, float]:
    """Device time per call of each kernel `step()` launches, in µs, `{kernel name: µs}` in launch order: `iters`
    eager calls under `torch.profiler` after 3 unprofiled ones, each kernel's time summed and divided by `iters`.
    Without CUDA, the CPU operators `step()` calls itself instead (a smoke run: no nested operator counts twice)."""
    for _ in range(3):
        step()
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device if cuda else e.cpu_parent is None:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us() / iters
    return times


def run_kernel_times(out_lines, points: list[str], iters: int, flashmla=None, replays: bool | None = None
                     ) -> list[dict]:
    """`kernel_times` of the default decode at each `H:B:N:FORMAT` point (the `--profile` cache and queries) and,
    with `flashmla` (the loaded extension), of FlashMLA on the same history: one line per kernel, then each method's
    total. With `replays` (default: on CUDA) also the step's CUDA-graph replay time (`bench`, as `--repeat` times it)
    and what of it lies outside the kernels (the replay less their total: launch gaps and the graph's own cost)."""
    replays = DEVICE == "cuda" if replays is None else replays
    rows = []
    for point in points:
        H, B, N, name, args = point_args(point)
        run = decode_fn("default", N)
        methods = [(select_backend(args[4], H, B, args[5].dtype, DEVICE), lambda: run(*args))]
        if flashmla is not None:
            methods.append(("flashmla", flashmla_step(flashmla, args)))
        for method, step in methods:
            times = kernel_times(step, iters)
            total = sum(times.values())
            entries = list(times.items()) + [("total", total)]
            if replays:
                replay = 1e3 * bench(graphed(step))
                entries += [("graph replay", replay), ("outside the kernels", replay - total)]
            for kernel, us in entries:
                out_lines.append(f"kernels H={H:3d} B={B:2d} N={N:6d} {name:6s} {method:11s} {us:9.2f} us  "
                                 f"{kernel[:70]}")
                print(out_lines[-1], flush=True)
                rows.append(dict(H=H, B=B, N=N, format=name, method=method, kernel=kernel, us=us))
    return rows


def run_tiny():
    """The script's CPU code paths at toy sizes (the decode through the Triton interpreter)."""
    fmt, cp, rp, sc, sr, rc, rr = make_cache("C4R4", 2, 300, R=8, device="cpu")
    print("tiny make_cache ok", cache_bytes(fmt, 2, 300))
    lines = []
    assert run_check(lines, cases=[("C4R4", 4, 2, 150, 1)], R=16)
    step = stock_step_fn(*stock_layer(4), 2, 64)
    print("tiny stock step", tuple(step()[0].shape))
    fmt, cp, rp, sc, sr, rc, rr = make_cache("C4R4", 2, 256, R=8, device="cpu")
    q_lat, q_rot = torch.randn(2, 4, 1, D_C), torch.randn(2, 4, 1, D_R)
    args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, torch.zeros(2, dtype=torch.long), 256, SCALING)
    o_paged = paged_fn(args)()[0]
    o_ref = mla_decode_ref(*args)[0][:, :, 0].float()
    err = ((o_paged - o_ref).norm() / o_ref.norm()).item()
    assert err < 2e-3, f"paged layout differs from the reference: {err:.2e}"
    print(f"tiny paged layout ok ({err:.1e})")
    assert check_paged([], cases=[("C4R4", 4, 3, 300)])
    q = torch.randn(2, 4, D_C + D_R, dtype=torch.bfloat16)
    print("tiny kernel times", len(run_kernel_times([], ["4:1:300:C4R4"], iters=1)), "rows")
    print("tiny torch absorbed", tuple(torch_absorbed(q, torch.randn(2, 64, D_C + D_R, dtype=torch.bfloat16), 0.1).shape))


def parse_cases(text: str) -> list[tuple]:
    """`FORMAT:n:n:...,FORMAT:...` (`--check-cases`, `--paged-check-cases`) -> `[(FORMAT, n, n, ...), ...]`."""
    return [(f, *(int(x) for x in rest)) for f, *rest in (c.split(":") for c in text.split(",") if c)]


def split_targets(text: str) -> tuple[int, ...]:
    """`--splits`' comma list as split targets, each at least 1 (`split_plan` takes 0 for its default)."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not all(s.isdigit() and int(s) >= 1 for s in parts):
        raise ValueError(f"--splits takes split targets of at least 1, comma-separated (e.g. 8,16,32), got {text!r}")
    return tuple(int(s) for s in parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--backends", default="default",
                    help=f"comma list for --check / --profile: default (select_backend) or of {BACKENDS} "
                    "(--profile also flashmla, with --flashmla)")
    ap.add_argument("--check-cases", default="", help="FORMAT:H:B:N:Tq,... cases of --check (default: CHECK_CASES)")
    ap.add_argument("--paged-check-cases", default="",
                    help="FORMAT:H:B:N,... cases of --check --paged (default: PAGED_CHECK_CASES)")
    ap.add_argument("--rounding-effect", action="store_true",
                    help="the LSE shift of rounding packed score keys to fp16 on the --check cases (CPU or GPU)")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--graph", action="store_true", help="--bench: replay every method from a CUDA graph")
    ap.add_argument("--points", default="", help="H:B:N,... timing points (default: POINTS)")
    ap.add_argument("--formats", default="C4R4,C2R4,C8R8,C16R16")
    ap.add_argument("--stock", action="store_true", help="--bench: also time the stock transformers step (slow)")
    ap.add_argument("--bf16-kernel", default=os.environ.get("BF16_MLA_KERNEL", ""),
                    help="path to a local copy of vLLM's triton_decode_attention.py (not part of this repository)")
    ap.add_argument("--flashmla", default="",
                    help="--repeat/--bench/--kernel-times: folder where FlashMLA was built (flash_mla_cuda*.so; "
                    "not part of this repository)")
    ap.add_argument("--repeat", type=int, default=0, help="ROUNDS of every method in turns (CUDA-graph replays)")
    ap.add_argument("--paged", action="store_true",
                    help="--repeat: also the paged kernels on the same cache in pages; --check: also check them; "
                    "--profile: the paged launch instead")
    ap.add_argument("--baseline-path", default="",
                    help="--repeat: root of an older tree whose kernels to compare (several: DIR,DIR,...)")
    ap.add_argument("--repeat-backend", default="default",
                    help="--repeat: the backend both trees run (default: each tree's own dispatch)")
    ap.add_argument("--target-ms", type=float, default=None, help="--repeat: where the first method stands")
    ap.add_argument("--also-backends", default="",
                    help="--repeat: comma list of backends timed beside the default on the same cache (and paged)")
    ap.add_argument("--splits", default="",
                    help="--repeat: comma list of split targets timed beside the default's (the num_splits override)")
    ap.add_argument("--placements", type=int, default=0,
                    help="--repeat: instead, each format on this many separately allocated caches (the placement spread)")
    ap.add_argument("--profile", default="", help="H:B:N:FORMAT: run one point --iters times (first of --backends)")
    ap.add_argument("--iters", type=int, default=20, help="--profile: calls; --kernel-times: profiled calls")
    ap.add_argument("--kernel-times", default="",
                    help="H:B:N:FORMAT,...: each kernel's device time per decode step (and FlashMLA's, --flashmla)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the script itself (interpreter, tiny sizes)")
    a = ap.parse_args()
    if a.splits and (not a.repeat or a.placements):
        ap.error("--splits: only with --repeat ROUNDS (without --placements)")
    try:
        splits = split_targets(a.splits)
    except ValueError as e:
        ap.error(str(e))
    if a.tiny:
        run_tiny()
        return
    backends = [b for b in a.backends.split(",") if b]
    if a.profile:
        run_profile(a.profile, backends[0], a.iters, a.flashmla, a.paged)
        return
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    env = (f"GPU {gpu} | torch {torch.__version__} | triton {triton.__version__} | "
           f"transformers {transformers.__version__} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(env, flush=True)
    lines, result = [env], {"env": env}
    points = [tuple(int(x) for x in p.split(":")) for p in a.points.split(",") if p] or POINTS
    formats = [f for f in a.formats.split(",") if f]
    cases = parse_cases(a.check_cases)
    if a.rounding_effect:
        run_rounding_effect(lines, cases or None)
    if a.kernel_times:
        result["kernel_times"] = run_kernel_times(lines, [p for p in a.kernel_times.split(",") if p], a.iters,
                                                  load_flashmla(a.flashmla))
    if a.check:
        result["check_ok"] = run_check(lines, cases=cases or None, backends=backends)
        result["capacity_ok"] = check_capacity_invariance(lines, backends)
        result["paged_ok"] = check_paged(lines, cases=parse_cases(a.paged_check_cases) or None) if a.paged else True
    if a.repeat and a.placements:
        result["placements"] = run_placements(lines, points, formats, a.placements, a.repeat)
    elif a.repeat:
        result["repeats"] = run_repeats(lines, points, formats, load_baselines(a.baseline_path), a.repeat,
                                        a.target_ms, a.paged, a.repeat_backend, load_flashmla(a.flashmla),
                                        tuple(b for b in a.also_backends.split(",") if b),
                                        splits)
    if a.bench:
        bf16 = load_bf16_kernel(a.bf16_kernel)
        lines.append(f"BF16 Triton kernel: {a.bf16_kernel if bf16 else 'not given'}")
        result["ceiling_GBps"], result["rows"] = run_bench(lines, points, formats, bf16, a.stock, a.graph,
                                                           load_flashmla(a.flashmla))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(a.out, "bench_decode.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if "rows" in result:
        print(f"\n{'method':24s} {'H':>4s} {'B':>3s} {'N':>7s} {'ms':>9s} {'GB/s':>7s} {'%ceil':>6s}")
        for r in result["rows"]:
            print(f"{r['method']:24s} {r['H']:4d} {r['B']:3d} {r['N']:7d} {r['ms']:9.4f} "
                  f"{r.get('GBps', 0):7.0f} {r.get('pct_ceiling', 0):6.1f}")
    if a.check and not (result["check_ok"] and result["capacity_ok"] and result["paged_ok"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
