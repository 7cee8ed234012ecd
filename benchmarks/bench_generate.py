"""Decode throughput and peak memory of a DeepSeek-V2-Lite-shaped model (real attention widths, a few dense
layers, random bf16 weights): stock DynamicCache, transformers' QuantizedCache (quanto int4, when optimum-quanto is
installed) and QuantMLACache (C16R16, C4R4, C2R4, native "quantmla" decode), eager or, for the `-static` and
`-compiled`/`-graphed` methods, on a `StaticQuantMLACache`: `-static` runs its decode step eagerly,
`-compiled` through `torch.compile(model, mode="reduce-overhead", fullgraph=True)` (inductor: fused kernels, one
CUDA graph per step), `-graphed` through `torch.compile(model, backend="cudagraphs", fullgraph=True)` (the eager
kernels recorded into one CUDA graph per step: no code generation, eager numerics). Compile time is reported
separately, not in the step time.

    python benchmarks/bench_generate.py --out DIR [--layers 27] [--heads 16] [--steps 16] [--budget-gib 64]
        [--methods dynamic-bf16,C4R4,C4R4-compiled,C4R4-graphed] [--grid 1x4096,8x32768]
        [--skip dynamic-bf16@32x32768] [--profile] [--check-tokens 64] [--check-variants eager,static,graphed]
    python benchmarks/bench_generate.py --out DIR --layers 27 [--heads 128] --baseline-path OLD_TREE [--format C4R4]
        [--grid 8x32768,32x32768] [--rounds 3] [--new-tokens 32]

`--default-points 1x4096,8x32768,32x32768` runs only `check_default_generate`: plain `model.generate()` (no flags:
decode steps replayed from CUDA graphs) beside the eager static path and, with `--default-inductor`, inductor, in one
process: ms per token, step times, replay time, first-call seconds, identical greedy/sampled tokens, captures and
graph memory (written to `bench_generate_default.json`).

`--baseline-path DIR` runs only `before_after_generate`: plain `model.generate()` with this tree's decode and with
the decode of the tree extracted in DIR, in turns in one process, at the `--grid` points (`--format`, `--rounds`,
`--new-tokens`; written to `bench_generate_before_after.json`).

`--profile` records 5 steps of every static-cache method (`-static`, `-compiled`, `-graphed`) with torch.profiler
and prints the GPU time per step of each kernel family (an eager `-static` step runs the kernels a captured graph
replays). `--check-tokens N` runs `model.generate` greedy for N tokens at batch 1,
4K context (C4R4) through each of `--check-variants` (`check_generate`), reports which agree token for token, and
times generate's ms per new token as `(t(N + 2 tokens) - t(2 tokens)) / N`. Rows are printed as JSON lines as they
finish and written to `bench_generate.json` after each one.

Largest batch under a memory budget: for each method and context, the decode peak memory of two batch sizes gives
the memory per sequence (slope) and the fixed part (intercept); the largest batch is
`floor((budget - intercept) / slope)`, derived from those two measurements (not searched by trial).

The MLP of every layer is dense (first_k_dense_replace = layers): the MoE experts of V2-Lite would only add the same
time to every method. Decode tokens/s = batch * steps / wall time of `steps` greedy one-token forwards after the
prefill (after two untimed steps); peak memory is `torch.cuda.max_memory_allocated` over the chunked prefill (8192
tokens a chunk), decode peak over the timed decode steps alone (resident cache + one step's activations).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LogitsProcessorList

from quantmla_hf import QuantMLACache, QuantMLAConfig, StaticQuantMLACache, install_cache_hooks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = {"C16R16": (16, 16), "C8R8": (8, 8), "C4R8": (4, 8), "C4R4": (4, 4), "C2R4": (2, 4)}  # (content, RoPE) bits


def v2_lite(layers, tiny=False, heads=16, model_type="deepseek_v2"):
    """DeepSeek-V2-Lite's attention shape (`heads` heads: 16 as V2-Lite, 128 as V2/V3) with dense MLPs and random
    weights, `layers` layers, as `model_type` (`deepseek_v2`, or `deepseek_v3`: what plain `generate()`'s
    benchmarks run); `tiny`: a 4-head fp32 toy for CPU runs."""
    dims = dict(hidden_size=2048, intermediate_size=10944, num_attention_heads=heads, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400)
    if tiny:
        dims = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, kv_lora_rank=64,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=128)
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=layers, num_key_value_heads=dims["num_attention_heads"],
                               q_lora_rank=None, first_k_dense_replace=layers, max_position_embeddings=163840, **dims)
    torch.manual_seed(0)
    dtype = torch.float32 if tiny else torch.bfloat16
    with torch.device(DEVICE):  # random init on the GPU: seconds instead of a minute on the host
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def cache_kwarg(model):
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


_COMPILED = {}


def compiled_call(model, backend="inductor"):
    """`torch.compile` of the model's call (hooks included, as generate compiles it), built once per model and
    backend: "inductor" with `mode="reduce-overhead"` (fused kernels, CUDA graph), or "cudagraphs" (the eager
    kernels recorded into a CUDA graph: no code generation, the eager numerics)."""
    key = (id(model), backend)
    if key not in _COMPILED:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64
        # one static graph per benchmark shape (no dynamic-shape graph after the second shape)
        torch._dynamo.config.automatic_dynamic_shapes = False
        mode = "reduce-overhead" if backend == "inductor" else None
        _COMPILED[key] = torch.compile(model.__call__, backend=backend, mode=mode, fullgraph=True)
    return _COMPILED[key]


def is_static(method: str) -> bool:
    return method.endswith(("-static", "-compiled", "-graphed"))


def is_captured(method: str) -> bool:
    """Methods whose decode step runs through torch.compile: `-compiled` (inductor) and `-graphed` (cudagraphs)."""
    return method.endswith(("-compiled", "-graphed"))


def make_cache(model, method, recent, max_len):
    base = method.split("-")[0]
    bits = FORMATS[base]
    q = QuantMLAConfig(content_bits=bits[0], rope_bits=bits[1], recent_tokens=recent, transform="none",
                       advanced={"cache_block_size": 1024})
    if is_static(method):
        return StaticQuantMLACache(config=model.config, quantization_config=q, max_cache_len=max_len)
    return QuantMLACache(config=model.config, quantization_config=q)


@torch.no_grad()
def run_one(model, method, B, N, steps, recent):
    kw = cache_kwarg(model)
    static = is_static(method)
    max_len = -(-(N + steps + 8) // 256) * 256
    if method == "dynamic-bf16":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    elif method == "quanto-int4":
        from transformers import QuantizedCache

        model.set_attn_implementation("sdpa")
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64, residual_length=128)
    else:
        model.set_attn_implementation("quantmla")
        cache = make_cache(model, method, recent, max_len)
    ids = torch.randint(0, model.config.vocab_size, (B, N), device=DEVICE)
    mask = torch.ones_like(ids)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    chunk = 8192  # chunked prefill keeps the prompt's activations small at long contexts
    for s in range(0, N, chunk):
        out = model(ids[:, s : s + chunk], attention_mask=mask[:, : s + chunk], **{kw: cache}, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    if static:
        # Static shapes for the decode step: a 2D mask of max_len positions updated in place, explicit positions.
        full = torch.zeros((B, max_len), dtype=mask.dtype, device=DEVICE)
        full[:, :N] = 1
        pos = torch.full((B, 1), N, dtype=torch.long, device=DEVICE)
    forward = model
    if is_captured(method):
        forward = compiled_call(model, "inductor" if method.endswith("-compiled") else "cudagraphs")
    compile_s = 0.0

    def step(tok, mask, n):
        if static:
            full[:, n] = 1
            pos.fill_(n)
            out = forward(tok, attention_mask=full, position_ids=pos, **{kw: cache}, logits_to_keep=1)
            return out.logits[:, -1:].argmax(-1), mask
        # The 2D mask covers every cached position plus the new token (a mask one short hides the new token from
        # itself and sends the native path to its exact fallback, which reconstructs the whole history).
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        out = model(tok, attention_mask=mask, **{kw: cache}, logits_to_keep=1)
        return out.logits[:, -1:].argmax(-1), mask

    n = N
    # Untimed steps: JIT compilation, library start-up, CUDA-graph warm-up and recording stay out of the numbers.
    warm = 3 if is_captured(method) else 2
    for i in range(warm):
        t0 = time.perf_counter()
        tok, mask = step(tok, mask, n)
        n += 1
        if i == 0 and is_captured(method):
            torch.cuda.synchronize() if DEVICE == "cuda" else None
            compile_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # decode peak: resident cache + one step's activations
    t = time.perf_counter()
    for _ in range(steps):
        tok, mask = step(tok, mask, n)
        n += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    decode_peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    if isinstance(cache, QuantMLACache):
        cache_gib = cache.nbytes() / 2**30
    elif method == "dynamic-bf16":
        cache_gib = sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values)) / 2**30
    else:
        cache_gib = float("nan")  # quanto's packed tensors: not counted here (see peak memory)
    # `step` closes over `cache`: the caller drops `state` (and with it the cache) when it is done with the row.
    state = dict(step=step, tok=tok, mask=mask, n=n, cache=cache)
    row = dict(method=method, B=B, N=N, tok_s=B * steps / dt, ms_per_step=1000 * dt / steps, peak_GiB=peak,
               decode_peak_GiB=decode_peak, cache_GiB=cache_gib)
    if is_captured(method):
        row["compile_s"] = compile_s
    return row, state


def kernel_family(name: str) -> str:
    """The profile table's row for a kernel name (the split combine first: `combine_kernel`)."""
    n = name.lower()
    if "combine" in n:
        return "attention: split combine"
    if n.startswith("mla_decode"):  # the portable Triton, Gluon and paged decode kernels
        return "attention: decode kernel"
    if "quant_pack" in n:
        return "cache write: quantize + pack"
    if "gemm" in n or "gemv" in n or "matmul" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "splitk" in n:
        return "GEMM/GEMV (projections, MLP, lm_head)"
    if "triton" in n:
        return "inductor fused elementwise/reductions"
    if "index" in n or "scatter" in n or "gather" in n or "copy" in n:
        return "index/copy (cache bookkeeping)"
    return "other: " + name[:60]


@torch.no_grad()
def host_profile(state, n_steps=3, top=25):
    """Python time of `n_steps` decode steps under cProfile: the `top` functions by cumulative time (where the
    host overhead of an eager step goes)."""
    import cProfile
    import io
    import pstats

    step, tok, mask, n = state["step"], state["tok"], state["mask"], state["n"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_steps):
        tok, mask = step(tok, mask, n)
        n += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def gpu_ms_by_kernel(prof, n_steps):
    """GPU ms per step of a torch.profiler run over `n_steps` steps: `({family: ms}, {kernel name: ms})`."""
    fam, kernels = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            fam[kernel_family(e.name)] = fam.get(kernel_family(e.name), 0.0) + us / 1000 / n_steps
            kernels[e.name] = kernels.get(e.name, 0.0) + us / 1000 / n_steps
    return fam, kernels


def top_ops(prof, n_steps, k=15):
    """The `k` entries of a torch.profiler run with the most GPU time of their own, per step: `{name: [ms, calls]}`.
    Operators (`aten::copy_`: the GPU time of the kernels they launched) and those kernels are both entries, so a
    kernel's time shows under its operator and under its own name: the operators say where the kernel families'
    "other" rows and bookkeeping come from."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append((e.key, us / 1000 / n_steps, e.count / n_steps))
    return {name: [round(ms, 4), calls] for name, ms, calls in sorted(rows, key=lambda r: -r[1])[:k]}


def replay_ms(graph, n=20):
    """Mean ms of `n` back-to-back replays of a captured CUDA graph."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / n


@torch.no_grad()
def profile_steps(state, n_steps=5):
    """`step_profile` of `n_steps` decode steps of a `run_one` state."""
    step = state["step"]
    carry = dict(tok=state["tok"], mask=state["mask"], n=state["n"])

    def run():
        for _ in range(n_steps):
            carry["tok"], carry["mask"] = step(carry["tok"], carry["mask"], carry["n"])
            carry["n"] += 1

    return step_profile(run, n_steps)


CHECK_VARIANTS = ("eager", "static", "graphed", "compiled", "compiled-exact")


@torch.no_grad()
def check_generate(model, new_tokens, variants=CHECK_VARIANTS, N=4096):
    """Greedy `generate` at B1, N context, C4R4, through each variant:

    - "eager": the growing `QuantMLACache`, no compile (`disable_compile=True`);
    - "static": a `StaticQuantMLACache` stepped eagerly (`disable_compile=True`: the kernels and device-side
      lengths of the captured path, without capture);
    - "graphed": the static cache with generate's own compile path, `CompileConfig(backend="cudagraphs",
      mode="default", fullgraph=True)` (the eager kernels recorded into CUDA graphs);
    - "compiled": the same with `CompileConfig(fullgraph=True)` (inductor, `reduce-overhead`);
    - "compiled-exact": inductor with CUDA graphs (what `reduce-overhead` sets) and `emulate_precision_casts`
      (fused bf16 arithmetic rounds its intermediates as eager does).

    Returns each variant's tokens agreement with "eager" and with "static" (identical? first differing position)
    and ms per new token `(t(N + 2) - t(2)) / N` after a warm-up call (which compiles)."""
    from transformers.generation import CompileConfig

    kw = cache_kwarg(model)
    model.set_attn_implementation("quantmla")
    q = QuantMLAConfig(content_bits=4, rope_bits=4, transform="none")
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, N), generator=g).to(DEVICE)
    gen = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    max_len = N + new_tokens + 2
    extras = {
        "eager": dict(disable_compile=True),
        "static": dict(disable_compile=True),
        "graphed": dict(compile_config=CompileConfig(backend="cudagraphs", mode="default", fullgraph=True)),
        "compiled": dict(compile_config=CompileConfig(fullgraph=True)),
        "compiled-exact": dict(compile_config=CompileConfig(
            fullgraph=True, mode=None, options={"triton.cudagraphs": True, "emulate_precision_casts": True})),
    }

    def timed(n, variant):
        cache = (QuantMLACache(config=model.config, quantization_config=q) if variant == "eager" else
                 StaticQuantMLACache(config=model.config, quantization_config=q, max_cache_len=max_len))
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen, **extras[variant], **{kw: cache})
        torch.cuda.synchronize()
        return out[0, N:].tolist(), time.perf_counter() - t

    res = {}
    for v in variants:
        t0 = time.perf_counter()
        timed(new_tokens + 2, v)  # warm-up (and compile)
        warm_s = time.perf_counter() - t0
        toks, t_long = timed(new_tokens + 2, v)
        _, t_short = timed(2, v)
        res[v] = dict(tokens=toks, ms_per_token=1000 * (t_long - t_short) / new_tokens, first_call_s=warm_s)
        print(json.dumps({"check": v, "ms_per_token": res[v]["ms_per_token"], "first_call_s": warm_s}), flush=True)

    def agree(a, b):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        return dict(identical=a == b, same_positions=sum(x == y for x, y in zip(a, b)), total=len(a),
                    first_difference=first)

    out = dict(variants=res)
    for ref in ("eager", "static"):
        if ref in res:
            out["vs_" + ref] = {v: agree(res[ref]["tokens"], res[v]["tokens"]) for v in res if v != ref}
    return out


DEFAULT_POINTS = ((1, 4096), (8, 32768), (32, 32768))


class StepClock:
    """A logits processor that only notes the time of every step (generate synchronises once per step, so the
    intervals are the steps' times through generate)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def step_ms(self, skip=2):
        gaps = sorted(b - a for a, b in zip(self.times[skip:], self.times[skip + 1:]))
        return 1000 * gaps[len(gaps) // 2] if gaps else None


@torch.no_grad()
def check_default_generate(layers, new_tokens, points=DEFAULT_POINTS, eager_points=DEFAULT_POINTS[:2],
                           timed_points=DEFAULT_POINTS[:2], inductor=False, out_path=None, heads=16):
    """Plain `model.generate()` on a QuantMLA model (`heads` heads, C4R4, transform none, no flags: the default
    path, decode steps replayed from CUDA graphs) beside the eager static path (`disable_compile=True` on a
    `StaticQuantMLACache`: the same kernels stepped eagerly) and, with `inductor`, `compile_config=CompileConfig(
    fullgraph=True)` at the first point, in one process, at each (batch, context) of `points` (random prompts):

    - the first call of the shape (`new_tokens + 2` greedy tokens; a short call at B1 first takes the process's
      one-time kernel compilation), and at `timed_points` ms per new token `(t(new_tokens + 2) - t(2)) / new_tokens`;
    - the median step time through generate (`StepClock`) and the bare replay of the captured step, so what
      `generate` adds on top of the replay is their difference;
    - at `eager_points`: greedy tokens identical to the eager static path, and sampling with one seed (top_k 50);
    - captures: one graph for the shape's first call, none on later calls (`graph_stats`); the graph's memory.
    """
    from transformers.generation import CompileConfig

    from quantmla_hf import apply_quantmla
    from quantmla_hf.generation.graphs import graph_stats, graphs_of

    model = v2_lite(layers, heads=heads, model_type="deepseek_v3")
    cfg = model.config
    apply_quantmla(model, QuantMLAConfig(content_bits=4, rope_bits=4, transform="none"))
    kw = cache_kwarg(model)
    stats = graph_stats(model)
    results = []

    def run(ids, n, variant, sample=False, clock=None):
        N = ids.shape[1]
        extra = dict(do_sample=True, top_k=50) if sample else dict(do_sample=False)
        if variant == "eager-static":
            extra.update(disable_compile=True, **{kw: StaticQuantMLACache(
                config=model.config, quantization_config=model.config.quantization_config,
                max_cache_len=N + n + 2)})
        elif variant == "inductor":
            extra.update(compile_config=CompileConfig(fullgraph=True))
        if clock is not None:
            extra["logits_processor"] = LogitsProcessorList([clock])
        if sample:
            torch.manual_seed(1234)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=n,
                             min_new_tokens=n, **extra)
        torch.cuda.synchronize()
        return out[:, N:].tolist(), time.perf_counter() - t

    warm = torch.randint(0, cfg.vocab_size, (1, 128), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    t = time.perf_counter()
    run(warm, 4, "default")
    run(warm, 4, "eager-static")
    print(json.dumps({"process_warm_up_s": time.perf_counter() - t}), flush=True)
    jobs = [(p, "default") for p in points] + ([(points[0], "inductor")] if inductor else [])
    rows = {}
    for (B, N), v in jobs:
        ids = torch.randint(0, cfg.vocab_size, (B, N), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        row = rows.setdefault((B, N), dict(B=B, N=N, variants={}))
        c0 = stats.captures
        clock = StepClock()
        toks, first = run(ids, new_tokens + 2, v, clock=clock)
        r = dict(first_call_s=first, step_ms_median=clock.step_ms(), captures_first_call=stats.captures - c0)
        if (B, N) in timed_points or v == "inductor":
            c1 = stats.captures
            _, t_long = run(ids, new_tokens + 2, v)
            _, t_short = run(ids, 2, v)
            r.update(ms_per_token=1000 * (t_long - t_short) / new_tokens, captures_later_calls=stats.captures - c1)
        if v == "default":
            cache = model._quantmla_static_cache
            step = next(iter(graphs_of(cache).entries.values()))
            r.update(graph_MiB=step.nbytes / 2**20, cache_len=cache.max_cache_len,
                     cache_GiB=cache.nbytes() / 2**30, graphs_on_cache=len(graphs_of(cache)))
            r["replay_ms"] = replay_ms(step.graph)
        if v == "default" and (B, N) in eager_points:
            e_clock = StepClock()
            e_toks, e_first = run(ids, new_tokens + 2, "eager-static", clock=e_clock)
            row["variants"]["eager-static"] = dict(first_call_s=e_first, step_ms_median=e_clock.step_ms())
            row["greedy_identical"] = toks == e_toks
            row["sampled_identical"] = run(ids, new_tokens, v, True)[0] == run(ids, new_tokens, "eager-static", True)[0]
            print(json.dumps({"B": B, "N": N, "variant": "eager-static", **row["variants"]["eager-static"],
                              "greedy_identical": row["greedy_identical"],
                              "sampled_identical": row["sampled_identical"]}), flush=True)
        row["variants"][v] = r
        print(json.dumps({"B": B, "N": N, "variant": v, **r}), flush=True)
        results = list(rows.values())
        if out_path:
            with open(out_path, "w") as f:
                json.dump(dict(points=results, graph_stats=vars(stats)), f, indent=1)
    print(json.dumps({"graph_stats": vars(stats)}), flush=True)
    return results


@torch.no_grad()
def fill_cache(cache, config, B, N, dtype, chunk=8192, seed=0):
    """Write `N` random positions into every layer of `cache` through `cache.update` (latents `[B, 1, T, d_c]`, RoPE
    keys `[B, 1, T, d_R]`, `chunk` positions a call): what a prefill leaves in the cache, without its compute (with
    random weights the prefill's latents are as arbitrary, and a decode step's work does not depend on them)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for layer in range(config.num_hidden_layers):
        for start in range(0, N, chunk):
            T = min(chunk, N - start)
            latent = torch.randn(B, 1, T, config.kv_lora_rank, generator=g, device=DEVICE, dtype=dtype)
            k_rot = torch.randn(B, 1, T, config.qk_rope_head_dim, generator=g, device=DEVICE, dtype=dtype)
            cache.update(latent, k_rot, layer)


def step_profile(run, n_steps):
    """Per forward over `run()` (`n_steps` forwards), from torch.profiler: the wall time, the GPU time by kernel
    family with the decode attention's part and share of it, the top kernels and the top operators (`top_ops`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / n_steps
    fam, kernels = gpu_ms_by_kernel(prof, n_steps)
    attention = sum(v for k, v in fam.items() if k.startswith("attention:"))
    total = sum(fam.values())
    return dict(wall_ms_per_step=1000 * wall, gpu_ms_per_step=total, attention_ms=attention,
                attention_share=attention / total if total else None,
                families=dict(sorted(fam.items(), key=lambda kv: -kv[1])),
                top_kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15]), ops=top_ops(prof, n_steps))


@torch.no_grad()
def before_after_generate(layers, heads, fmt, points, rounds, new_tokens, baseline_path, out_path=None, tiny=False):
    """Plain `generate()`'s decode steps with this tree's decode and with the tree at `baseline_path` ("before":
    `tree_compare.routed_decode`, its `mla_decode_static` through its own dispatch; projections, cache writes and
    generate are this tree's), in turns in one process, on the `deepseek_v3` model of `v2_lite` (`heads` heads,
    cache format `fmt`, transform none). Per (batch, context) of `points`:

    - one `StaticQuantMLACache` filled with `N` random positions (`fill_cache`: a prefill of 32 x 32768 tokens at
      128 heads does not fit one GPU, and what the cache holds does not change a step's work);
    - `rounds` rounds, each variant once a round (the order alternating): captured graphs released, then greedy
      `generate(ids, cache=cache, max_new_tokens=new_tokens)` with `ids` of `N + 1` tokens, so the last prompt token
      is the only one not cached and every forward is a one-token step (on CUDA replayed from a CUDA graph after the
      first); the median interval between generate's steps (`StepClock`, the capturing step left out) and 20 bare
      replays of the captured step; the cache set back to `N` positions after each call;
    - the greedy tokens of each variant's first call, each on the history `fill_cache` writes (refilled: a call's
      steps overwrite the oldest positions of the recent ring, which setting the length back does not restore),
      compared (`same_tokens`, `first_token_differing`: the first step at which some row's token differs);
    - per variant after the rounds: GPU time per step by kernel family (`step_profile`) over an eager call
      (`disable_compile=True`: the kernels a replay runs), hence the attention's share of the step.

    Returns the rows (also written to `out_path`): per point each variant's times per round with their intervals,
    the ratios new / before with their intervals, and the profiles."""
    from tree_compare import load_baseline_decode, ratio_word, routed_decode, summarize_rounds

    from quantmla_hf import apply_quantmla
    from quantmla_hf.generation.graphs import graphs_of, release_decode_graphs

    if new_tokens < 4:
        raise SystemExit(f"--new-tokens {new_tokens}: the step median needs at least 4 tokens a call (the first two "
                         "steps, the one-token prefill and the capture, are left out)")
    baseline = load_baseline_decode(baseline_path)
    model = v2_lite(layers, tiny, heads, model_type="deepseek_v3")
    content_bits, rope_bits = FORMATS[fmt]
    advanced = {"kernel": "triton"} if tiny else {}  # tiny on CPU: the interpreted kernels, so the route matters
    qconfig = QuantMLAConfig(content_bits=content_bits, rope_bits=rope_bits, transform="none",
                             recent_tokens=8 if tiny else 128, advanced=advanced)
    apply_quantmla(model, qconfig)
    kw = cache_kwarg(model)
    cuda = DEVICE == "cuda"
    variants = {"new": None, "before": baseline}
    rows = []
    for B, N in points:
        cache = StaticQuantMLACache(config=model.config, quantization_config=model.config.quantization_config,
                                    max_cache_len=-(-(N + new_tokens + 64) // 256) * 256)
        fill_cache(cache, model.config, B, N, model.dtype)
        ids = torch.randint(0, model.config.vocab_size, (B, N + 1), generator=torch.Generator().manual_seed(1))
        ids = ids.to(DEVICE)

        def call(n, clock=None, **extra):
            if clock is not None:
                extra["logits_processor"] = LogitsProcessorList([clock])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, **{kw: cache}, **extra)
            cache.set_host_length(N)
            return out

        step, replay, tokens = {v: [] for v in variants}, {v: [] for v in variants}, {}
        calls_before = baseline.calls
        for r in range(rounds):
            for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                release_decode_graphs()
                if r == 0 and tokens:  # the first call's history again: its steps overwrote the recent ring
                    cache.set_host_length(0)
                    fill_cache(cache, model.config, B, N, model.dtype)
                with routed_decode(variants[v]):
                    clock = StepClock()
                    tokens.setdefault(v, call(new_tokens, clock)[:, N + 1:].cpu())
                    step[v].append(clock.step_ms())
                    captured = list(graphs_of(cache).entries.values())
                    if cuda and captured:
                        replay[v].append(replay_ms(captured[0].graph))
                        cache.set_host_length(N)
        release_decode_graphs()
        differ = (tokens["new"] != tokens["before"]).any(0).nonzero()
        row = dict(heads=model.config.num_attention_heads, layers=layers, B=B, N=N, format=fmt, rounds=rounds,
                   step_ms=step, replay_ms=replay, baseline_calls=baseline.calls - calls_before,
                   same_tokens=not len(differ), first_token_differing=int(differ[0]) if len(differ) else None)
        for name, times in (("step", step), ("replay", replay)):
            if all(times.values()):  # "before" first: each "new" round's ratio is new / before
                before, new = summarize_rounds({"before": times["before"], "new": times["new"]})[0]
                row[name] = {"new": new["ms"].to_dict(), "before": before["ms"].to_dict()}
                row[name + "_ratio"] = dict(new["ratio"].to_dict(), verdict=ratio_word(new["ratio"]))
        if cuda:
            row["profile"] = {}
            for v in variants:
                with routed_decode(variants[v]):
                    row["profile"][v] = step_profile(lambda: call(4, disable_compile=True), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(dict(rows=rows), f, indent=1)
        cache = None  # the next point's cache is filled without this one beside it
        if cuda:
            torch.cuda.empty_cache()
    print(f"\n{'heads':>5s} {'B':>3s} {'N':>6s} {'fmt':6s} {'step ms new':>22s} {'before':>22s} "
          f"{'new/before':>22s} {'replay new/before':>22s} {'attention ms (share) new / before':>36s} "
          f"{'greedy tokens':>13s}")
    def text(c):
        return f"{c['value']:.3f} [{c['low']:.3f}, {c['high']:.3f}]" if c else "-"

    for r in rows:
        cells = [text(r["step"][v] if "step" in r else None) for v in variants]
        ratios = [text(r.get(k)) for k in ("step_ratio", "replay_ratio")]
        prof = r.get("profile", {})
        att = " / ".join(f"{p['attention_ms']:.2f} ({100 * p['attention_share']:.0f}%)" for p in prof.values())
        same = "same" if r["same_tokens"] else f"differ at {r['first_token_differing']}"
        print(f"{r['heads']:5d} {r['B']:3d} {r['N']:6d} {r['format']:6s} {cells[0]:>22s} {cells[1]:>22s} "
              f"{ratios[0]:>22s} {ratios[1]:>22s} {att or '-':>36s} {same:>13s}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--heads", type=int, default=16, help="attention heads (16: V2-Lite, 128: V2/V3)")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--budget-gib", type=float, default=64.0, help="memory budget for the largest-batch estimate")
    ap.add_argument("--methods", default="dynamic-bf16,C16R16,C4R4,C2R4,quanto-int4")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--grid", default="", help="batch x context points, e.g. 1x32768,8x4096 (default: the full grid)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel-family GPU time of the static-cache methods' steps")
    ap.add_argument("--check-tokens", type=int, default=0, help="generate N greedy tokens eager vs compiled")
    ap.add_argument("--check-variants", default=",".join(CHECK_VARIANTS),
                    help="which generate paths --check-tokens runs (eager, static, graphed, compiled)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile 3 steps of every eager QuantMLA method")
    ap.add_argument("--skip", default="", help="method@BxN points not to run, e.g. dynamic-bf16@32x32768")
    ap.add_argument("--default-points", default="",
                    help="run only check_default_generate at these BxN points (e.g. 1x4096,8x32768,32x32768)")
    ap.add_argument("--default-eager", default="1x4096,8x32768", help="points where the eager static path runs too")
    ap.add_argument("--default-timed", default="1x4096,8x32768",
                    help="points timed as (t(N + 2) - t(2)) / N over three calls (elsewhere: the step clock)")
    ap.add_argument("--default-inductor", action="store_true", help="also the inductor path at the first point")
    ap.add_argument("--default-tokens", type=int, default=64)
    ap.add_argument("--baseline-path", default="",
                    help="run only before_after_generate: plain generate() with this tree's decode and with the "
                         "decode of the tree extracted at this path, in turns, at the --grid points")
    ap.add_argument("--rounds", type=int, default=3, help="--baseline-path: rounds of each variant")
    ap.add_argument("--format", default="C4R4", choices=sorted(FORMATS), help="--baseline-path: cache format")
    ap.add_argument("--new-tokens", type=int, default=32, help="--baseline-path: tokens per generate call")
    a = ap.parse_args()
    if a.baseline_path:
        pts = [tuple(int(v) for v in p.split("x")) for p in (a.grid or "8x32768,32x32768").split(",")]
        os.makedirs(a.out, exist_ok=True)
        before_after_generate(a.layers, a.heads, a.format, pts, a.rounds, a.new_tokens, a.baseline_path,
                              os.path.join(a.out, f"bench_generate_before_after{a.tag}.json"), a.tiny)
        return
    if a.default_points:
        pts = [tuple(int(v) for v in p.split("x")) for p in a.default_points.split(",")]
        eager = [tuple(int(v) for v in p.split("x")) for p in a.default_eager.split(",") if p]
        timed = [tuple(int(v) for v in p.split("x")) for p in a.default_timed.split(",") if p]
        os.makedirs(a.out, exist_ok=True)
        check_default_generate(a.layers, a.default_tokens, pts, eager, timed, a.default_inductor,
                               os.path.join(a.out, f"bench_generate_default{a.tag}.json"), a.heads)
        return
    model = v2_lite(a.layers, a.tiny, a.heads)
    install_cache_hooks(model)
    # Target point first (batch 32 at 32K), then the rest of the grid; the budget cuts the tail.
    grid = [(32, 32768), (1, 32768), (64, 32768), (1, 131072), (8, 131072), (32, 4096)]
    if a.grid:
        grid = [tuple(int(v) for v in p.split("x")) for p in a.grid.split(",")]
    if a.tiny:
        grid = [(2, 40), (3, 40)]
    methods = a.methods.split(",")
    if "quanto-int4" in methods:
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            print("optimum-quanto not installed: QuantizedCache (quanto) rows skipped", flush=True)
            methods.remove("quanto-int4")
    rows, t0 = [], time.time()
    skip = set(filter(None, a.skip.split(",")))
    os.makedirs(a.out, exist_ok=True)
    for B, N in grid:
        for m in methods:
            if f"{m}@{B}x{N}" in skip:
                continue
            if time.time() - t0 > a.budget_s:
                print(f"skip {m} B={B} N={N}: time budget spent", flush=True)
                continue
            try:
                r, state = run_one(model, m, B, N, a.steps if not a.tiny else 2, recent=128 if not a.tiny else 8)
                if a.profile and is_static(m) and DEVICE == "cuda":
                    r["profile"] = profile_steps(state)
                    print(json.dumps(r["profile"], indent=1), flush=True)
                if a.host_profile and m.startswith("C") and not is_captured(m):
                    print(f"host profile {m} B={B} N={N}:\n" + host_profile(state), flush=True)
                del state
            except torch.cuda.OutOfMemoryError:
                r = dict(method=m, B=B, N=N, error="OOM")
                torch.cuda.empty_cache()
            except Exception as e:  # a baseline that cannot run here (quanto kernels) is reported, not fatal
                r = dict(method=m, B=B, N=N, error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(a.out, f"bench_generate{a.tag}.json"), "w") as f:
                json.dump(dict(rows=rows), f, indent=1)
    # Largest batch under the budget from the peak-memory slope between two batch sizes at one context.
    fits = []
    for N in sorted({n for _, n in grid}):
        for m in methods:
            pts = sorted((r["B"], r["decode_peak_GiB"]) for r in rows
                         if r["method"] == m and r["N"] == N and "decode_peak_GiB" in r)
            if len(pts) < 2 or pts[-1][0] == pts[0][0]:
                continue
            (b0, p0), (b1, p1) = pts[0], pts[-1]
            slope = (p1 - p0) / (b1 - b0)
            fixed = p0 - slope * b0
            fits.append(dict(method=m, N=N, GiB_per_seq=slope, fixed_GiB=fixed, budget_GiB=a.budget_gib,
                             max_batch=int((a.budget_gib - fixed) // slope) if slope > 0 else None,
                             from_batches=[b0, b1]))
    check = None
    if a.check_tokens and DEVICE == "cuda":
        check = check_generate(model, a.check_tokens, a.check_variants.split(","))
        print(json.dumps({k: v for k, v in check.items() if k != "variants"}), flush=True)
    with open(os.path.join(a.out, f"bench_generate{a.tag}.json"), "w") as f:
        json.dump(dict(rows=rows, max_batch=fits, check_generate=check), f, indent=1)
    print(f"\n{'method':14s} {'B':>3s} {'N':>6s} {'tok/s':>9s} {'ms/step':>8s} {'peak GiB':>9s} {'dec. GiB':>9s} "
          f"{'cache GiB':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:14s} {r['B']:3d} {r['N']:6d} {r['error']}")
        else:
            print(f"{r['method']:14s} {r['B']:3d} {r['N']:6d} {r['tok_s']:9.1f} {r['ms_per_step']:8.2f} "
                  f"{r['peak_GiB']:9.2f} {r['decode_peak_GiB']:9.2f} {r['cache_GiB']:9.3f}"
                  + (f"  (compile {r['compile_s']:.0f} s)" if "compile_s" in r else ""))
    print(f"\n{'method':14s} {'N':>6s} {'GiB/seq':>9s} {'fixed GiB':>9s} {'max batch in ' + str(a.budget_gib) + ' GiB':>22s}")
    for f in fits:
        print(f"{f['method']:14s} {f['N']:6d} {f['GiB_per_seq']:9.4f} {f['fixed_GiB']:9.2f} {str(f['max_batch']):>22s}")


if __name__ == "__main__":
    main()
