"""What a below-BF16 score product would cost in accuracy, before a kernel is built for it: the decode of the packed
positions with the query operand rounded the way an INT8 or FP8 tensor-core product would take it, or with the
dequantized keys rounded to bf16, against the exact decode (the PyTorch reference), as KL against the unquantized
cache and greedy agreement.

    python benchmarks/score_precision.py --text ../shared/data/wikitext-2-raw-test.raw [--bits C4R4,C2R4]
        [--windows 16 --window 512 --prefill 256 --chunk 16] [--model DIR]

Variants (each changes only the score product of the packed positions; the sink and recent copies, the values and
the prefill are the exact reference's):

    exact        the reference decode (fp32 products of the dequantized keys)
    bf16_keys    dequantized keys, and values, rounded to bf16: a kernel with bf16 operands (scores and values)
    int8_q64     the query per row and 64-channel group as symmetric int8 (scale max|q| / 127), the keys as their
                 exact integer codes: an int8 x int8 score product with the scales applied per group afterwards
    fp8_q_row    the query per row scaled into FP8 e4m3 (max 448) and rounded: an FP8 score product
    fp16_keys    the keys of both paths `(code - z) * s` rounded once to fp16 for the scores, the values exact: what
                 the Gluon kernels' scores compute with 2- or 4-bit RoPE (`score_rounding`), here at any width
    fp16_content_keys  the content keys rounded so, the RoPE keys exact: what they compute with 8-bit RoPE
    fp16_partials  the exact scores and values, the positions cut into splits of `PARTIAL_SPLIT` (each a normalised
                 partial output stored as fp16 `o_s * 2**-8`, its LSE in fp32) merged by `combine_ref`: what the
                 split kernel stores (`backends.partial_dtype`), here over every position, copies included

Each variant is scored with `benchmarks/accuracy.py`'s windows (teacher-forced decode, `--chunk` tokens a step), KL
per window against the unquantized cache, and its ratio to the exact decode's KL with a paired 95% bootstrap interval
(`quantmla_hf.evaluation.intervals`). Runs on the CPU (the reference path), the embedded model by default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy as acc  # noqa: E402

from quantmla_hf import QuantMLAConfig  # noqa: E402
from quantmla_hf.embedded import REFERENCE_MODEL  # noqa: E402
from quantmla_hf.evaluation.intervals import bootstrap, ratio_of_means  # noqa: E402
from quantmla_hf.kernels import mla_decode_ref as ref  # noqa: E402
from quantmla_hf.kernels.mla_decode_ref import FP16_PARTIAL_SCALE, combine_ref  # noqa: E402
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref  # noqa: E402
from quantmla_hf.ops import decode as decode_op  # noqa: E402

VARIANTS = ("exact", "bf16_keys", "int8_q64", "fp8_q_row", "fp16_keys", "fp16_content_keys", "fp16_partials")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
PARTIAL_SPLIT = 256  # positions per simulated split: the Gluon kernels' shortest (4 tiles of 64)


def int8_per_group(q: torch.Tensor, group: int = 64) -> torch.Tensor:
    """`q: [..., D]` rounded to symmetric int8 per `group` channels (scale `max|q_g| / 127`), returned dequantized."""
    g = q.reshape(*q.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
    return (torch.round(g / scale).clamp(-127, 127) * scale).reshape(q.shape)


def fp8_per_row(q: torch.Tensor) -> torch.Tensor:
    """`q: [..., D]` scaled per row into float8 e4m3's range, rounded to it and scaled back."""
    scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (q / scale).to(torch.float8_e4m3fn).to(q.dtype) * scale


def fp16_split_merge(scores: torch.Tensor, values: torch.Tensor, split: int = PARTIAL_SPLIT):
    """Attention of masked `scores: [B, H, Tq, N]` (-inf where not visible) over `values: [B, N, d]` as split-K with
    fp16 partials: per `split` positions a normalised output rounded as `o_s * 2**-8` to fp16 and its LSE, merged by
    `combine_ref`. Returns `(o [B, H, Tq, d], lse [B, H, Tq])` in the scores' dtype."""
    parts, lses = [], []
    for j in range(0, scores.shape[-1], split):
        s = scores[..., j:j + split]
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        parts.append(((p @ values[:, None, j:j + split]) * FP16_PARTIAL_SCALE).half())
        lses.append(lse)
    o, lse = combine_ref(torch.stack(parts, -2), torch.stack(lses, -1))
    return o.to(scores.dtype), lse.to(scores.dtype)


calls = [0]  # decodes run by the current variant


def decode_variant(variant: str):
    """`mla_decode_static_ref` with the packed positions' score product (and for `bf16_keys` their values) computed
    as `variant` says; the copies' positions as the reference computes them."""

    def run(q_lat, q_rot, content, rope, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length, capacity,
            scaling, out=None, dtype=torch.float32):
        calls[0] += 1
        B, H, Tq, _ = q_lat.shape
        S, R = fmt.sink_tokens, fmt.recent_tokens
        c = ref.history_ref(content, fmt.content, sink_c, recent_c, left_padding, length, S, R, dtype)[:, :capacity]
        r = ref.history_ref(rope, fmt.rope, sink_r, recent_r, left_padding, length, S, R, dtype)[:, :capacity]
        q, qr = q_lat.to(dtype), q_rot.to(dtype)
        scores = (q @ c.unsqueeze(1).transpose(-1, -2) + qr @ r.unsqueeze(1).transpose(-1, -2)) * scaling
        pos = torch.arange(c.shape[1], device=c.device)
        n = length.reshape(())
        slot = pos[None, :] - left_padding.reshape(B, 1)
        packed = (pos[None, :] < n) & (pos[None, :] < n - R) & ~((slot >= 0) & (slot < S))  # [B, N]
        values = c
        if variant not in ("exact", "fp16_partials") and fmt.content.quantized:
            pc = dequantize_ref(content["codes"], content["scale"], content["zero"], fmt.content, dtype)[:, :capacity]
            pr = dequantize_ref(rope["codes"], rope["scale"], rope["zero"], fmt.rope, dtype)[:, :capacity]
            if variant == "bf16_keys":
                pc, pr = pc.bfloat16().to(dtype), pr.bfloat16().to(dtype)
                values = torch.where(packed[..., None], pc, c)
            elif variant in ("fp16_keys", "fp16_content_keys"):  # dequantized in fp32 (exact), rounded once
                pc = pc.half().to(dtype)
                pr = pr.half().to(dtype) if variant == "fp16_keys" else pr
            else:
                rounder = int8_per_group if variant == "int8_q64" else fp8_per_row
                q, qr = rounder(q), rounder(qr)
            low = (q @ pc.unsqueeze(1).transpose(-1, -2) + qr @ pr.unsqueeze(1).transpose(-1, -2)) * scaling
            scores = torch.where(packed[:, None, None, :], low, scores)
        limit = n - Tq + 1 + torch.arange(Tq, device=c.device)
        visible = (pos[None, None, :] >= left_padding.reshape(B, 1, 1)) & (pos[None, None, :] < limit[None, :, None])
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        if variant == "fp16_partials":
            o, lse = fp16_split_merge(scores, values)
        else:
            lse = torch.logsumexp(scores, dim=-1)
            o = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0) @ values.unsqueeze(1)
        o, lse = o.float(), lse.float()
        if out is not None:
            out[0].copy_(o)
            out[1].copy_(lse)
            return out
        return o, lse

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", required=True, help="evaluation text (e.g. WikiText-2 test)")
    ap.add_argument("--model", default=str(REFERENCE_MODEL))
    ap.add_argument("--bits", default="C4R4,C2R4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = acc.token_ids(tokenizer, acc.read_text(a.text, max_chars=a.windows * a.window * 12))
    shape = dict(window=a.window, prefill=a.prefill, chunk=a.chunk, n_windows=a.windows, batch=a.batch)
    t0 = time.time()
    base = acc.Method("bf16", 16, 16, True)
    _, ref_lp = acc.window_scores(model, ids, acc.make_cache_factory(base, model.config), **shape)
    print(f"model {a.model}, {a.windows} windows of {a.window} (prefill {a.prefill}, chunks of {a.chunk})")
    print("| format | variant | KL vs BF16 cache | ratio to exact [95% CI] | top-1 agreement |")
    print("| --- | --- | --- | --- | --- |")
    saved = decode_op.mla_decode_static_ref
    try:
        for cb, rb in acc.parse_bits(a.bits):
            # the attention swap decodes in the latent space from the packed planes (the path a kernel takes)
            qconfig = QuantMLAConfig(content_bits=cb, rope_bits=rb, transform="none", advanced={"kernel": "torch"})
            qmodel = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                          quantization_config=qconfig).eval()
            method = acc.Method("rtn", cb, rb, True)
            exact = None
            for variant in a.variants.split(","):
                calls[0] = 0
                decode_op.mla_decode_static_ref = decode_variant(variant)
                scores, _ = acc.window_scores(qmodel, ids, acc.make_cache_factory(method, qmodel.config),
                                              ref=ref_lp, **shape)
                if not calls[0]:
                    raise RuntimeError("the packed-cache decode never ran: nothing was measured")
                exact = scores if variant == "exact" else exact
                ratio = bootstrap(ratio_of_means, scores["kl"], exact["kl"]) if exact is not None else None
                shown = "1" if variant == "exact" else (ratio.fmt() if ratio else "-")
                print(f"| C{cb}R{rb} | {variant} | {scores['kl'].mean():.5f} | {shown} | "
                      f"{scores['top1'].mean():.4f} |", flush=True)
    finally:
        decode_op.mla_decode_static_ref = saved
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
