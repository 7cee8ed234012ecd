"""Decode attention of one MLA layer: our Triton kernels on the packed cache (the fast kernel
`mla_decode_fast.mla_decode_static` and the fallback `mla_decode.mla_decode`) vs BF16 baselines on a BF16 latent
cache: PyTorch absorbed attention (two bmm), a public BF16 MLA Triton decode kernel when one is given
(`--bf16-kernel FILE`: vLLM's `triton_decode_attention.py`, fetched separately and never committed), and the stock
transformers step (`--stock`). DeepSeek-V2-Lite dims.

    python benchmarks/bench_decode.py --check                # kernels vs fp64 reference at real sizes (GPU)
    python benchmarks/bench_decode.py --variants             # launch sweep of the fast kernel at the target points
    python benchmarks/bench_decode.py --bench --out DIR      # timing table + copy-bandwidth ceiling
    python benchmarks/bench_decode.py --bench --graph --repeat 10 --points H:B:N --ours KERNEL:FMT,... [--target-ms T]
                                                             # methods in turns, 95% intervals of times and ratios

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
from quantmla_hf.kernels import (mla_decode_gluon, mla_decode_gluon_regs, mla_decode_gluon_scaled,
                                 mla_decode_gluon_wide, mla_decode_strided)
from quantmla_hf.kernels.mla_decode_fast import fast_handles, mla_decode_static
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref

D_C, D_R, D_NOPE, D_V, HIDDEN = 512, 64, 128, 128, 2048
SCALING = (D_NOPE + D_R) ** -0.5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = {"C4R4": (4, 4), "C2R4": (2, 4), "C8R8": (8, 8), "C16R16": (16, 16)}


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


def decode_fn(kernel, fmt, N, capacity=None, **launch):
    """`(args) -> (o, lse)` for one kernel: "fast" = `mla_decode_static` through the Triton fast kernel, "gluon" =
    the same through the Gluon (sm_90) kernel, "strided" = through the strided-plane kernel, all three with a device-side length and the planes' capacity (`capacity`,
    default N); "old" = the fallback `mla_decode` with a host length."""
    if kernel in ("fast", "gluon", "gluon-scaled", "gluon-regs", "gluon-wide", "strided"):
        if kernel == "gluon-scaled":
            launch = dict(launch, backend="gluon", scaled=True)
        elif kernel == "gluon-regs":
            launch = dict(launch, backend="gluon", regs=True)
        elif kernel == "gluon-wide":
            launch = dict(launch, backend="gluon", wide=True)
        else:
            launch = dict(launch, backend={"fast": "triton"}.get(kernel, kernel))
        length = torch.tensor([N], dtype=torch.int64, device=DEVICE)
        cap = capacity or N

        def run(q_lat, q_rot, cp, rp, fmt_, sc, sr, rc, rr, lp, n, scaling):
            return mla_decode_static(q_lat, q_rot, cp, rp, fmt_, sc, sr, rc, rr, lp, length, cap, scaling, **launch)

        return run
    return lambda *args: mla_decode(*args, **launch)


def run_check(out_lines, cases=None, R=128, kernel="old", launch=None):
    """Kernel vs fp64 reference on rows 0 and B-1 (the kernel always runs on the whole batch). The fast kernel runs
    on planes with 67 positions of spare capacity (splits past the device-side length must stay empty).

    An fp32 reference is itself off by ~1e-4 in the LSE when scores reach ~100 (C8R8 with random codes).
    """
    cases = cases or [
        ("C4R4", 16, 1, 4096, 1), ("C4R4", 16, 64, 4133, 1), ("C2R4", 16, 8, 32768, 1), ("C8R8", 16, 4, 32768, 1),
        ("C16R16", 16, 4, 32768, 1), ("C4R4", 128, 8, 32768, 1), ("C4R4", 128, 2, 131072, 1),
        ("C4R4", 16, 2, 131072, 4), ("C2R4", 128, 1, 5000, 16),
        ("C4R4", 16, 32, 131072, 1),  # B * N * 576 = 2.4e9 > 2**31 elements
        ("C8R8", 16, 3, 9000, 16), ("C4R4", 16, 5, 20000, 3),
        ("C4R4", 16, 3, 100, 1), ("C2R4", 16, 2, 197, 4),  # shorter than sink + recent; a few packed positions
    ]
    worst_o, worst_lse = 0.0, 0.0
    # Queries in bf16 (what the attention swap passes: exact in one fp16 operand) and in fp32 (high/low split).
    cases = [c + ("bf16",) for c in cases] + [c + ("fp32",) for c in cases[:4]] + [
        cases[1][:4] + (1, "bf16x1e6"),  # |q| ~ 1e6: fp16 operands only through the per-row power of two
    ]
    worst_o, worst_lse, all_ok = 0.0, 0.0, True
    for name, H, B, N, Tq, qdt in cases:
        spare = 67 if kernel in ("fast", "gluon", "gluon-scaled", "gluon-regs", "gluon-wide", "strided") else 0
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N + spare, R=R, seed=B + N)
        if kernel == "gluon" and not mla_decode_gluon.gluon_handles(fmt, torch.bfloat16, DEVICE, sc.dtype):
            out_lines.append(f"check {name} H={H} B={B} N={N}: not handled by the Gluon kernel, skipped")
            print(out_lines[-1], flush=True)
            continue
        handles = {"gluon-regs": mla_decode_gluon_regs.regs_handles,
                   "gluon-wide": mla_decode_gluon_wide.wide_handles}.get(kernel, mla_decode_gluon_scaled.scaled_handles)
        if kernel in ("gluon-scaled", "gluon-regs", "gluon-wide") and not handles(
                fmt, torch.float32 if qdt == "fp32" else torch.bfloat16, DEVICE, sc.dtype):
            out_lines.append(f"check {name} H={H} B={B} N={N}: not handled by the scaled Gluon kernel, skipped")
            print(out_lines[-1], flush=True)
            continue
        if kernel == "strided" and not mla_decode_strided.strided_handles(
                fmt, torch.float32 if qdt == "fp32" else torch.bfloat16, DEVICE, sc.dtype):
            out_lines.append(f"check {name} H={H} B={B} N={N} q={qdt}: not handled by the strided kernel, skipped")
            print(out_lines[-1], flush=True)
            continue
        if kernel == "fast" and not fast_handles(fmt, torch.bfloat16, DEVICE, sc.dtype):
            out_lines.append(f"check {name} H={H} B={B} N={N}: not handled by the fast kernel, skipped")
            print(out_lines[-1], flush=True)
            continue
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q_lat = torch.randn(B, H, Tq, D_C, device=DEVICE, generator=g)
        q_rot = torch.randn(B, H, Tq, D_R, device=DEVICE, generator=g)
        if qdt.startswith("bf16"):
            mult = 1e6 if qdt == "bf16x1e6" else 1.0
            q_lat, q_rot = (q_lat * mult).bfloat16(), (q_rot * mult).bfloat16()
        lp = torch.randint(0, 40, (B,), device=DEVICE, generator=g)
        lp[0] = 0
        args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
        try:
            o, lse = decode_fn(kernel, fmt, N, N + spare, **(launch or {}))(*args)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except (ValueError, RuntimeError) as e:  # reported as a failed row; a CUDA fault still ends the process
            all_ok = False
            out_lines.append(f"check {kernel} {name} H={H} B={B} N={N} Tq={Tq} q={qdt}: ERROR {type(e).__name__}: "
                             f"{str(e)[:300]}")
            print(out_lines[-1], flush=True)
            continue
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
            line = (f"check {kernel} {name:6s} H={H:3d} B={B:2d} N={N:6d} Tq={Tq:2d} q={qdt:8s} row={b:2d} "
                    f"B*N*576={B * N * 576:.2e} out_rel={rel:.2e} lse_abs={lse_err:.2e} {'OK' if ok else 'FAIL'}")
            print(line, flush=True)
            out_lines.append(line)
        del cp, rp, o, lse
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    line = f"check worst ({kernel}) out_rel={worst_o:.2e} (limit 2e-3) lse_abs={worst_lse:.2e} (limit 1e-4)"
    print(line, flush=True)
    out_lines.append(line)
    return all_ok


def check_capacity_invariance(out_lines, kernel, cases=None):
    """The same positions decoded from planes of two capacities (N + 67, as a growing cache holds them, and 4N, a
    larger static cache): the split boundaries follow the length, not the capacity, so `(o, lse)` must be bitwise
    identical (what lets the growing and static caches give the same greedy tokens)."""
    cases = cases or [("C4R4", 16, 1, 4096, 1), ("C4R4", 16, 32, 32768, 1), ("C4R4", 128, 2, 32768, 1),
                      ("C2R4", 16, 3, 20000, 3), ("C8R8", 16, 2, 9000, 1)]
    all_ok = True
    for name, H, B, N, Tq in cases:
        fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, 4 * N, seed=B + N)
        handles = {"gluon": mla_decode_gluon.gluon_handles,
                   "gluon-scaled": mla_decode_gluon_scaled.scaled_handles,
                   "gluon-regs": mla_decode_gluon_regs.regs_handles,
                   "gluon-wide": mla_decode_gluon_wide.wide_handles}.get(kernel, fast_handles)
        if not handles(fmt, torch.bfloat16, DEVICE, sc.dtype):
            continue
        g = torch.Generator(device=DEVICE).manual_seed(N)
        q_lat = torch.randn(B, H, Tq, D_C, device=DEVICE, generator=g).bfloat16()
        q_rot = torch.randn(B, H, Tq, D_R, device=DEVICE, generator=g).bfloat16()
        lp = torch.randint(0, 40, (B,), device=DEVICE, generator=g)
        lp[0] = 0
        short = lambda d: {k: v[:, : N + 67].clone() for k, v in d.items()}  # noqa: E731
        outs = [decode_fn(kernel, fmt, N, cap)(q_lat, q_rot, planes_c, planes_r, fmt, sc, sr, rc, rr, lp, N, SCALING)
                for cap, planes_c, planes_r in ((N + 67, short(cp), short(rp)), (4 * N, cp, rp))]
        ok = torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        all_ok = all_ok and ok
        line = (f"capacity {kernel} {name:6s} H={H:3d} B={B:2d} N={N:6d} Tq={Tq:2d} capacities {N + 67} vs {4 * N}: "
                f"{'bitwise identical' if ok else 'DIFFER max %.2e' % (outs[0][0] - outs[1][0]).abs().max().item()}")
        print(line, flush=True)
        out_lines.append(line)
        del cp, rp, outs
    return all_ok


def check_gluon_unpack(out_lines):
    """The Gluon kernel's unpacking (`mla_decode_gluon.unpack_group_kernel`) against the reference dequantization of
    random codes and zero points, every width: bit-exact `code - z`."""
    from quantmla_hf.kernels.quant_pack_ref import dequantize_ref

    ok = True
    for bits in (2, 4, 8):
        f = PathFormat(64, bits, 64)
        codes = torch.randint(0, 256, (64, f.code_bytes), dtype=torch.uint8, device=DEVICE)
        zero = torch.randint(-100, 100, (64, 1), dtype=torch.int8, device=DEVICE)
        out = torch.empty(64, 64, dtype=torch.float16, device=DEVICE)
        mla_decode_gluon.unpack_group_kernel[(1,)](codes.view(torch.int32), zero, out, W=2 * bits, BITS=bits, NW=4,
                                                   num_warps=4)
        ref = dequantize_ref(codes, torch.ones(64, 1, dtype=torch.float16, device=DEVICE), zero, f, torch.float32)
        good = torch.equal(out.float(), ref)
        ok = ok and good
        out_lines.append(f"check gluon unpack {bits} bits: {'OK' if good else 'FAIL'} "
                         f"(max diff {(out.float() - ref).abs().max().item():.1f})")
        print(out_lines[-1], flush=True)
        if bits == 8:
            continue
        # the scaled kernel's unpacking: fp16 `(code - z) * s`, one rounding of the exact product
        scale = (torch.rand(64, 1, device=DEVICE) * 0.1 + 0.01).half()
        mla_decode_gluon_scaled.unpack_scaled_kernel[(1,)](codes.view(torch.int32), zero, scale, out, W=2 * bits,
                                                           BITS=bits, NW=4, num_warps=4)
        # the kernel's tiles hold the group's elements in `column_order`
        ref_s = (ref * scale.float()).half()[:, mla_decode_gluon_scaled.column_order(bits).to(DEVICE)]
        good = torch.equal(out, ref_s)
        ok = ok and good
        out_lines.append(f"check gluon scaled unpack {bits} bits: {'OK' if good else 'FAIL'} "
                         f"(max diff {(out.float() - ref_s.float()).abs().max().item():.2e})")
        print(out_lines[-1], flush=True)
    return ok


def bench(fn, slow=False):
    from triton.testing import do_bench

    return do_bench(fn, warmup=5 if slow else 25, rep=30 if slow else 100, return_mode="median")


def graphed(fn):
    """`fn` captured once in a CUDA graph: the returned callable replays it (no Python or launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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


def load_bf16_kernel(path):
    """vLLM's BF16 MLA Triton decode (`decode_attention_fwd`) from a local copy of its `triton_decode_attention.py`
    (fetched for the benchmark, never committed), or None."""
    if not path or not os.path.exists(path):
        return None
    import importlib.util

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


POINTS = [(16, 1, 4096), (16, 8, 32768), (16, 32, 32768), (16, 64, 32768), (16, 8, 131072), (16, 32, 131072),
          (128, 8, 32768), (128, 32, 32768)]
OURS = [("gluon-regs", "C4R4"), ("gluon-regs", "C2R4"), ("gluon-scaled", "C4R4"), ("gluon-scaled", "C2R4"), ("strided", "C4R4"), ("strided", "C2R4"), ("strided", "C8R8"), ("gluon", "C4R4"), ("gluon", "C2R4"),
        ("gluon", "C8R8"), ("fast", "C4R4"), ("fast", "C2R4"), ("old", "C8R8"), ("old", "C16R16")]


def run_bench(out_lines, points=None, budget_s=240, launch=None, bf16_kernel=None, stock=False, ours=None,
              graph=False):
    """Timing table: every point times our kernels, the torch bmm on a BF16 latent cache and, when given, the BF16
    Triton kernel, in the same process. `graph`: every method replayed from a CUDA graph (no host or launch
    overhead; a method that cannot be captured is timed eagerly and says so)."""

    def timed(fn):
        if not graph:
            return bench(fn), ""
        try:
            return bench(graphed(fn)), "-graph"
        except Exception:  # not capturable (host synchronisation): eager, marked as such
            torch.cuda.synchronize()
            return bench(fn), "-eager"

    t0 = time.time()
    ceiling = copy_ceiling()
    line = f"copy ceiling: {ceiling:.0f} GB/s (device-to-device copy of 2 GiB, read + write)"
    print(line, flush=True)
    out_lines.append(line)
    rows = []
    for H, B, N in points or POINTS:
        if time.time() - t0 > budget_s:
            out_lines.append(f"skip H={H} B={B} N={N}: time budget of the run spent")
            continue
        g = torch.Generator(device=DEVICE).manual_seed(1)
        # bf16 queries, as the attention swap passes them (model dtype).
        q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()
        q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
        lp = torch.zeros(B, dtype=torch.long, device=DEVICE)
        here = []
        for kernel, name in ours or OURS:
            fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            fn = decode_fn(kernel, fmt, N, **(launch or {}).get((kernel, name, H), {}))
            sfx = ""
            try:
                ms, sfx = timed(lambda: fn(*args))
            except Exception as e:  # e.g. a kernel that does not handle this case: reported, not fatal
                ms = float("nan")
                out_lines.append(f"{name}-{kernel} H={H} B={B} N={N}: {type(e).__name__}: {str(e)[:200]}")
            here.append(dict(method=f"{name}-{kernel}{sfx}", H=H, B=B, N=N, ms=ms, bytes=cache_bytes(fmt, B, N)))
            del cp, rp
        kv_bytes = B * N * (D_C + D_R) * 2
        kv = torch.randn(B, N, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        if B * H * N * 4 * 3 < 60e9:
            ms, sfx = timed(lambda: torch_absorbed(q, kv, SCALING))
            here.append(dict(method="torch-bmm-bf16" + sfx, H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
        if B == 1 and not graph:
            # Launch overhead dominates at batch 1: both also replayed from a CUDA graph (how a captured decode step
            # runs them; the fast kernel's interface is built for capture).
            ms = bench(graphed(lambda: torch_absorbed(q, kv, SCALING)))
            here.append(dict(method="torch-bmm-bf16-graph", H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
            fmt, cp, rp, sc, sr, rc, rr = make_cache("C4R4", B, N)
            fn = decode_fn("fast", fmt, N)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            ms = bench(graphed(lambda: fn(*args)))
            here.append(dict(method="C4R4-fast-graph", H=H, B=B, N=N, ms=ms, bytes=cache_bytes(fmt, B, N)))
            if mla_decode_gluon_scaled.scaled_handles(fmt, torch.bfloat16, DEVICE, sc.dtype):
                fn = decode_fn("gluon-scaled", fmt, N)
                ms = bench(graphed(lambda: fn(*args)))
                here.append(dict(method="C4R4-gluon-scaled-graph", H=H, B=B, N=N, ms=ms,
                                 bytes=cache_bytes(fmt, B, N)))
                fn = decode_fn("gluon-regs", fmt, N)
                ms = bench(graphed(lambda: fn(*args)))
                here.append(dict(method="C4R4-gluon-regs-graph", H=H, B=B, N=N, ms=ms, bytes=cache_bytes(fmt, B, N)))
            del cp, rp
        if bf16_kernel is not None and B * N * (D_C + D_R) >= 2**31:
            # Known limit of that kernel: int32 offsets; past 2**31 elements it faults and kills the process.
            out_lines.append(f"skip vllm-triton-bf16 H={H} B={B} N={N}: B*N*576 >= 2**31 (int32 offsets)")
        elif bf16_kernel is not None:
            try:
                fn = bf16_kernel_fn(bf16_kernel, B, H, N, kv)
                sfx = ""
                ms, sfx = timed(fn)
            except Exception as e:  # e.g. int32 offsets past 2**31 elements: reported, not fatal
                ms = float("nan")
                out_lines.append(f"bf16 Triton kernel H={H} B={B} N={N}: {type(e).__name__}: {str(e)[:160]}")
            here.append(dict(method="vllm-triton-bf16" + sfx, H=H, B=B, N=N, ms=ms, bytes=kv_bytes))
        del kv
        if stock and B * N * H * (D_NOPE + D_V) * 2 * 3 < 60e9:
            step = stock_step_fn(*stock_layer(H), B, N)
            here.append(dict(method="stock-transformers", H=H, B=B, N=N, ms=bench(step, slow=True), bytes=kv_bytes))
            del step
        torch.cuda.empty_cache()
        for r in here:
            r["GBps"] = r["bytes"] / r["ms"] / 1e6
            r["pct_ceiling"] = 100 * r["GBps"] / ceiling
            line = (f"H={H:3d} B={B:2d} N={N:6d} {r['method']:18s} {r['ms']:8.4f} ms {r['GBps']:6.0f} GB/s "
                    f"{r['pct_ceiling']:5.1f}%")
            print(line, flush=True)
            out_lines.append(line)
        rows += here
    return ceiling, rows


def summarize_rounds(times: dict, target: float | None = None) -> tuple[list[dict], str | None]:
    """Per-round replay times `{method: [ms per round]}` (the methods timed in turns, the first the reference) ->
    per method `{method, ms, ratio}`: the mean time with its Student-t 95% interval, and the mean of the per-round
    ratios to the first method with its interval (an interval holding 1 is a tie); and, given `target` (ms), where
    the first method stands: "met" (its interval below the target), "missed" (above), or a tie (it holds it)."""
    from quantmla_hf.intervals import t_interval

    names = list(times)
    ref = torch.tensor(times[names[0]], dtype=torch.float64)
    rows = []
    for k in names:
        ms = torch.tensor(times[k], dtype=torch.float64)
        if ms.shape != ref.shape:
            raise ValueError(f"every method needs one time per round: {k} has {ms.numel()}, {names[0]} {ref.numel()}")
        rows.append(dict(method=k, ms=t_interval(ms), ratio=t_interval(ms / ref)))
    if target is None:
        return rows, None
    m = rows[0]["ms"]
    return rows, "met" if m.high < target else ("missed" if m.low > target else "tie (the interval holds it)")


def run_repeats(out_lines, points, ours, bf16_kernel=None, rounds=10, target=None):
    """Every method of each point captured once in a CUDA graph and its replay timed `rounds` times, the methods
    taking turns (the order rotated each round), in one process; reported by `summarize_rounds` (the first of `ours`
    is the reference of the ratios and the method `target` is about)."""
    out = []
    for H, B, N in points:
        g = torch.Generator(device=DEVICE).manual_seed(1)
        q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()
        q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
        lp = torch.zeros(B, dtype=torch.long, device=DEVICE)
        replays, keep = {}, []
        for kernel, name in ours:
            fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            fn = decode_fn(kernel, fmt, N)
            keep.append((fn, args))  # a graph reads the tensors it was captured with (the device-side length in fn)
            replays[f"{name}-{kernel}"] = graphed(lambda fn=fn, args=args: fn(*args))
        kv = torch.randn(B, N, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        q = torch.randn(B, H, D_C + D_R, device=DEVICE, dtype=torch.bfloat16)
        replays["torch-bmm-bf16"] = graphed(lambda: torch_absorbed(q, kv, SCALING))
        if bf16_kernel is not None and B * N * (D_C + D_R) < 2**31:
            keep.append(bf16_kernel_fn(bf16_kernel, B, H, N, kv))  # and its buffers
            replays["vllm-triton-bf16"] = graphed(keep[-1])
        names = list(replays)
        times = {k: [] for k in names}
        for r in range(rounds):
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(bench(replays[k]))
        rows, verdict = summarize_rounds(times, target)
        for row in rows:
            line = (f"repeat H={H:3d} B={B:2d} N={N:6d} {row['method']:20s} {row['ms'].fmt(4)} ms  "
                    f"x{row['ratio'].fmt(3)} of {names[0]}  ({rounds} rounds: "
                    f"{', '.join(f'{t:.4f}' for t in times[row['method']])})")
            print(line, flush=True)
            out_lines.append(line)
            out.append(dict(method=row["method"], H=H, B=B, N=N, ms=row["ms"].to_dict(),
                            ratio_to_first=row["ratio"].to_dict(), times=times[row["method"]]))
        if verdict is not None:
            line = f"repeat H={H:3d} B={B:2d} N={N:6d} {names[0]} against {target} ms: {rows[0]['ms'].fmt(4)}: {verdict}"
            print(line, flush=True)
            out_lines.append(line)
        del replays, keep, kv
        torch.cuda.empty_cache()
    return out


SWEEP = {
    ("C4R4", 16): [dict(), dict(block_t=64), dict(block_t=16), dict(num_warps=8), dict(num_warps=8, block_t=64),
                   dict(num_stages=1), dict(num_stages=3), dict(waves=4), dict(waves=16)],
    ("C2R4", 16): [dict(), dict(block_t=64), dict(num_warps=8), dict(num_stages=3)],
    ("C4R4", 128): [dict(), dict(block_m=32, num_warps=8), dict(block_m=16, num_warps=4), dict(block_t=16),
                    dict(block_m=32, num_warps=4), dict(waves=4)],
}


SWEEP_GLUON = {
    ("C4R4", 16): [dict(), dict(waves=8), dict(waves=8, async_mma=True), dict(waves=16), dict(waves=16, async_mma=True),
                   dict(waves=8, stages=2), dict(waves=12, async_mma=True)],
    ("C2R4", 16): [dict(), dict(waves=8, async_mma=True)],
    ("C4R4", 128): [dict(), dict(waves=8), dict(waves=8, async_mma=True), dict(waves=2)],
}


SWEEP_GLUON_REGS = {
    ("C4R4", 16): [dict(), dict(vote=0), dict(overlap=1), dict(num_splits=16), dict(waves=8), dict(store_a=1)],
    ("C2R4", 16): [dict(), dict(vote=0), dict(overlap=1)],
    ("C8R8", 16): [dict(), dict(vote=0), dict(store_a=1)],
    ("C4R4", 128): [dict()],
}
SWEEP_GLUON_WIDE = {
    ("C4R4", 128): [dict(), dict(vote=0), dict(num_splits=1), dict(num_splits=4)],
}
SWEEP_GLUON_SCALED = {
    ("C4R4", 16): [dict(), dict(waves=4), dict(waves=16), dict(num_warps=8), dict(num_warps=8, maxnreg=128),
                   dict(num_warps=8, maxnreg=128, waves=16), dict(stages=2), dict(stages=2, waves=4)],
    ("C2R4", 16): [dict(), dict(num_warps=8, maxnreg=128), dict(stages=2)],
    ("C4R4", 128): [dict(), dict(block_m=16, num_warps=4, waves=8), dict(block_m=64, num_warps=8),
                    dict(block_m=32, num_warps=8, waves=8)],
}


SWEEP_STRIDED = {
    ("C4R4", 16): [dict(), dict(num_stages=3), dict(num_stages=1), dict(waves=4), dict(waves=16)],
    ("C2R4", 16): [dict()],
    ("C4R4", 128): [dict()],
}


def run_variants(out_lines, points=(("C4R4", 16, 32, 32768), ("C2R4", 16, 32, 32768), ("C8R8", 16, 32, 32768),
                                    ("C4R4", 128, 32, 32768)), kernel="fast"):
    """Launch sweep of the fast (or Gluon) kernel around its defaults at the target points (B 32, 32K), each
    variant replayed from a CUDA graph."""
    sweep = {"gluon": SWEEP_GLUON, "gluon-scaled": SWEEP_GLUON_SCALED, "gluon-regs": SWEEP_GLUON_REGS,
             "gluon-wide": SWEEP_GLUON_WIDE, "strided": SWEEP_STRIDED}.get(kernel, SWEEP)
    res = []
    for name, H, B, N in points:
        if (name, H) in sweep:  # a kernel's sweep names the formats it handles
            fmt, cp, rp, sc, sr, rc, rr = make_cache(name, B, N)
            g = torch.Generator(device=DEVICE).manual_seed(1)
            q_lat = torch.randn(B, H, 1, D_C, device=DEVICE, generator=g).bfloat16()
            q_rot = torch.randn(B, H, 1, D_R, device=DEVICE, generator=g).bfloat16()
            lp = torch.zeros(B, dtype=torch.long, device=DEVICE)
            args = (q_lat, q_rot, cp, rp, fmt, sc, sr, rc, rr, lp, N, SCALING)
            for v in sweep[(name, H)]:
                try:
                    fn = decode_fn(kernel, fmt, N, **v)
                    # replayed from a CUDA graph (the static kernels are built for capture): host time excluded
                    ms = bench(graphed(lambda: fn(*args)) if kernel != "old" else lambda: fn(*args))
                except Exception as e:  # a variant that does not compile (registers, shared memory) is not fatal
                    ms = float("nan")
                    out_lines.append(f"variant {name} H={H} {v}: {type(e).__name__}: {str(e)[:200]}")
                line = f"variant {kernel} {name} H={H} B={B} N={N} {v or 'default'}: {ms:.4f} ms"
                print(line, flush=True)
                out_lines.append(line)
                res.append(dict(method=name, H=H, B=B, N=N, variant=v, ms=ms))
            del cp, rp
            torch.cuda.empty_cache()
    best = {}
    for r in res:
        k = (r["method"], r["H"])
        if r["ms"] == r["ms"] and (k not in best or r["ms"] < best[k][1]):
            best[k] = (r["variant"], r["ms"])
    for (name, H), (v, ms) in best.items():
        line = f"best launch {kernel} {name} H={H}: {v or 'default'} {ms:.4f} ms"
        print(line, flush=True)
        out_lines.append(line)
    return res, {k: v for k, (v, _) in best.items()}


def launch_from_sweep(best, kernel="fast"):
    """Per-(kernel, format, heads) launch overrides for the table from the sweep's winners: the 16-head C4R4 winner
    also for C8R8."""
    launch = {}
    for H in (16, 128):
        for name in ("C4R4", "C2R4", "C8R8"):
            v = best.get((name, H), best.get(("C4R4", H)))
            if v:
                launch[(kernel, name, H)] = v
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-kernels", default="fast", help="comma list of kernels to check: fast, gluon, strided, old")
    ap.add_argument("--check-cases", default="",
                    help="FORMAT:H:B:N:Tq,... cases of --check (default: the full list of run_check)")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--variant-kernels", default="gluon,fast", help="comma list of kernels to sweep: gluon, fast, strided")
    ap.add_argument("--points", default="", help="H:B:N,... timing points (default: the full grid)")
    ap.add_argument("--stock", action="store_true", help="also time the stock transformers step (slow)")
    ap.add_argument("--bf16-kernel", default=os.environ.get("BF16_MLA_KERNEL", ""),
                    help="path to a local copy of vLLM's triton_decode_attention.py (not part of this repository)")
    ap.add_argument("--graph", action="store_true", help="--bench: replay every method from a CUDA graph")
    ap.add_argument("--ours", default="", help="KERNEL:FORMAT,... of ours to time in --bench (default: all of OURS)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget-s", type=float, default=240, help="time budget of the --bench grid")
    ap.add_argument("--gluon-launch", default="", help="KEY=INT,... launch overrides of the Gluon kernel for --check "
                    "and --bench (e.g. async_mma=1,num_warps=8): check a variant before timing it")
    ap.add_argument("--repeat", type=int, default=0, help="--bench --graph: instead of the table, every method of "
                    "each point replayed ROUNDS times in turn, with 95%% intervals of its time and of its ratio to the "
                    "first of --ours")
    ap.add_argument("--target-ms", type=float, default=None, help="--repeat: where the first of --ours stands "
                    "against this time")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the script itself (interpreter, tiny sizes)")
    a = ap.parse_args()
    lines = []
    gluon_launch = {k: int(v) for k, v in (kv.split("=") for kv in a.gluon_launch.split(",") if kv)}
    if a.tiny:
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
    if a.check and "gluon" in a.check_kernels:
        result["unpack_ok"] = check_gluon_unpack(lines)
    if a.check:
        cases = [(f, *(int(x) for x in rest)) for f, *rest in (c.split(":") for c in a.check_cases.split(",") if c)]
        result["check_ok"] = all([run_check(lines, cases=cases or None, kernel=k,
                                            launch=gluon_launch if k.startswith("gluon") else None)
                                  for k in a.check_kernels.split(",") if k])
        result["capacity_ok"] = all([check_capacity_invariance(lines, k) for k in a.check_kernels.split(",")
                                     if k in ("fast", "gluon", "gluon-scaled", "gluon-regs", "gluon-wide")])
    launch = {("gluon", name, H): dict(gluon_launch) for name in CONFIGS for H in (16, 128)} if gluon_launch else {}
    if a.variants:
        result["variants"] = []
        for k in a.variant_kernels.split(","):
            res, best = run_variants(lines, kernel=k)
            result["variants"] += res
            launch.update(launch_from_sweep(best, k))  # the table runs each kernel with its sweep's winners
        lines.append(f"table launch overrides: {launch}")
    if a.bench:
        bf16 = load_bf16_kernel(a.bf16_kernel)
        lines.append(f"BF16 Triton kernel: {a.bf16_kernel if bf16 else 'not given'}")
        points = [tuple(int(x) for x in p.split(":")) for p in a.points.split(",") if p] or None
        ours = [tuple(x.split(":")) for x in a.ours.split(",") if x] or None
        if a.repeat:
            if not a.graph or not points or not ours:
                raise SystemExit("--repeat takes --graph, --points and --ours")
            result["repeats"] = run_repeats(lines, points, ours, bf16, a.repeat, a.target_ms)
        else:
            result["ceiling_GBps"], result["rows"] = run_bench(lines, points=points, budget_s=a.budget_s,
                                                               bf16_kernel=bf16, stock=a.stock, launch=launch,
                                                               ours=ours, graph=a.graph)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_decode.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(a.out, "bench_decode.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if "rows" in result:
        print(f"\n{'method':20s} {'H':>4s} {'B':>3s} {'N':>7s} {'ms':>9s} {'GB/s':>7s} {'%ceil':>6s}")
        for r in result["rows"]:
            print(f"{r['method']:20s} {r['H']:4d} {r['B']:3d} {r['N']:7d} {r['ms']:9.4f} "
                  f"{r.get('GBps', 0):7.0f} {r.get('pct_ceiling', 0):6.1f}")


if __name__ == "__main__":
    main()
