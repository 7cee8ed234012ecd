"""Calibration time and peak memory of `quantmla_hf.calibration.calibrate`, on models built with random weights.

    python benchmarks/bench_calibration.py [--model v2-lite smollm2-mla] [--layers N] [--samples 64] \\
        [--seq-len 512] [--steps 100] [--batch-size 8] [--dtype bfloat16] [--json OUT.json]

    python benchmarks/bench_calibration.py --default-quantize [--json OUT.json]

`--default-quantize` times what `quantmla quantize REFERENCE_MODEL --out DIR` does without text (the embedded 14.8 M
model in bf16, "auto" learned on the package's default text with the library's recipe), and prints the total, the
seconds per layer, the thread count per layer and the estimate the log gave before learning. `--short-recipe` runs it
with `quantmla_hf.calibration.plan.SHORT_RECIPE` instead. The rest times models built with random weights:

Models (no download; random weights give the cost, not the quality: every path runs its fixed `--steps` Adam
steps whatever the weights, so the time and memory are those of the real checkpoint of the same shape):
- `v2-lite`: DeepSeek-V2 with DeepSeek-V2-Lite's shapes (27 layers, hidden 2048, 16 heads, d_c 512, d_R 64, no query
  LoRA, d_nope 128, d_v 128; layer 0 dense 10944, later layers MoE: 64 experts of 1408, 6 active, 2 shared;
  vocab 102400): 15.7 B parameters, 31 GB in bf16.
- `smollm2-mla`: the config `benchmarks/real_model/convert.py` writes for SmolLM2-135M (30 dense layers, hidden 576,
  9 heads, d_c 256, d_R 64, head dims 64, vocab 49152).

Default calibration settings ("learned" C4R4, 64 windows of 512 tokens, 100 steps per path, batch 8, the protection
modelled), the model built directly on the GPU in `--dtype`. Printed: a table per model with the total seconds, the
seconds per attention layer (min / median / max), the peak GPU memory, the weights' memory and the peak minus the
weights (what calibration adds: one layer's activations and learning state), and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from quantmla_hf.calibration import calibrate
from quantmla_hf.config import QuantMLAConfig

HERE = Path(__file__).resolve().parent

V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
    n_routed_experts=64, moe_intermediate_size=1408, num_experts_per_tok=6, n_shared_experts=2,
    first_k_dense_replace=1, max_position_embeddings=4096, num_hidden_layers=27,
)
# SmolLM2-135M-Instruct's Llama config (the GGUF's), as benchmarks/real_model/convert.py reads it.
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def model_config(name: str, layers: int | None):
    if name == "v2-lite":
        kw = dict(V2_LITE)
        if layers:
            kw["num_hidden_layers"] = layers
        return AutoConfig.for_model("deepseek_v2", **kw)
    if name == "smollm2-mla":
        sys.path.insert(0, str(HERE / "real_model"))
        from convert import ConversionSettings, deepseek_config

        llama = LlamaConfig(**{**SMOLLM2, **({"num_hidden_layers": layers} if layers else {})})
        return deepseek_config(llama, ConversionSettings())
    raise ValueError(f"unknown --model {name!r}: v2-lite or smollm2-mla")


def run(name: str, args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = model_config(name, args.layers)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    build = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    cfg = QuantMLAConfig(transform="learned",
                         advanced={"calibration_samples": args.samples, "calibration_seq_len": args.seq_len,
                                   "calibration_steps": args.steps})
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ckpt = Path(args.checkpoint_dir) / name if args.checkpoint_dir else None  # one directory per model
    calibrate(model, cfg, ids, batch_size=args.batch_size, progress=args.progress, checkpoint_dir=ckpt)
    if device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    seconds = [e["seconds"] for e in cfg.extra["calibration"]["layers"]]
    out = {
        "model": name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "layers": config.num_hidden_layers, "params": params, "dtype": args.dtype,
        "windows": [args.samples, args.seq_len], "steps": args.steps, "batch_size": args.batch_size,
        "build_seconds": round(build, 1), "total_seconds": round(total, 2),
        "attention_seconds": [round(s, 3) for s in seconds],
        "propagate_and_capture_seconds": round(total - sum(seconds), 2),
        "weights_gib": round(weights / 2**30, 2), "peak_gib": round(peak / 2**30, 2),
        "peak_minus_weights_gib": round((peak - weights) / 2**30, 2),
    }
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def default_quantize(args) -> dict:
    """`quantmla quantize REFERENCE_MODEL --out DIR`'s path in this process, timed: the embedded model as
    `from_pretrained` loads it (bf16), its tokenizer, `quantmla_hf.quantize(model, QuantMLAConfig(), tokenizer=...)`
    (no text: "auto" resolves to learned on the package's default text; with `args.short_recipe` the short recipe)."""
    from quantmla_hf.calibration.plan import SHORT_RECIPE
    import platform

    from transformers import AutoTokenizer

    import quantmla_hf
    from quantmla_hf.embedded import REFERENCE_MODEL

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL).eval()
    load = time.perf_counter() - start
    threads_before = torch.get_num_threads()
    start = time.perf_counter()
    config = QuantMLAConfig(advanced=SHORT_RECIPE if args.short_recipe else None)
    quantmla_hf.quantize(model, config, tokenizer=tokenizer, progress=args.progress)
    total = time.perf_counter() - start
    cfg = model.config.quantization_config
    record = cfg.extra["calibration"]
    seconds = [e["seconds"] for e in record["layers"]]
    return {
        "model": "embedded reference model (default quantize)", "device": "cpu", "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "load_seconds": round(load, 2), "total_seconds": round(total, 2), "transform": cfg.transform,
        "cache": cfg.name, "windows": record["windows"], "steps": record["steps"], "lr": record["lr"],
        "protection": record["protection"], "threads": [e.get("threads") for e in record["layers"]],
        "threads_before": threads_before,
        "estimated_seconds": record.get("estimated_seconds"), "attention_seconds": [round(x, 2) for x in seconds],
        "propagate_and_capture_seconds": round(total - sum(seconds), 2),
        "selected": [[e[p]["selected"] for p in ("content", "rope")] for e in record["layers"]],
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | layers | params | total s | s per attention layer (min / median / max) | peak GiB | weights GiB "
             "| peak - weights GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["attention_seconds"]
        lines.append(f"| {r['model']} | {r['layers']} | {r['params'] / 1e9:.3f} B | {r['total_seconds']} | "
                     f"{min(s):.2f} / {statistics.median(s):.2f} / {max(s):.2f} | {r['peak_gib']} | "
                     f"{r['weights_gib']} | {r['peak_minus_weights_gib']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["smollm2-mla", "v2-lite"], choices=["smollm2-mla", "v2-lite"])
    p.add_argument("--layers", type=int, default=None, help="override the layer count (default: the real one)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--checkpoint-dir", default=None, help="write resumable per-layer checkpoints under DIR/MODEL")
    p.add_argument("--progress", action="store_true", help="show quantize's progress bar")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--default-quantize", action="store_true",
                   help="instead: time the default quantize of the embedded model (`quantmla quantize REFERENCE_MODEL "
                        "--out DIR` without text) in this process, on this machine (CPU or GPU)")
    p.add_argument("--short-recipe", action="store_true", help="with --default-quantize: the short recipe "
                   "(quantmla_hf.calibration.plan.SHORT_RECIPE) instead of the library's")
    args = p.parse_args(argv)
    if args.default_quantize:
        row = default_quantize(args)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
        return [row]
    rows = []
    for name in args.model:
        rows.append(run(name, args))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
