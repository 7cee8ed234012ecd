"""QuantMLA beyond one GPU: tensor-parallel and device-map agreement with one GPU, TP decode speed and memory.

Stages (run in this order; `--out DIR` holds the checkpoints and the JSON results):

    python benchmarks/bench_multi_gpu.py build --out DIR [--layers 27]       # checkpoints (random weights)
    python benchmarks/bench_multi_gpu.py reference --out DIR                 # one GPU: greedy tokens, device maps
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py agree --out DIR     # TP: the same runs, compared
    python benchmarks/bench_multi_gpu.py speed --out DIR                     # one GPU: V2-Lite-shaped decode
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py speed --out DIR     # the same under TP
    python benchmarks/bench_multi_gpu.py report --out DIR                    # tables
    python benchmarks/bench_multi_gpu.py precision --out DIR [--families minicpm3]  # 1-process noise baseline

Agreement: every MLA family (tiny widths except the real MLA ones: d_c 512, d_R 64, 16 heads of 128 + 64, 4 layers,
MoE where the family has it, random weights), prompt batch 2 with left padding (200 and 160 real tokens), greedy
`--new` tokens with the QuantMLA cache (C4R4 and C16R16, transform "none", native decode, Triton kernels). Reported:
the fraction of generated tokens equal to one GPU's and the first step where they differ (float32 models: a
correctness check, the only difference is the reduction order of o_proj/down_proj; bfloat16: what a user sees).
Device map: layers spread over cuda:0 and cuda:1 with one layer offloaded to the CPU, same comparison, and the
device of every layer's cache planes.

Speed: a DeepSeek-V2-Lite-shaped model (27 layers, real attention widths, dense MLP of intermediate 10944 in every
layer, vocab 102400, random bf16 weights; as benchmarks/bench_generate.py builds it) at batch 8 and 32K context:
decode tokens/s over `--steps` greedy one-token steps after a chunked prefill, on one GPU and under TP over two
(attention and MLP sharded by heads/columns, the latent cache replicated on each rank). Memory: per-GPU decode peak
at two contexts gives bytes per token (slope) and a fixed part; the largest context per sequence at batch 8 that
fits the GPU follows; the QuantMLA cache's own bytes per rank are reported (the same on every rank: replicated).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

import torch

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3")
MLA_WIDTHS = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=4096, intermediate_size=1024,
                  max_position_embeddings=4096)
FAMILY_EXTRA = {
    "deepseek_v2": dict(num_hidden_layers=4, q_lora_rank=None, first_k_dense_replace=1, n_routed_experts=8,
                        moe_intermediate_size=256, num_experts_per_tok=2, n_shared_experts=1),
    "deepseek_v3": dict(num_hidden_layers=4, q_lora_rank=384, first_k_dense_replace=1, n_routed_experts=8,
                        moe_intermediate_size=256, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1),
    "glm4_moe_lite": dict(num_hidden_layers=4, q_lora_rank=384, first_k_dense_replace=1, n_routed_experts=8,
                          moe_intermediate_size=256, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                          topk_group=1),
    "longcat_flash": dict(num_layers=2, q_lora_rank=384, n_routed_experts=8, moe_topk=2, expert_ffn_hidden_size=256,
                          ffn_hidden_size=1024, head_dim=64),
    "minicpm3": dict(num_hidden_layers=4, q_lora_rank=384),
}
# bfloat16 (the Triton decode kernel does not compile for float32 queries with Triton 3.6: see docs/MULTI_GPU.md);
# the float32 check of TP against one process is tests/test_tensor_parallel.py (CPU, logits within 1e-4).
CASES = [(f, "bfloat16", b) for f in FAMILIES for b in (4, 16)]
SPEED_POINTS = [(8, 32768), (8, 16384)]  # (batch, context): the first is timed; both give the memory slope
# `--smoke`: the same stages on the CPU (gloo) at toy sizes, to check the script before a GPU run.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def log(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


def save_json(out: str, name: str, obj) -> None:
    if rank() == 0:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)


def qconfig(bits: int):
    from quantmla_hf import QuantMLAConfig

    return QuantMLAConfig(content_bits=bits, rope_bits=bits, transform="none", cache_block_size=1024)


def tp_kwargs(form: str) -> dict:
    if world() == 1:
        return {}
    if form == "tp_plan":
        return {"tp_plan": "auto"}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def first_device() -> str:
    return "cuda:0" if DEV == "cuda" else "cpu"


def reset_peak() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if DEV == "cuda" else 0


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------- build
def build(a) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantmla_hf.tiny_models import tiny_config

    for family in sorted({c[0] for c in CASES}):
        for dtype in sorted({c[1] for c in CASES}):
            path = os.path.join(a.out, f"{family}-{dtype}")
            if os.path.exists(path):
                continue
            torch.manual_seed(0)
            cfg = tiny_config(family, **{**MLA_WIDTHS, **FAMILY_EXTRA[family]})
            with torch.device(DEV):
                model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
            model.save_pretrained(path)
    path = os.path.join(a.out, "v2lite")
    if a.speed_model and not os.path.exists(path):
        dims = dict(hidden_size=2048, intermediate_size=10944, num_attention_heads=16, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400)
        if a.smoke:
            dims.update(hidden_size=256, intermediate_size=256, vocab_size=512)
        cfg = AutoConfig.for_model("deepseek_v2", num_hidden_layers=a.layers, num_key_value_heads=16, q_lora_rank=None,
                                   first_k_dense_replace=a.layers, max_position_embeddings=163840, **dims)
        torch.manual_seed(0)
        with torch.device(DEV):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
    print("checkpoints in", a.out, flush=True)


# ------------------------------------------------------------------------------------------------------- agreement
def prompt(vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (2, 200), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :40], mask[1, :40] = 0, 0
    return ids.to(device), mask.to(device)


def greedy(model, new: int) -> torch.Tensor:
    ids, mask = prompt(model.config.vocab_size, model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return out[:, ids.shape[1]:].cpu()


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    same = ref == got
    diverged = (~same).any(0).nonzero()
    return dict(equal=float(same.float().mean()), first_diff=int(diverged[0]) if len(diverged) else None)


def reference(a) -> None:
    from transformers import AutoModelForCausalLM

    import quantmla_hf  # noqa: F401  registers "quantmla"

    refs, rows = {}, []
    for family, dtype, bits in CASES:
        path = os.path.join(a.out, f"{family}-{dtype}")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(bits), device_map=first_device())
        refs[f"{family}-{dtype}-C{bits}R{bits}"] = greedy(model, a.new).tolist()
        del model
    # Device map: layers over both GPUs, the last decoder layer offloaded to the CPU (runs on cuda:0).
    for family in ("deepseek_v2", "deepseek_v3") if torch.cuda.device_count() >= 2 else ():
        for dtype in ("bfloat16",):
            path = os.path.join(a.out, f"{family}-{dtype}")
            n = FAMILY_EXTRA[family]["num_hidden_layers"]
            device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
            device_map.update({f"model.layers.{i}": (0 if i < n // 2 else 1) for i in range(n - 1)})
            device_map[f"model.layers.{n - 1}"] = "cpu"
            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(4), device_map=device_map)
            ids, mask = prompt(model.config.vocab_size, "cuda:0")
            out = model.generate(ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                                 pad_token_id=0, return_dict_in_generate=True)
            from quantmla_hf.integration import generated_cache

            planes = [str(layer.content.planes["codes"].device) for layer in generated_cache(out).layers]
            got = out.sequences[:, ids.shape[1]:].cpu()
            row = dict(case=f"{family}-{dtype}-C4R4", setup="device_map cuda:0/cuda:1 + 1 layer CPU-offloaded",
                       cache_planes=planes, **compare(torch.tensor(refs[f"{family}-{dtype}-C4R4"]), got))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
    save_json(a.out, "reference_tokens.json", refs)
    save_json(a.out, "device_map.json", rows)


def agree(a) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import quantmla_hf  # noqa: F401

    refs = json.load(open(os.path.join(a.out, "reference_tokens.json")))
    rows = []
    for i, (family, dtype, bits) in enumerate(CASES):
        form = "tp_plan" if i % 2 == 0 else "distributed_config"
        path = os.path.join(a.out, f"{family}-{dtype}")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qconfig(bits), **tp_kwargs(form))
        name = f"{family}-{dtype}-C{bits}R{bits}"
        attn = quantmla_hf.hooks.mla_attention_modules(model)[0]
        sharded = type(attn.kv_b_proj.weight).__name__ == "DTensor" and "Shard" in str(attn.kv_b_proj.weight.placements)
        got = greedy(model, a.new)
        gathered = [None] * world()
        dist.all_gather_object(gathered, got.tolist())
        row = dict(case=name, setup=f"TP x{world()} ({form})", attention_sharded=sharded,
                   ranks_identical=all(g == gathered[0] for g in gathered), **compare(torch.tensor(refs[name]), got))
        rows.append(row)
        log(json.dumps(row))
        del model
    save_json(a.out, "tp_agreement.json", rows)


def precision(a) -> None:
    """Noise baseline in one process: the same bf16 weights computed in bf16 and in float32 (C16R16, torch decode)."""
    from transformers import AutoModelForCausalLM

    from quantmla_hf import QuantMLAConfig, apply_quantmla
    from quantmla_hf.tiny_models import tiny_config

    for family in sorted({c[0] for c in CASES}):
        torch.manual_seed(0)
        cfg = tiny_config(family, **{**MLA_WIDTHS, **FAMILY_EXTRA[family]})
        q = QuantMLAConfig(content_bits=16, rope_bits=16, transform="none", kernel="torch")
        bf16 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(first_device()).eval()
        fp32 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(first_device()).eval()
        fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
        outs = [greedy(apply_quantmla(m, q), a.new) for m in (bf16, fp32)]
        log(json.dumps(dict(case=f"{family}-bfloat16-C16R16", setup="1 process: bf16 vs float32 compute",
                            **compare(*outs))))


# ----------------------------------------------------------------------------------------------------------- speed
@torch.no_grad()
def decode_run(model, bits: int, B: int, N: int, steps: int) -> dict:
    from quantmla_hf import QuantMLACache

    cache = QuantMLACache(config=model.config, quantization_config=qconfig(bits))
    kw = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(0, model.config.vocab_size, (B, N), generator=torch.Generator().manual_seed(0)).to(DEV)
    mask = torch.ones_like(ids)
    reset_peak()
    for s in range(0, N, 8192):
        out = model(ids[:, s : s + 8192], attention_mask=mask[:, : s + 8192], **{kw: cache}, logits_to_keep=1)
    prefill_peak = peak()
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(2):  # untimed: compilation
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        tok = model(tok, attention_mask=mask, **{kw: cache}, logits_to_keep=1).logits[:, -1:].argmax(-1)
    sync()
    if world() > 1:
        torch.distributed.barrier()
    reset_peak()
    t = time.perf_counter()
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        tok = model(tok, attention_mask=mask, **{kw: cache}, logits_to_keep=1).logits[:, -1:].argmax(-1)
    sync()
    dt = time.perf_counter() - t
    row = dict(gpus=world(), method=f"C{bits}R{bits}", B=B, N=N, tok_s=B * steps / dt, ms_per_step=1000 * dt / steps,
               prefill_peak_GiB=prefill_peak / 2**30, decode_peak_GiB=peak() / 2**30,
               cache_GiB_per_gpu=cache.nbytes() / 2**30)
    del cache, out
    return row


def speed(a) -> None:
    from transformers import AutoModelForCausalLM

    import quantmla_hf  # noqa: F401

    path = os.path.join(a.out, "v2lite")
    kwargs = tp_kwargs("tp_plan") if world() > 1 else {"device_map": first_device()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()
    quantmla_hf.install_cache_hooks(model)
    model.set_attn_implementation("quantmla")
    weights = torch.cuda.memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    rows = []
    for bits in (16, 4):
        for B, N in (SPEED_POINTS if not a.smoke else [(2, 96), (2, 48)]):
            row = dict(decode_run(model, bits, B, N, a.steps), weights_GiB_per_gpu=weights)
            rows.append(row)
            log(json.dumps(row))
    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if DEV == "cuda" else 1.0
    name = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    save_json(a.out, f"speed_{world()}gpu.json", dict(rows=rows, gpu_GiB=total, gpu=name))


# ---------------------------------------------------------------------------------------------------------- report
def report(a) -> None:
    def load(name):
        p = os.path.join(a.out, name)
        return json.load(open(p)) if os.path.exists(p) else None

    agreement = (load("tp_agreement.json") or []) + (load("device_map.json") or [])
    if agreement:
        print("\n| case | setup | attention sharded | tokens equal to 1 GPU | first differing step |")
        print("|---|---|---|---|---|")
        for r in agreement:
            print(f"| {r['case']} | {r['setup']} | {r.get('attention_sharded', '-')} | {100 * r['equal']:.1f}% | "
                  f"{r['first_diff'] if r['first_diff'] is not None else 'none'} |")
        for r in agreement:
            if "cache_planes" in r:
                print(f"{r['case']} device map, cache planes per layer: {r['cache_planes']}")
    runs = [load(f"speed_{g}gpu.json") for g in (1, 2)]
    runs = [r for r in runs if r]
    if not runs:
        return
    print("\n| GPUs | cache | batch x context | decode tok/s | ms/step | weights GiB/GPU | QuantMLA cache GiB/GPU |"
          " decode peak GiB/GPU | prefill peak GiB/GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for r in run["rows"]:
            print(f"| {r['gpus']} | {r['method']} | {r['B']}x{r['N']} | {r['tok_s']:.1f} | {r['ms_per_step']:.2f} | "
                  f"{r['weights_GiB_per_gpu']:.2f} | {r['cache_GiB_per_gpu']:.2f} | {r['decode_peak_GiB']:.2f} | "
                  f"{r['prefill_peak_GiB']:.2f} |")
    print("\nPer GPU at batch 8: decode peak = fixed + slope x context (two measured contexts); the largest context "
          "per sequence whose decode peak fits the GPU follows. The QuantMLA cache is replicated on every TP rank; "
          "'if head-sharded' (computed, not run) halves its per-token bytes to show what replication costs.")
    print("| GPUs | cache | cache bytes per token and sequence, per GPU | decode peak slope, bytes per token and sequence |"
          " fixed GiB | largest context at batch 8 | if head-sharded |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        budget = run["gpu_GiB"] * 2**30
        for method in ("C16R16", "C4R4"):
            pts = sorted((r for r in run["rows"] if r["method"] == method), key=lambda r: r["N"])
            if len(pts) < 2 or pts[1]["decode_peak_GiB"] <= pts[0]["decode_peak_GiB"]:
                continue  # no device memory counter (CPU smoke run)
            B, gpus = pts[0]["B"], pts[0]["gpus"]
            (n0, p0), (n1, p1) = [(r["N"], r["decode_peak_GiB"] * 2**30) for r in pts[:2]]
            c0, c1 = pts[0]["cache_GiB_per_gpu"] * 2**30, pts[1]["cache_GiB_per_gpu"] * 2**30
            slope, cache_slope = (p1 - p0) / (n1 - n0), (c1 - c0) / (n1 - n0)
            fixed = p0 - slope * n0
            fit = int((budget - fixed) / slope)
            sharded = f"{int((budget - fixed) / (slope - cache_slope / 2))}" if gpus > 1 else "-"
            print(f"| {gpus} | {method} | {cache_slope / B:.0f} | {slope / B:.0f} | {fixed / 2**30:.2f} | {fit} | {sharded} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=["build", "reference", "agree", "precision", "speed", "report"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per agreement run")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--no-speed-model", dest="speed_model", action="store_false", help="build: skip the V2-Lite model")
    ap.add_argument("--smoke", action="store_true", help="toy speed model (CPU check of the script)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="families of the agreement runs")
    a = ap.parse_args()
    CASES[:] = [c for c in CASES if c[0] in a.families.split(",")]
    os.makedirs(a.out, exist_ok=True)
    if world() > 1:
        import torch.distributed as dist

        if DEV == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    try:
        stages = dict(build=build, reference=reference, agree=agree, precision=precision, speed=speed, report=report)
        stages[a.stage](a)
    finally:
        if world() > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
