"""Decode attention of one MLA layer: our Triton kernel on the packed cache vs PyTorch absorbed attention on a
BF16 latent cache vs the stock transformers step (DeepseekV3Attention + DynamicCache), DeepSeek-V2-Lite dims.

    python benchmarks/bench_decode.py --check            # kernel vs reference at real sizes (GPU)
    python benchmarks/bench_decode.py --bench --out DIR  # timing grid + copy-bandwidth ceiling

Times are `triton.testing.do_bench` medians (L2 flushed between runs). "bytes" are the cache bytes the method must
read once (packed tokens + BF16 sink/recent copies for ours, the BF16 latent for the others).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from quantmla_hf.format import CacheFormat, PathFormat
from quantmla_hf.kernels.mla_decode import mla_decode
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref

D_C, D_R, D_NOPE, D_V, HIDDEN = 512, 64, 128, 128, 2048
SCALING = (D_NOPE + D_R) ** -0.5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {"C4R4": (4, 4), "C2R4": (2, 4), "C8R8": (8, 8), "C16R16": (16, 16)}


def make_cache(name, B, N, S=4, R=128, dtype=torch.bfloat16, device=None, seed=0):
    """Random packed planes (codes, positive fp16 scales, int8 zeros) or BF16 values, plus sink/recent copies."""
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


def run_check(out_lines, cases=None, R=128):
    """Kernel vs fp64 reference on rows 0 and B-1 (the kernel always runs on the whole batch).

    An fp32 reference is itself off by ~1e-4 in the LSE when scores reach ~100 (C8R8 with random codes).
    """
    cases = cases or [
        ("C4R4", 16, 1, 4096, 1), ("C4R4", 16, 64, 4133, 1), ("C2R4", 16, 8, 32768, 1), ("C8R8", 16, 4, 32768, 1),
        ("C16R16", 16, 4, 32768, 1), ("C4R4", 128, 8, 32768, 1), ("C4R4", 128, 2, 131072, 1),
        ("C4R4", 16, 2, 131072, 4), ("C2R4", 128, 1, 5000, 16),
        ("C4R4", 16, 32, 131072, 1),  # B * N * 576 = 2.4e9 > 2**31 elements
    ]
    worst_o, worst_lse = 0.0, 0.0
    # Queries in bf16 (what the attention swap passes: exact in one fp16 operand) and in fp32 (high/low split).
    cases = [c + ("bf16",) for c in cases] + [c + ("fp32",) for c in cases[:4]] + [
        cases[1][:4] + (1, "bf16x1e6"),  # |q| ~ 1e6: fp16 operands only through the per-row power of two
    ]
    worst_o, worst_lse, all_ok = 0.0, 0.0, True
    for name, H, B, N, Tq, qdt in cases:
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N, R=R, seed=B + N)
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q_lat = torch.randn(B, H, Tq, D_C, device=DEVICE, generator=g)
        q_rot = torch.randn(B, H, Tq, D_R, device=DEVICE, generator=g)
        if qdt.startswith("bf16"):
            mult = 1e6 if qdt == "bf16x1e6" else 1.0
            q_lat, q_rot = (q_lat * mult).bfloat16(), (q_rot * mult).bfloat16()
        lp = torch.randint(0, 40, (B,), device=DEVICE, generator=g)
        lp[0] = 0
        args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
        o, lse = mla_decode(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for b in sorted({0, B - 1}):
            sub = lambda d: {k: v[b : b + 1] for k, v in d.items()}  # noqa: E731
            ref_o, ref_lse = mla_decode_ref(q_lat[b : b + 1], q_rot[b : b + 1], sub(cp), sub(rp), fmt, sc[b : b + 1],
                                            sr[b : b + 1], rc[b : b + 1], rr[b : b + 1], lp[b : b + 1], N, SCALING,
                                            dtype=torch.float64)
            rel = ((o[b : b + 1] - ref_o).norm() / ref_o.norm()).item()
            lse_err = (lse[b : b + 1] - ref_lse).abs().max().item()
            lse_tol = 1e-4 * max(1.0, ref_lse.abs().max().item() / 100) if qdt == "bf16x1e6" else 1e-4
            ok = rel < 2e-3 and lse_err < lse_tol and torch.isfinite(o).all().item()
            worst_o = max(worst_o, rel)
            if qdt != "bf16x1e6":
                worst_lse = max(worst_lse, lse_err)
            all_ok = all_ok and ok
            line = (f"check {name:6s} H={H:3d} B={B:2d} N={N:6d} Tq={Tq:2d} q={qdt:8s} row={b:2d} "
                    f"B*N*576={B * N * 576:.2e} out_rel={rel:.2e} lse_abs={lse_err:.2e} {'OK' if ok else 'FAIL'}")
            print(line, flush=True)
            out_lines.append(line)
        del cp, rp, o, lse
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    line = f"check worst out_rel={worst_o:.2e} (limit 2e-3) lse_abs={worst_lse:.2e} (limit 1e-4)"
    print(line, flush=True)
    out_lines.append(line)
    return all_ok


def bench(fn, slow=False):
    from triton.testing import do_bench

    return do_bench(fn, warmup=5 if slow else 25, rep=30 if slow else 100, return_mode="median")


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
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=HIDDEN, num_attention_heads=H, num_key_value_heads=H,
                               q_lora_rank=None, kv_lora_rank=D_C, qk_rope_head_dim=D_R, qk_nope_head_dim=D_NOPE,
                               v_head_dim=D_V, num_hidden_layers=1, rope_interleave=True)
    cfg._attn_implementation = "sdpa"
    attn = DeepseekV3Attention(cfg, layer_idx=0).to(DEVICE).to(torch.bfloat16).eval()
    return cfg, attn, DeepseekV3RotaryEmbedding(cfg).to(DEVICE)


def stock_step_fn(cfg, attn, rope, B, N):
    from transformers import DynamicCache
    import inspect

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


def run_bench(out_lines, heads=(16, 128), batches=(1, 8, 32, 64), contexts=(4096, 32768, 131072), budget_s=240,
              launch=None):
    t0 = time.time()
    ceiling = copy_ceiling()
    line = f"copy ceiling: {ceiling:.0f} GB/s (device-to-device copy of 2 GiB, read + write)"
    print(line, flush=True)
    out_lines.append(line)
    rows = []
    for H in heads:
        stock = stock_layer(H)
        for B in batches:
            for N in contexts:
                if time.time() - t0 > budget_s:
                    out_lines.append(f"skip H={H} B={B} N={N}: time budget of the run spent")
                    continue
                g = torch.Generator(device=DEVICE).manual_seed(1)
                # bf16 queries, as the attention swap passes them (model dtype).
                q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()
                q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
                lp = torch.zeros(B, dtype=torch.long, device=DEVICE)
                for name in ("C4R4", "C2R4", "C16R16"):
                    fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
                    args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
                    kw = (launch or {}).get((name, H), {})
                    ms = bench(lambda: mla_decode(*args, **kw))
                    nbytes = cache_bytes(fmt, B, N)
                    rows.append(dict(method=name, H=H, B=B, N=N, ms=ms, bytes=nbytes))
                    del cp, rp
                kv_bytes = B * N * (D_C + D_R) * 2
                kv = torch.randn(B, N, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
                q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
                if B * H * N * 4 * 3 < 60e9:
                    ms = bench(lambda: torch_absorbed(q, kv, SCALING))
                    rows.append(dict(method="torch-absorbed-bf16", H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
                else:
                    out_lines.append(f"skip torch-absorbed H={H} B={B} N={N}: scores need > 60 GB")
                del kv
                expanded = B * N * H * (D_NOPE + D_V) * 2 * 3  # kv_b_proj output, its split copies and SDPA inputs
                if expanded < 60e9:
                    step = stock_step_fn(*stock, B, N)
                    ms = bench(step, slow=True)
                    rows.append(dict(method="stock-transformers", H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
                    del step
                else:
                    out_lines.append(f"skip stock H={H} B={B} N={N}: expanding the history needs {expanded / 1e9:.0f} GB")
                torch.cuda.empty_cache()
                for r in rows[-5:]:
                    if r["H"] == H and r["B"] == B and r["N"] == N:
                        r["GBps"] = r["bytes"] / r["ms"] / 1e6
                        r["pct_ceiling"] = 100 * r["GBps"] / ceiling
                print(f"H={H} B={B} N={N} done ({time.time() - t0:.0f}s)", flush=True)
    return ceiling, rows


def run_variants(out_lines):
    """Launch-parameter sweep around the defaults at the target points (B 32, 32K; 16 and 128 heads)."""
    res = []
    sweep = {16: [dict(), dict(block_n=64), dict(num_warps=8), dict(num_stages=3), dict(block_n=16)],
             128: [dict(), dict(block_m=64, num_stages=1), dict(block_m=16, block_n=32, num_warps=4)]}
    for name, H in (("C4R4", 16), ("C4R4", 128)):
        B, N = 32, 32768
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()
        q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
        lp = torch.zeros(B, dtype=torch.long, device=DEVICE)
        args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
        for v in sweep[H]:
            try:
                ms = bench(lambda: mla_decode(*args, **v))
            except Exception as e:  # a variant that does not compile (registers, shared memory) is reported, not fatal
                ms = float("nan")
                out_lines.append(f"variant {name} H={H} {v}: {type(e).__name__}: {str(e)[:200]}")
            line = f"variant {name} H={H} B={B} N={N} {v or 'default'}: {ms:.4f} ms"
            print(line, flush=True)
            out_lines.append(line)
            res.append(dict(method=name, H=H, variant=v, ms=ms))
        del cp, rp
        torch.cuda.empty_cache()
    best = {}
    for r in res:
        k = (r["method"], r["H"])
        if r["ms"] == r["ms"] and (k not in best or r["ms"] < best[k][1]):
            best[k] = (r["variant"], r["ms"])
    for k, (v, ms) in best.items():
        line = f"best launch {k[0]} H={k[1]}: {v or 'default'} {ms:.4f} ms (used for the grid)"
        print(line, flush=True)
        out_lines.append(line)
    return res, {k: v for k, (v, _) in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=240, help="time budget of the --bench grid")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the script itself (interpreter, tiny sizes)")
    a = ap.parse_args()
    lines = []
    if a.tiny:
        global D_C, D_R, D_NOPE, D_V, HIDDEN
        fmt, cp, rp, sc, sr, rc, rr = make_cache("C4R4", 2, 300, R=8, device="cpu")
        print("tiny make_cache ok", cache_bytes(fmt, 2, 300))
        step = stock_step_fn(*stock_layer(4), 2, 64)
        print("tiny stock step", tuple(step()[0].shape), tuple(step()[0].shape))
        q = torch.randn(2, 4, D_C + D_R, dtype=torch.bfloat16)
        print("tiny torch absorbed", tuple(torch_absorbed(q, torch.randn(2, 64, D_C + D_R, dtype=torch.bfloat16), 0.1).shape))
        return
    env = (f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | "
           f"triton {__import__('triton').__version__} | transformers {__import__('transformers').__version__} | "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(env, flush=True)
    lines.append(env)
    result = {"env": env}
    if a.check:
        result["check_ok"] = run_check(lines)
    if a.variants:
        result["variants"], _ = run_variants(lines)
    launch = {}  # the grid runs the kernel's default launch choice
    if a.bench:
        result["ceiling_GBps"], result["rows"] = run_bench(lines, launch=launch, budget_s=a.budget_s)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(a.out, "bench_decode.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if "rows" in result:
        print(f"\n{'method':22s} {'H':>4s} {'B':>3s} {'N':>7s} {'ms':>9s} {'GB/s':>7s} {'%ceil':>6s}")
        for r in result["rows"]:
            if r["B"] in (1, 32) and r["N"] in (32768, 131072):
                print(f"{r['method']:22s} {r['H']:4d} {r['B']:3d} {r['N']:7d} {r['ms']:9.4f} "
                      f"{r.get('GBps', 0):7.0f} {r.get('pct_ceiling', 0):6.1f}")


if __name__ == "__main__":
    main()
