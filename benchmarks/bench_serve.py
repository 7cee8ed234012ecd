"""Serving benchmark: continuous batching on the paged QuantMLA cache (C4R4 vs C16R16, the BF16-latent baseline
through the same pages) under cache pressure, and against `generate` with static batches.

    python benchmarks/bench_serve.py --out DIR [--layers 27] [--heads 16] [--tiny] [--check]
        [--pressure] [--pressure-requests 5] [--pressure-input 32768] [--pressure-output 1024] [--budget-gib G]
        [--budgets pressure,no-pressure] [--repeat 1]
        [--scale 64,256] [--scale-min 4096] [--scale-max 32768] [--scale-output 256] [--static-batch 8]
        [--profile] [--formats C16R16,C4R4] [--page-size 64] [--max-batch-tokens 8192] [--eager]

Model: the DeepSeek-V2-Lite attention shape (`bench_generate.v2_lite`: 16 heads, d_c 512, d_R 64, dense MLPs,
random bf16 weights, `--layers` layers; `--heads 128` for V2/V3's head count); `--tiny` swaps in a 4-head toy for
a CPU smoke run. Prompts are random token ids; generation is greedy with no end token, so every request yields
exactly its output length.

- `--check`: six requests of mixed lengths arriving at different steps; each request's tokens from continuous
  batching must equal `generate` on it alone with the contiguous `QuantMLACache` of the same format. It runs on an
  fp32 copy of the model (`--check-dtype model` for the bf16 one, where near-tied logits of random weights flip
  between kernels that round differently; `first_difference` says where each request first differs, and
  `margin_at_difference` how far from a tie `generate`'s own logits were there: `logit[its token] - logit[the
  batcher's token]` and the largest |logit| of that step).
- `--pressure`: a fixed cache budget (`--budget-gib`, default: what the C4R4 pages need for all requests at once,
  plus 2%), `--pressure-requests` requests of `--pressure-input` prompt and `--pressure-output` new tokens, all
  arriving at once. The same budget holds ~3.6x fewer C16R16 tokens, so C16R16 serves them a few at a time. Whole-
  job output throughput (generated tokens / wall time from the first arrival to the last token) per format, their
  ratio, preemptions and the peak number of running requests. Then the same without pressure (a budget C16R16 also
  fits, C4R4 must be at least as fast). `--budgets` picks either; `--repeat N` runs N rounds of each (the formats'
  order alternating) and adds the mean ratio with its 95% Student-t interval.
- `--profile`: per format, the `--pressure-*` requests in a cache that holds them: the median wall time of the
  replayed and of the eager (prefill) steps, then `torch.profiler`'s table of 3 eager decode steps.
- `--scale N,M`: N (then M) concurrent requests, prompts uniform in `[--scale-min, --scale-max]`, `--scale-output`
  new tokens: C4R4 continuous batching vs plain `generate` (the model's C4R4 config: static cache, CUDA-graph
  decode steps on a GPU) over static batches of `--static-batch` of the same requests, left-padded, one batch after
  another.

Before its first timed run each path runs once untimed (Triton compiles its kernels on first use): three small
requests per format for continuous batching, two for static `generate`. Continuous batching replays its decode-only
steps from CUDA graphs (`quantmla_hf.paged.graphs`; `graph_steps` and
`graph_captures` in each row, and the wall time of the replayed and of the eager steps, `graph_s` and `eager_s`: the
eager ones are the prefill chunks) unless `--eager`. Rows are printed as JSON lines as they finish and all of them
written to `DIR/bench_serve.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import DEVICE, v2_lite  # noqa: E402

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla  # noqa: E402
from quantmla_hf.attention import ATTN_IMPLEMENTATION  # noqa: E402
from quantmla_hf.intervals import t_interval  # noqa: E402
from quantmla_hf.paged import PagedQuantMLACache, page_bytes, protected_bytes_per_request  # noqa: E402
from quantmla_hf.paged.batching import CACHE_KWARG, ContinuousBatcher  # noqa: E402

ROWS: list[dict] = []


def emit(out_dir: str, row: dict) -> None:
    row = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **row}
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "bench_serve.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


def qconfig(name: str) -> QuantMLAConfig:
    bits = {"C16R16": (16, 16), "C4R4": (4, 4), "C2R4": (2, 4), "C8R8": (8, 8)}[name]
    return QuantMLAConfig(content_bits=bits[0], rope_bits=bits[1], transform="none")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (rng.randint(lo, hi),), generator=g).tolist() for _ in range(n)]


def generate_alone(model, prompt: list[int], new_tokens: int, fmt: str) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of `prompt` alone with the contiguous `QuantMLACache`, and each step's logits `[vocab]` fp32."""
    cache = QuantMLACache(config=model.config, quantization_config=qconfig(fmt))
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, **{CACHE_KWARG: cache})
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.scores]


def first_differences(got: list[list[int]], want: list[list[int]], logits: list[list[torch.Tensor]]):
    """Per request: the first new token where `got` differs from `want` (its length when equal), and there the
    margin `logit[want] - logit[got]` of `want`'s own logits (None when equal). A margin that is a small fraction of
    the logits' scale is a near tie, which any change of summation order can flip in bf16."""
    first, margins = [], []
    for a, b, steps in zip(got, want, logits):
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        first.append(j)
        margins.append(None if j == len(a) else dict(margin=float(steps[j][b[j]] - steps[j][a[j]]),
                                                     scale=float(steps[j].abs().max())))
    return first, margins


WARM: set[str] = set()


def warm_up(model, fmt: str, args) -> None:
    """One small untimed run per format first (Triton compiles its kernels on first use): three requests, one of
    them prefilled in chunks, decoded past a graph capture."""
    if fmt in WARM:
        return
    reqs = prompts(3, 100, 700, model.config.vocab_size, seed=99)
    warm_args = argparse.Namespace(**{**vars(args), "max_batch_tokens": 256})
    run_batcher(model, fmt, reqs, 8, warm_args, num_pages=sum(-(-(len(p) + 8) // args.page_size) for p in reqs) + 2)
    WARM.add(fmt)


def run_batcher(model, fmt: str, reqs: list[list[int]], new_tokens: int, args, budget_bytes=None, num_pages=None,
                arrivals=None, step_medians=False) -> tuple[dict, ContinuousBatcher]:
    """One continuous-batching run: its row, and the batcher (its results; with `step_medians`, `step_ms_median`:
    the median wall time of the replayed and of the eager steps, where the stats keep only their sums)."""
    cache = PagedQuantMLACache(model.config, qconfig(fmt), page_size=args.page_size, max_requests=len(reqs),
                               budget_bytes=budget_bytes, num_pages=num_pages, dtype=model.dtype, device=DEVICE)
    batcher = ContinuousBatcher(model, cache, args.max_batch_tokens, decode_graphs=False if args.eager else "auto")
    for i, p in enumerate(reqs):
        batcher.add_request(str(i), p, new_tokens, arrivals[i] if arrivals else 0)
    step_times = {"replayed": [], "eager": []}
    if step_medians:  # each forwarding step's wall time by kind (a step ends reading its tokens back)
        step = batcher.step

        def timed_step():
            replays, forwarded, t0 = batcher.stats.graph_steps, batcher.stats.forward_tokens, time.perf_counter()
            out = step()
            if batcher.stats.forward_tokens > forwarded:
                kind = "replayed" if batcher.stats.graph_steps > replays else "eager"
                step_times[kind].append(time.perf_counter() - t0)
            return out

        batcher.step = timed_step
    sync()
    t0 = time.perf_counter()
    results = batcher.run()
    sync()
    wall = time.perf_counter() - t0
    batcher.step_ms_median = {k: (statistics.median(v) * 1e3 if v else None) for k, v in step_times.items()}
    s = batcher.stats
    row = dict(format=fmt, requests=len(reqs), cache_tokens=cache.capacity_tokens(), cache_gib=cache.nbytes() / 2**30,
               wall_s=wall, generated=s.generated_tokens, out_tok_s=s.generated_tokens / wall, steps=s.steps,
               forward_tokens=s.forward_tokens, preemptions=s.preemptions, peak_running=s.peak_running,
               peak_pages=s.peak_pages, graph_steps=s.graph_steps, graph_captures=s.graph_captures,
               graph_s=s.graph_seconds, eager_s=s.eager_seconds)
    batcher.results = results
    del cache
    return row, batcher


def check(model, args) -> bool:
    ok = True
    vocab = model.config.vocab_size
    lo, hi = (5, 40) if args.tiny else (100, 2000)
    reqs = prompts(6, lo, hi, vocab, seed=1)
    arrivals = [0, 0, 1, 3, 5, 8]
    for fmt in args.formats:
        pages = sum(-(-(len(p) + args.check_tokens) // args.page_size) for p in reqs)
        row, batcher = run_batcher(model, fmt, reqs, args.check_tokens, args, num_pages=pages, arrivals=arrivals)
        t0 = time.perf_counter()
        alone = [generate_alone(model, p, args.check_tokens, fmt) for p in reqs]
        want = [tokens for tokens, _ in alone]
        generate_s = time.perf_counter() - t0
        got = [batcher.results[str(i)] for i in range(len(reqs))]
        equal = sum(a == b for a, b in zip(got, want))
        ok &= equal == len(reqs)
        # where each request first differs, and how close `generate`'s own logits were to a tie there: with bf16
        # random weights near-tied logits flip between kernels that round differently, hence fp32 by default
        first, margins = first_differences(got, want, [steps for _, steps in alone])
        emit(args.out, dict(bench="check", format=fmt, dtype=str(model.dtype), equal=f"{equal}/{len(reqs)}",
                            first_difference=first, margin_at_difference=margins, new_tokens=args.check_tokens,
                            prompt_lens=[len(p) for p in reqs],
                            arrivals=arrivals, peak_running=row["peak_running"], batcher_s=row["wall_s"],
                            batcher_steps=row["steps"], graph_steps=row["graph_steps"], generate_alone_s=generate_s))
    return ok


def pressure(model, args) -> None:
    n, lin, lout = args.pressure_requests, args.pressure_input, args.pressure_output
    reqs = prompts(n, lin, lin, model.config.vocab_size, seed=2)
    layers = PagedQuantMLACache(model.config, qconfig("C4R4"), num_pages=1, dtype=model.dtype).num_layers
    c4 = PagedQuantMLACache(model.config, qconfig("C4R4"), num_pages=1, max_requests=1, dtype=model.dtype)
    pages_each = -(-(lin + lout) // args.page_size)
    need = n * pages_each * page_bytes(c4.format, layers, args.page_size, model.dtype)
    need += (n + 1) * protected_bytes_per_request(c4.format, layers, model.dtype)  # and the cache's scratch row
    del c4
    pressured = int(args.budget_gib * 2**30) if args.budget_gib else int(need * 1.02)
    c16 = PagedQuantMLACache(model.config, qconfig("C16R16"), num_pages=1, max_requests=1, dtype=model.dtype)
    relaxed = int(max(need, n * pages_each * page_bytes(c16.format, layers, args.page_size, model.dtype)) * 1.02)
    del c16
    budgets = {"pressure": pressured, "no-pressure": relaxed}
    for label in args.budgets:
        budget = budgets[label]
        for fmt in args.formats:
            warm_up(model, fmt, args)
        ratios = []
        for round_ in range(args.repeat):
            rows = {}
            # the order alternates between rounds, so a drift over the run does not favour one format
            for fmt in (args.formats if round_ % 2 == 0 else args.formats[::-1]):
                row, _ = run_batcher(model, fmt, reqs, lout, args, budget_bytes=budget)
                rows[fmt] = row
                emit(args.out, dict(bench=label, round=round_, budget_gib=budget / 2**30, input=lin, output=lout, **row))
            if "C4R4" in rows and "C16R16" in rows:
                ratios.append(rows["C4R4"]["out_tok_s"] / rows["C16R16"]["out_tok_s"])
                emit(args.out, dict(bench=label + "-ratio", round=round_, budget_gib=budget / 2**30,
                                    c4r4_over_c16r16=ratios[-1], preemptions_c4r4=rows["C4R4"]["preemptions"],
                                    preemptions_c16r16=rows["C16R16"]["preemptions"]))
        if len(ratios) >= 2:
            ci = t_interval(torch.tensor(ratios))
            emit(args.out, dict(bench=label + "-ratio-mean", rounds=len(ratios), c4r4_over_c16r16=ci.value,
                                interval_95=[ci.low, ci.high]))


def profile(model, args) -> None:
    """Where a decode step's time goes, per format: `--pressure-requests` requests of `--pressure-input` tokens
    prefilled in a cache that holds them, then the wall time of each step (medians of the replayed and of the eager
    steps over `--pressure-output` new tokens) and a `torch.profiler` table of 3 eager decode steps (kernels by
    device time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n, lin, lout = args.pressure_requests, args.pressure_input, args.pressure_output
    reqs = prompts(n, lin, lin, model.config.vocab_size, seed=2)
    pages = n * -(-(lin + lout) // args.page_size) + 8
    for fmt in args.formats:
        warm_up(model, fmt, args)
        _, batcher = run_batcher(model, fmt, reqs, lout, args, num_pages=pages, step_medians=True)
        s = batcher.stats
        emit(args.out, dict(bench="profile-steps", format=fmt, requests=n, input=lin, output=lout,
                            graph_steps=s.graph_steps, graph_s=s.graph_seconds, eager_steps=s.steps - s.graph_steps,
                            eager_s=s.eager_seconds, step_ms_median=batcher.step_ms_median))
        cache = PagedQuantMLACache(model.config, qconfig(fmt), page_size=args.page_size, max_requests=n,
                                   num_pages=pages, dtype=model.dtype, device=DEVICE)
        eager = ContinuousBatcher(model, cache, args.max_batch_tokens, decode_graphs=False)
        for i, p in enumerate(reqs):
            eager.add_request(str(i), p, 8)
        with eager.paged_attention_mode():
            while any(not r.generated for r in list(eager.running) + list(eager.waiting)):
                eager.step()  # prefill
            eager.step()
            sync()
            t0 = time.perf_counter()
            for _ in range(3):
                eager.step()
            sync()
            wall = (time.perf_counter() - t0) / 3
            with torch_profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    eager.step()
                sync()
        emit(args.out, dict(bench="profile-eager-decode-step", format=fmt, wall_ms=wall * 1e3))
        print(prof.key_averages().table(sort_by="cuda_time_total" if DEVICE == "cuda" else "cpu_time_total",
                                        row_limit=22, max_name_column_width=70), flush=True)
        del cache, eager


def static_generate(model, reqs: list[list[int]], new_tokens: int, batch: int) -> float:
    """Wall time of plain `generate` (the model's C4R4 config: a static cache in buckets, decode steps replayed from
    CUDA graphs on a GPU) over static batches of `batch` requests (left-padded), one after another."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def scale(model, args) -> None:
    for n in args.scale:
        reqs = prompts(n, args.scale_min, args.scale_max, model.config.vocab_size, seed=3 + n)
        pages = sum(-(-(len(p) + args.scale_output) // args.page_size) for p in reqs)
        budget = int(args.budget_gib * 2**30) if args.budget_gib else None
        warm_up(model, "C4R4", args)
        row, _ = run_batcher(model, "C4R4", reqs, args.scale_output, args, budget_bytes=budget,
                             num_pages=None if budget else pages)
        emit(args.out, dict(bench="scale-cb", **row))
        static_generate(model, prompts(2, 100, 300, model.config.vocab_size, seed=98), 4, 2)  # untimed warm-up
        wall = static_generate(model, reqs, args.scale_output, args.static_batch)
        generated = n * args.scale_output
        emit(args.out, dict(bench="scale-static", format="C4R4", requests=n, static_batch=args.static_batch,
                            wall_s=wall, generated=generated, out_tok_s=generated / wall,
                            cb_over_static=row["out_tok_s"] / (generated / wall)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--heads", type=int, default=16, help="attention heads (16: V2-Lite, 128: V2/V3)")
    ap.add_argument("--tiny", action="store_true", help="4-head toy model and short requests (CPU smoke run)")
    ap.add_argument("--formats", default="C16R16,C4R4")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--eager", action="store_true", help="continuous batching without CUDA-graph decode steps")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--check-dtype", default="float32", choices=("float32", "model"),
                    help="run the check on an fp32 copy of the model (default) or in the model's dtype")
    ap.add_argument("--pressure", action="store_true")
    ap.add_argument("--pressure-requests", type=int, default=5)
    ap.add_argument("--pressure-input", type=int, default=32768)
    ap.add_argument("--pressure-output", type=int, default=1024)
    ap.add_argument("--budgets", default="pressure,no-pressure",
                    help="which --pressure budgets run: pressure (what C4R4 needs, +2%%), no-pressure (both fit)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of each --pressure budget (formats alternating in order); >= 2 adds the mean "
                         "C4R4 / C16R16 ratio with its 95%% Student-t interval")
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--scale", default="", help="concurrent request counts, e.g. 64,256")
    ap.add_argument("--profile", action="store_true",
                    help="step times and a profile of eager decode steps at the --pressure-* sizes (no pressure)")
    ap.add_argument("--scale-min", type=int, default=4096)
    ap.add_argument("--scale-max", type=int, default=32768)
    ap.add_argument("--scale-output", type=int, default=256)
    ap.add_argument("--static-batch", type=int, default=8)
    args = ap.parse_args()
    args.formats = args.formats.split(",")
    args.budgets = args.budgets.split(",")
    unknown = set(args.budgets) - {"pressure", "no-pressure"}
    if unknown or args.repeat < 1:
        ap.error(f"--budgets takes pressure and/or no-pressure (got {sorted(unknown)}); --repeat at least 1")
    args.scale = [int(x) for x in args.scale.split(",") if x]
    os.makedirs(args.out, exist_ok=True)
    model = v2_lite(args.layers, tiny=args.tiny, heads=args.heads)
    # No end token: every request yields exactly its output length (continuous batching stops on none either), and
    # generate does not have to suppress one (min_new_tokens would change its greedy choice).
    model.generation_config.eos_token_id = None
    apply_quantmla(model, qconfig("C4R4"))  # what plain `generate` uses; the paged caches carry their own format
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    import transformers

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    emit(args.out, dict(bench="setup", device=gpu, torch=torch.__version__, transformers=transformers.__version__,
                        layers=args.layers, heads=args.heads, tiny=args.tiny, argv=" ".join(sys.argv[1:])))
    ok = True
    if args.check:
        if args.check_dtype == "float32" and model.dtype != torch.float32:
            # the same weights (seeded), in fp32
            reference = v2_lite(args.layers, tiny=args.tiny, heads=args.heads).float()
            reference.generation_config.eos_token_id = None
            apply_quantmla(reference, qconfig("C4R4"))
            reference.set_attn_implementation(ATTN_IMPLEMENTATION)
            ok = check(reference, args)
            del reference
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        else:
            ok = check(model, args)
    if args.pressure:
        pressure(model, args)
    if args.scale:
        scale(model, args)
    if args.profile:
        profile(model, args)
    if args.check:
        print("check:", "outputs equal per-request generate" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
