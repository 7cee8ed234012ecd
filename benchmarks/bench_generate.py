"""Decode throughput and peak memory of a DeepSeek-V2-Lite-shaped model (real attention widths, a few dense
layers, random bf16 weights): stock DynamicCache, transformers' QuantizedCache (quanto int4, when optimum-quanto is
installed) and QuantMLACache (C16R16, C4R4, C2R4, native "quantmla" decode).

    python benchmarks/bench_generate.py --out DIR [--layers 2] [--steps 16] [--budget-gib 64]

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
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from quantmla_hf import QuantMLACache, QuantMLAConfig, install_cache_hooks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def v2_lite(layers, tiny=False):
    dims = dict(hidden_size=2048, intermediate_size=10944, num_attention_heads=16, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400)
    if tiny:
        dims = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, kv_lora_rank=64,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=128)
    cfg = AutoConfig.for_model("deepseek_v2", num_hidden_layers=layers, num_key_value_heads=dims["num_attention_heads"],
                               q_lora_rank=None, first_k_dense_replace=layers, max_position_embeddings=163840, **dims)
    torch.manual_seed(0)
    dtype = torch.float32 if tiny else torch.bfloat16
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(DEVICE).eval()


def cache_kwarg(model):
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def run_one(model, method, B, N, steps, recent):
    kw = cache_kwarg(model)
    if method == "dynamic-bf16":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    elif method == "quanto-int4":
        from transformers import QuantizedCache

        model.set_attn_implementation("sdpa")
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64, residual_length=128)
    else:
        bits = {"C16R16": (16, 16), "C4R4": (4, 4), "C2R4": (2, 4)}[method]
        model.set_attn_implementation("quantmla")
        q = QuantMLAConfig(content_bits=bits[0], rope_bits=bits[1], recent_tokens=recent, transform="none",
                           cache_block_size=1024)
        cache = QuantMLACache(config=model.config, quantization_config=q)
    ids = torch.randint(0, model.config.vocab_size, (B, N), device=DEVICE)
    mask = torch.ones_like(ids)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    chunk = 8192  # chunked prefill keeps the prompt's activations small at long contexts
    for s in range(0, N, chunk):
        out = model(ids[:, s : s + chunk], attention_mask=mask[:, : s + chunk], **{kw: cache}, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    mask = torch.cat([mask, torch.ones_like(tok)], 1)
    # Two untimed steps: JIT compilation and library start-up stay out of the numbers.
    for _ in range(2):
        out = model(tok, attention_mask=mask, **{kw: cache}, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # decode peak: resident cache + one step's activations
    t = time.perf_counter()
    for _ in range(steps):
        out = model(tok, attention_mask=mask, **{kw: cache}, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
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
    del cache
    return dict(method=method, B=B, N=N, tok_s=B * steps / dt, ms_per_step=1000 * dt / steps, peak_GiB=peak,
                decode_peak_GiB=decode_peak, cache_GiB=cache_gib)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--budget-gib", type=float, default=64.0, help="memory budget for the largest-batch estimate")
    ap.add_argument("--methods", default="dynamic-bf16,C16R16,C4R4,C2R4,quanto-int4")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--grid", default="", help="batch x context points, e.g. 1x32768,8x4096 (default: the full grid)")
    a = ap.parse_args()
    model = v2_lite(a.layers, a.tiny)
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
    for B, N in grid:
        for m in methods:
            if time.time() - t0 > a.budget_s:
                print(f"skip {m} B={B} N={N}: time budget spent", flush=True)
                continue
            try:
                r = run_one(model, m, B, N, a.steps if not a.tiny else 2, recent=128 if not a.tiny else 8)
            except torch.cuda.OutOfMemoryError:
                r = dict(method=m, B=B, N=N, error="OOM")
                torch.cuda.empty_cache()
            except Exception as e:  # a baseline that cannot run here (quanto kernels) is reported, not fatal
                r = dict(method=m, B=B, N=N, error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.append(r)
            print(json.dumps(r), flush=True)
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
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"bench_generate{a.tag}.json"), "w") as f:
        json.dump(dict(rows=rows, max_batch=fits), f, indent=1)
    print(f"\n{'method':14s} {'B':>3s} {'N':>6s} {'tok/s':>9s} {'ms/step':>8s} {'peak GiB':>9s} {'dec. GiB':>9s} "
          f"{'cache GiB':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:14s} {r['B']:3d} {r['N']:6d} {r['error']}")
        else:
            print(f"{r['method']:14s} {r['B']:3d} {r['N']:6d} {r['tok_s']:9.1f} {r['ms_per_step']:8.2f} "
                  f"{r['peak_GiB']:9.2f} {r['decode_peak_GiB']:9.2f} {r['cache_GiB']:9.3f}")
    print(f"\n{'method':14s} {'N':>6s} {'GiB/seq':>9s} {'fixed GiB':>9s} {'max batch in ' + str(a.budget_gib) + ' GiB':>22s}")
    for f in fits:
        print(f"{f['method']:14s} {f['N']:6d} {f['GiB_per_seq']:9.4f} {f['fixed_GiB']:9.2f} {str(f['max_batch']):>22s}")


if __name__ == "__main__":
    main()
