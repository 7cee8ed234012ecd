"""Time `quantize` on DeepSeek-V2-Lite-sized layers with random weights (no download).

    python -m quantmla_hf.calibration.benchmark [--layers 2] [--samples 64] [--seq-len 512] [--steps 100]

Builds a DeepSeek-V2 model with V2-Lite's widths (hidden 2048, 16 heads, d_c 512, d_R 64, no query LoRA,
d_nope 128, d_v 128; layer 0 dense, later layers MoE with 64 experts of 1408, 6 active, 2 shared), calibrates it
with the default "learned" C4R4 settings and prints the seconds per attention layer and the extrapolation to
V2-Lite's 27 layers: `27 * learn + sum_k (k * prefix forward of one decoder layer)`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..config import QuantMLAConfig
from .pipeline import quantize

V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None,
    n_routed_experts=64, moe_intermediate_size=1408, num_experts_per_tok=6, n_shared_experts=2,
    first_k_dense_replace=1, max_position_embeddings=4096,
)
V2_LITE_LAYERS = 27


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="deepseek_v2")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = AutoConfig.for_model(args.model_type, num_hidden_layers=args.layers, **V2_LITE)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (args.samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the prefix cost: one full forward of the calibration windows, per decoder layer
        model(input_ids=ids[:8].to(device), use_cache=False)
        _sync(device)
        start = time.perf_counter()
        for i in range(0, args.samples, args.batch_size):
            model(input_ids=ids[i : i + args.batch_size].to(device), use_cache=False)
        _sync(device)
        forward_per_layer = (time.perf_counter() - start) / args.layers
    cfg = QuantMLAConfig(calibration_samples=args.samples, calibration_seq_len=args.seq_len,
                         calibration_steps=args.steps)
    start = time.perf_counter()
    quantize(model, cfg, ids, batch_size=args.batch_size, progress=False)
    _sync(device)
    total = time.perf_counter() - start
    layers = cfg.extra["calibration"]["layers"]
    learn = layers[0]["seconds"]  # layer 0: its capture runs only the embedding
    n = V2_LITE_LAYERS
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "args": vars(args), "total_seconds": round(total, 2),
        "seconds_per_layer": [e["seconds"] for e in layers],
        "prefix_forward_seconds_per_layer": round(forward_per_layer, 3),
        "extrapolated_27_layers_seconds": round(n * learn + forward_per_layer * n * (n - 1) / 2, 1),
        "objectives": [{p: {k: e[p][k] for k in ("heldout_rtn", "heldout_best", "train_start", "train_best")}
                        for p in ("content", "rope")} for e in layers],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
    }
    print(json.dumps(out, indent=1))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
