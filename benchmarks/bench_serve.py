"""Serving benchmark: continuous batching on the paged QuantMLA cache (C4R4 vs C16R16, the BF16-latent baseline
through the same pages): serving metrics under an open-loop load, whole jobs under cache pressure, and against
`generate` with static batches.

    python benchmarks/bench_serve.py --out DIR [--layers 27] [--heads 16] [--tiny] [--check]
        [--serve] [--requests 100] [--rates 1,2,4,8] [--goodput-bisect 0] [--slo-ttft-s 2] [--slo-tpot-ms 50]
        [--prompt-median 4096] [--prompt-sigma 1.0] [--prompt-min 1024] [--prompt-max 32768] [--output-min 64]
        [--output-max 1024] [--max-requests 64] [--seed 0]
        [--pressure] [--pressure-requests 5] [--pressure-input 32768] [--pressure-output 1024] [--budget-gib G]
        [--budgets pressure,no-pressure] [--repeat 1]
        [--scale 64,256] [--scale-min 4096] [--scale-max 32768] [--scale-output 256] [--static-batch 8]
        [--profile] [--formats C16R16,C4R4] [--page-size 64] [--max-batch-tokens 8192] [--eager]

Model: the DeepSeek-V2-Lite attention shape (`bench_generate.v2_lite`: 16 heads, d_c 512, d_R 64, dense MLPs,
random bf16 weights, `--layers` layers; `--heads 128` for V2/V3's head count); `--tiny` swaps in a 4-head toy for
a CPU smoke run (and toy sizes for `--serve`'s workload). Prompts are random token ids; generation is greedy with no
end token, so every request yields exactly its output length.

- `--serve`: serving metrics as vLLM's `benchmark_serving` and SGLang's `bench_serving` define them
  (`serving_metrics.py`). A workload of `--requests` requests, prompt lengths lognormal (median `--prompt-median`,
  log sigma `--prompt-sigma`) rounded and clipped to `[--prompt-min, --prompt-max]`, output lengths uniform in
  `[--output-min, --output-max]`, arriving as a Poisson process (the first at 0) at each of `--rates` requests/s
  (`inf`: all at once); all of it seeded by `--seed`, and every rate replays the same arrival pattern stretched.
  Per format one cache of `--budget-gib` GiB (default 2) with `--max-requests` request rows, and its batcher,
  warmed once before any load (`ready_s`, the time to ready); then per rate an open-loop load: requests join the
  batcher between its steps once their arrival time has passed, each token stamped with the host time its step
  returned. Per format and rate: TTFT, TPOT and ITL (mean, p50, p99), E2E latency, request and output-token
  throughput, preemptions, peak running requests, SLO attainment; per format the goodput: the highest rate whose
  p99 TTFT <= `--slo-ttft-s` and p99 TPOT <= `--slo-tpot-ms`, every lower rate meeting them too, searched over
  `--rates` and then `--goodput-bisect` bisection steps between the goodput and the lowest failing rate. A table
  ends the run.
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

Every timed batcher is warmed first (`ContinuousBatcher.warmup` in `warm_batcher`: its kernels run once and the
decode graph of every bucket the load can reach is captured; `ready_s`, `warm_steps`, `warm_captures` in its rows),
so no timed request waits for a compilation or a capture; static `generate` runs two small requests untimed first. Continuous batching replays its
decode-only steps from CUDA graphs (`quantmla_hf.serving.graphs`; `graph_steps` and `graph_captures`, the captures
while timed, in each row, and the wall time of the replayed and of the eager steps, `graph_s` and `eager_s`: the
eager ones are the prefill chunks) unless `--eager`. Rows are printed as JSON lines as they finish and all of them
written to `DIR/bench_serve.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import DEVICE, v2_lite  # noqa: E402

from quantmla_hf import QuantMLACache, QuantMLAConfig, apply_quantmla  # noqa: E402
from quantmla_hf.attention.state import ATTN_IMPLEMENTATION  # noqa: E402
from quantmla_hf.evaluation.intervals import t_interval  # noqa: E402
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.cache.allocator import page_bytes, protected_bytes_per_request  # noqa: E402
from quantmla_hf.cache.growing import CACHE_KWARG  # noqa: E402
from quantmla_hf.serving.batching import BatchingStats, ContinuousBatcher  # noqa: E402
from serving_metrics import SLO, RequestTimes, bisection_rate, goodput, summarize  # noqa: E402

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


def warm_batcher(batcher: ContinuousBatcher, max_tokens: int) -> dict:
    """Make `batcher` ready before a timed load, as a server is before its first request:
    `ContinuousBatcher.warmup` runs every kernel and captures the decode graph of every batch bucket up to the
    cache's `max_requests` and every page-table width up to `max_tokens` tokens, so that no timed request waits for a
    compilation or a capture. Returns `ready_s` (the time to ready, the device's work included), `warm_steps` (the
    warm-up's steps) and `warm_captures` (graphs captured)."""
    sync()
    t0 = time.perf_counter()
    report = batcher.warmup(max_context=max_tokens)
    sync()
    return dict(ready_s=time.perf_counter() - t0, warm_steps=report.steps, warm_captures=report.graphs)


def captured_while_timed(batcher: ContinuousBatcher, before: int) -> int:
    """Decode graphs the batcher captured since it had captured `before` (0 after a complete warm-up)."""
    return (batcher.graphs.captures if batcher.graphs is not None else 0) - before


def run_batcher(model, fmt: str, reqs: list[list[int]], new_tokens: int, args, budget_bytes=None, num_pages=None,
                arrivals=None, step_medians=False, warm=True) -> tuple[dict, ContinuousBatcher]:
    """One continuous-batching run, after `warm_batcher` (unless not `warm`) for the lengths of `reqs`: its row, and
    the batcher (its results; with `step_medians`, `step_ms_median`: the median wall time of the replayed and of the
    eager steps, where the stats keep only their sums)."""
    cache = PagedQuantMLACache(model.config, qconfig(fmt), page_size=args.page_size, max_requests=len(reqs),
                               budget_bytes=budget_bytes, num_pages=num_pages, dtype=model.dtype, device=DEVICE)
    batcher = ContinuousBatcher(model, cache, args.max_batch_tokens, decode_graphs=False if args.eager else "auto")
    ready = {}
    if warm:
        ready = warm_batcher(batcher, max(len(p) for p in reqs) + new_tokens + 1)
    captures = captured_while_timed(batcher, 0)
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
               peak_pages=s.peak_pages, graph_steps=s.graph_steps,
               graph_captures=captured_while_timed(batcher, captures), graph_s=s.graph_seconds, eager_s=s.eager_seconds,
               **ready)
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
        row, batcher = run_batcher(model, fmt, reqs, args.check_tokens, args, num_pages=pages, arrivals=arrivals,
                                  warm=False)
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
        row, _ = run_batcher(model, "C4R4", reqs, args.scale_output, args, budget_bytes=budget,
                             num_pages=None if budget else pages)
        emit(args.out, dict(bench="scale-cb", **row))
        static_generate(model, prompts(2, 100, 300, model.config.vocab_size, seed=98), 4, 2)  # untimed warm-up
        wall = static_generate(model, reqs, args.scale_output, args.static_batch)
        generated = n * args.scale_output
        emit(args.out, dict(bench="scale-static", format="C4R4", requests=n, static_batch=args.static_batch,
                            wall_s=wall, generated=generated, out_tok_s=generated / wall,
                            cb_over_static=row["out_tok_s"] / (generated / wall)))


# ---- serving metrics under an open-loop load -----------------------------------------------------------------------
def sample_workload(n: int, seed: int, median: float, sigma: float, lo: int, hi: int, out_lo: int,
                    out_hi: int) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of `n` requests: prompts lognormal (median `median` tokens, `sigma` the standard
    deviation of the log), rounded and clipped to `[lo, hi]`; outputs uniform integers in `[out_lo, out_hi]`;
    drawn from `random.Random(seed)`."""
    rng = random.Random(seed)
    prompt_lens = [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]
    return prompt_lens, [rng.randint(out_lo, out_hi) for _ in range(n)]


def unit_arrivals(n: int, seed: int) -> list[float]:
    """Arrival times (s) of `n` requests of a Poisson process of rate 1 whose first arrival is at 0; divided by a
    rate `r` they are a Poisson process of rate `r` (every rate replays the same pattern, stretched in time)."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(1.0))
    return times


def serve_load(batcher: ContinuousBatcher, reqs: list[list[int]], outs: list[int], arrivals: list[float],
               tag: str) -> tuple[list[RequestTimes], float]:
    """Serve `reqs` (`outs[i]` new tokens each) arriving at `arrivals[i]` seconds (ascending) of wall time, as a
    server sees an open-loop load: between steps every request whose arrival time has passed joins the batcher
    (queued behind the running ones when nothing is free), and each token is stamped with the host time the step
    that produced it returned (a step ends reading its tokens back). Returns each request's times (its arrival the
    scheduled one, so time spent waiting for the running step counts in its TTFT) and the duration: from the first
    arrival to the last token."""
    times: dict[str, list[float]] = {f"{tag}/{i}": [] for i in range(len(reqs))}
    nxt = 0
    sync()
    start = time.perf_counter()
    with batcher.paged_attention_mode():
        while nxt < len(reqs) or batcher.has_work():
            now = time.perf_counter() - start
            while nxt < len(reqs) and arrivals[nxt] <= now:
                batcher.add_request(f"{tag}/{nxt}", reqs[nxt], outs[nxt])
                nxt += 1
            if not batcher.has_work():
                time.sleep(max(0.0, arrivals[nxt] - now))  # idle until the next arrival
                continue
            produced = batcher.step()
            now = time.perf_counter() - start
            for rid, _ in produced:
                times[rid].append(now)
    traces = [RequestTimes(arrivals[i], tuple(times[f"{tag}/{i}"]), len(reqs[i])) for i in range(len(reqs))]
    return traces, max(t.token_times[-1] for t in traces if t.token_times)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_value(rate: float | None) -> float | str | None:
    """A rate as a JSON value: the number, or "inf" (all requests at once)."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def serving(model, args) -> None:
    """Per format: one cache of the `--budget-gib` budget and its batcher, warmed (`ready_s`), then the workload
    at each `--rates` rate and `--goodput-bisect` bisection rates; rows per rate, per format and a table."""
    lens, outs = sample_workload(args.requests, args.seed, args.prompt_median, args.prompt_sigma, args.prompt_min,
                                 args.prompt_max, args.output_min, args.output_max)
    g = torch.Generator().manual_seed(args.seed)
    reqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    unit = unit_arrivals(args.requests, args.seed + 1)
    slo = SLO(args.slo_ttft_s, args.slo_tpot_ms)
    budget = int(args.serve_budget_gib * 2**30)
    emit(args.out, dict(bench="serve-workload", requests=args.requests, seed=args.seed,
                        prompt=dict(distribution="lognormal", median=args.prompt_median, sigma=args.prompt_sigma,
                                    clip=[args.prompt_min, args.prompt_max]),
                        output=dict(distribution="uniform", range=[args.output_min, args.output_max]),
                        arrivals="Poisson, first at 0", budget_gib=args.serve_budget_gib,
                        max_requests=args.max_requests,
                        slo_ttft_s=slo.ttft_s, slo_tpot_ms=slo.tpot_ms, prompt_tokens_mean=statistics.mean(lens),
                        output_tokens_mean=statistics.mean(outs), prompt_lens=lens, output_lens=outs,
                        unit_arrivals=[round(t, 6) for t in unit]))
    rows, goodputs = [], {}
    for fmt in args.formats:
        try:
            cache = PagedQuantMLACache(model.config, qconfig(fmt), page_size=args.page_size,
                                       max_requests=args.max_requests, budget_bytes=budget, dtype=model.dtype,
                                       device=DEVICE)
        except ValueError as err:
            raise SystemExit(f"{fmt}: {err} (--budget-gib, --max-requests, --page-size)") from None
        largest = max(n + o for n, o in zip(lens, outs))
        if cache.pages_needed(None, largest + 1) + 1 > cache.num_pages:
            raise SystemExit(f"{fmt}: the largest request ({largest} tokens) does not fit {args.serve_budget_gib} GiB "
                             f"({cache.capacity_tokens()} tokens); raise --budget-gib or lower --prompt-max")
        batcher = ContinuousBatcher(model, cache, args.max_batch_tokens, decode_graphs=False if args.eager else "auto")
        ready = warm_batcher(batcher, largest + 1)
        emit(args.out, dict(bench="serve-ready", format=fmt, cache_tokens=cache.capacity_tokens(),
                            cache_gib=cache.nbytes() / 2**30, **ready))
        met: dict[float, bool] = {}

        def run_at(rate: float) -> None:
            captures = captured_while_timed(batcher, 0)
            batcher.stats = BatchingStats()
            traces, duration = serve_load(batcher, reqs, outs, [0.0 if math.isinf(rate) else t / rate for t in unit],
                                          f"{fmt}#{len(met)}")
            s = batcher.stats
            row = dict(bench="serve", format=fmt, rate=rate_value(rate), **summarize(traces, duration, slo),
                       preemptions=s.preemptions, peak_running=s.peak_running, peak_pages=s.peak_pages,
                       steps=s.steps, graph_steps=s.graph_steps,
                       graph_captures=captured_while_timed(batcher, captures), graph_s=s.graph_seconds,
                       eager_s=s.eager_seconds)
            met[rate] = row["slo_met"]
            rows.append(row)
            emit(args.out, row)

        for rate in args.rates:
            run_at(rate)
        for _ in range(args.goodput_bisect):
            rate = bisection_rate(met)
            if rate is None:
                break
            run_at(rate)
        if batcher.graphs is not None:
            batcher.graphs.release()
        best, failing = goodput(met)
        goodputs[fmt] = best
        emit(args.out, dict(bench="serve-goodput", format=fmt, goodput_rps=rate_value(best),
                            lowest_failing_rps=rate_value(failing), measured=[rate_value(r) for r in sorted(met)],
                            slo_ttft_s=slo.ttft_s,
                            slo_tpot_ms=slo.tpot_ms, ready_s=ready["ready_s"]))
        del batcher, cache
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    ratio = None
    if goodputs.get("C4R4") and goodputs.get("C16R16") and not math.isinf(goodputs["C4R4"] + goodputs["C16R16"]):
        ratio = goodputs["C4R4"] / goodputs["C16R16"]
        emit(args.out, dict(bench="serve-goodput-ratio", c4r4_over_c16r16=ratio))
    print_serving_table(rows, goodputs, ratio, slo, args)


def print_serving_table(rows: list[dict], goodputs: dict, ratio: float | None, slo: SLO, args) -> None:
    def ms(x):
        return "-" if x is None else f"{x:.1f}"

    def sec(x):
        return "-" if x is None else f"{x / 1e3:.2f}"

    print(f"\nserving: {args.requests} requests, prompts lognormal (median {args.prompt_median:g}, sigma "
          f"{args.prompt_sigma:g}) in [{args.prompt_min}, {args.prompt_max}], outputs uniform in [{args.output_min}, "
          f"{args.output_max}], Poisson arrivals; KV budget {args.serve_budget_gib:g} GiB, at most {args.max_requests} "
          "requests running")
    print(f"{'format':8} {'rate/s':>6} {'TTFT p50':>9} {'p99 (s)':>8} {'TPOT p50':>9} {'p99 (ms)':>9} "
          f"{'ITL p50':>8} {'p99 (ms)':>9} {'req/s':>6} {'tok/s':>8} {'preempt':>7} {'peak':>4} SLO")
    for r in sorted(rows, key=lambda r: (r["format"], float(r["rate"]))):
        print(f"{r['format']:8} {rate_label(float(r['rate'])):>6} {sec(r['ttft_ms_p50']):>9} "
              f"{sec(r['ttft_ms_p99']):>8} "
              f"{ms(r['tpot_ms_p50']):>9} {ms(r['tpot_ms_p99']):>9} {ms(r['itl_ms_p50']):>8} {ms(r['itl_ms_p99']):>9} "
              f"{r['request_throughput']:>6.2f} {r['output_throughput']:>8.0f} {r['preemptions']:>7} "
              f"{r['peak_running']:>4} {'yes' if r['slo_met'] else 'no'}")
    print(f"goodput (highest rate whose p99 TTFT <= {slo.ttft_s:g} s and p99 TPOT <= {slo.tpot_ms:g} ms, every lower "
          f"rate too; over --rates, then {args.goodput_bisect} bisection steps):")
    for fmt, best in goodputs.items():
        print(f"  {fmt}: " + (f"{rate_label(best)} req/s" if best is not None else "below the lowest rate measured"))
    if ratio is not None:
        print(f"  C4R4 / C16R16: {ratio:.2f}x")
    elif goodputs.get("C4R4") and goodputs.get("C16R16", 0) is None:
        print("  C4R4 / C16R16: unbounded here (C16R16 met no measured rate): add lower --rates")


# --serve's workload: (default, default with --tiny)
SERVE_DEFAULTS = dict(requests=(100, 6), rates=("1,2,4,8", "4,inf"), prompt_median=(4096, 48), prompt_sigma=(1.0, 0.5),
                      prompt_min=(1024, 16), prompt_max=(32768, 128), output_min=(64, 4), output_max=(1024, 12),
                      max_requests=(64, 8))
SERVE_BUDGET_GIB = (2.0, 0.002)  # --serve's KV budget without --budget-gib: real, --tiny


def main(argv: list[str] | None = None) -> int:
    ROWS.clear()
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
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="KV cache budget: --pressure (default: what C4R4 needs, +2%%), --scale (default: what the "
                         "requests need), --serve (default 2; --tiny 0.002)")
    ap.add_argument("--scale", default="", help="concurrent request counts, e.g. 64,256")
    ap.add_argument("--profile", action="store_true",
                    help="step times and a profile of eager decode steps at the --pressure-* sizes (no pressure)")
    ap.add_argument("--scale-min", type=int, default=4096)
    ap.add_argument("--scale-max", type=int, default=32768)
    ap.add_argument("--scale-output", type=int, default=256)
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--serve", action="store_true",
                    help="serving metrics (TTFT, TPOT, ITL, throughput, goodput) under Poisson arrivals per rate")
    ap.add_argument("--requests", type=int, default=None, help="requests of the --serve load (100; --tiny 6)")
    ap.add_argument("--rates", default=None, help="request rates (requests/s; inf: all at once), e.g. 1,2,4,8")
    ap.add_argument("--goodput-bisect", type=int, default=0,
                    help="after --rates, this many more rates at the midpoint of the goodput and the lowest "
                         "failing rate")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput's p99 TTFT objective (seconds)")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput's p99 TPOT objective (milliseconds)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the --serve lengths, token ids and arrivals")
    ap.add_argument("--prompt-median", type=float, default=None, help="lognormal prompt lengths' median (4096)")
    ap.add_argument("--prompt-sigma", type=float, default=None, help="lognormal prompt lengths' log sigma (1.0)")
    ap.add_argument("--prompt-min", type=int, default=None, help="prompt lengths clipped to at least (1024)")
    ap.add_argument("--prompt-max", type=int, default=None, help="prompt lengths clipped to at most (32768)")
    ap.add_argument("--output-min", type=int, default=None, help="output lengths uniform from (64)")
    ap.add_argument("--output-max", type=int, default=None, help="output lengths uniform to (1024)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="requests running at once in --serve (cache rows; 64, --tiny 8)")
    args = ap.parse_args(argv)
    for name, (real, tiny) in SERVE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else real)
    args.rates = list(dict.fromkeys(float(x) for x in args.rates.split(",") if x))  # each rate once
    args.serve_budget_gib = args.budget_gib or SERVE_BUDGET_GIB[args.tiny]
    if args.serve and not (args.rates and min(args.rates) > 0 and args.requests >= 1
                           and 1 <= args.prompt_min <= args.prompt_max and 1 <= args.output_min <= args.output_max):
        ap.error(f"--serve needs rates > 0 (got {args.rates}), --requests >= 1 (got {args.requests}) and "
                 f"1 <= min <= max for --prompt-min/max ({args.prompt_min}, {args.prompt_max}) and --output-min/max "
                 f"({args.output_min}, {args.output_max})")
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
                        layers=args.layers, heads=args.heads, tiny=args.tiny, argv=" ".join(sys.argv[1:] if argv is None else argv)))
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
    if args.serve:
        serving(model, args)
    if args.check:
        print("check:", "outputs equal per-request generate" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
