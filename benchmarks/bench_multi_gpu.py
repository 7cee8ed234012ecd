"""QuantMLA beyond one GPU: agreement of tensor parallel and device maps with one GPU; decode speed and memory of one
GPU, tensor parallel over two and a device map over two, through plain `generate()`.

Stages (`--out DIR` holds the checkpoints and the JSON results):

    python benchmarks/bench_multi_gpu.py build --out DIR [--layers 27]       # checkpoints (random weights)
    python benchmarks/bench_multi_gpu.py reference --out DIR                 # one GPU: greedy tokens, device maps
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py agree --out DIR     # TP: the same runs, compared
    python benchmarks/bench_multi_gpu.py precision --out DIR [--families minicpm3]  # 1-process noise baseline
    # speed, for each --model (v2lite, v3lite) and --dtype (bfloat16; float32 with --points 8x4096 for exactness):
    python benchmarks/bench_multi_gpu.py speed --out DIR --model v2lite                        # one GPU
    torchrun --nproc-per-node 2 benchmarks/bench_multi_gpu.py speed --out DIR --model v2lite   # TP over two
    python benchmarks/bench_multi_gpu.py speed --out DIR --model v2lite --device-map           # map over two
    python benchmarks/bench_multi_gpu.py report --out DIR                    # tables

Agreement: every MLA family (tiny widths except the real MLA ones: d_c 512, d_R 64, 16 heads of 128 + 64, 4 layers,
MoE where the family has it, random weights), prompt batch 2 with left padding (200 and 160 real tokens), greedy
`--new` tokens with the QuantMLA cache (C4R4 and C16R16, transform "none", native decode, Triton kernels). Reported:
the fraction of generated tokens equal to one GPU's and the first step where they differ (float32 models: a
correctness check, the only difference is the reduction order of o_proj/down_proj; bfloat16: what a user sees).
Device map: layers spread over cuda:0 and cuda:1 with one layer offloaded to the CPU (decoded eagerly), same
comparison, and the device of every layer's cache planes.

Speed: DeepSeek-V2-Lite-shaped models (27 layers, real attention widths, dense MLP of intermediate 10944 in every
layer, vocab 102400, random weights; as benchmarks/bench_generate.py builds them), `v2lite` a deepseek_v2 (its
tensor-parallel plan splits attention by heads) and `v3lite` the same weights' shape as deepseek_v3 (whose plan splits
only the MLP up to transformers 5.24 and attention too from 5.25: the row says which). Each setup loads the same
checkpoint with QuantMLAConfig C4R4 (transform "none") and runs plain `generate()` (decode steps replayed from CUDA
graphs: one GPU, each TP rank with the all-reduces inside its graph, the device map with one graph per GPU's
segment) on the same random prompts at each `--points` (batch x context), in one process per GPU setup:
- the first call of the shape (`--steps` + 2 greedy tokens: prefill, capture, replays);
- ms per new token `(t(steps + 2) - t(2)) / steps` over later calls, and the median step through generate;
- peak memory per GPU over that call (`torch.cuda.max_memory_allocated` of every GPU the setup uses), the weights
  and the QuantMLA cache per GPU (replicated on every TP rank), captures and replays;
- the greedy tokens, which `report` compares with one GPU's (float32: exactness; bfloat16: what users see).
`--smoke`: the same stages on the CPU (gloo) at toy sizes, to check the script before a GPU run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
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
# bfloat16, what users run; float32 exactness against one process: tests/test_tensor_parallel.py (CPU, logits
# within 1e-4) and the speed stage's `--dtype float32`.
CASES = [(f, "bfloat16", b) for f in FAMILIES for b in (4, 16)]
SPEED_POINTS = "8x32768,32x32768"  # batch x context of the speed stage (`--points`)
SPEED_MODELS = {"v2lite": "deepseek_v2", "v3lite": "deepseek_v3"}
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

    return QuantMLAConfig(content_bits=bits, rope_bits=bits, transform="none", advanced={"cache_block_size": 1024})


def tp_kwargs(form: str) -> dict:
    if world() == 1:
        return {}
    if form == "tp_plan":
        return {"tp_plan": "auto"}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def first_device() -> str:
    return "cuda:0" if DEV == "cuda" else "cpu"


def sync() -> None:
    for gpu in range(torch.cuda.device_count() if DEV == "cuda" else 0):
        torch.cuda.synchronize(gpu)


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
    for name, family in SPEED_MODELS.items() if a.speed_model else ():
        path = os.path.join(a.out, name)
        if os.path.exists(path):
            continue
        dims = dict(hidden_size=2048, intermediate_size=10944, num_attention_heads=16, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400)
        if a.smoke:
            dims.update(hidden_size=256, intermediate_size=256, vocab_size=512)
        cfg = AutoConfig.for_model(family, num_hidden_layers=a.layers, num_key_value_heads=16, q_lora_rank=None,
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
        attn = quantmla_hf.attention.state.mla_attention_modules(model)[0]
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
        q = QuantMLAConfig(content_bits=16, rope_bits=16, transform="none", advanced={"kernel": "torch"})
        bf16 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(first_device()).eval()
        fp32 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(first_device()).eval()
        fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
        outs = [greedy(apply_quantmla(m, q), a.new) for m in (bf16, fp32)]
        log(json.dumps(dict(case=f"{family}-bfloat16-C16R16", setup="1 process: bf16 vs float32 compute",
                            **compare(*outs))))


# ----------------------------------------------------------------------------------------------------------- speed
def split_map(config, gpus: int) -> dict:
    """A device map over `gpus` GPUs: the decoder layers in equal contiguous runs, the embedding with the first,
    the norm and head with the last (all on the CPU without a GPU)."""
    n = config.num_hidden_layers
    where = [min(i * gpus // n, gpus - 1) if gpus else "cpu" for i in range(n)]
    first, last = (where[0], where[-1])
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": last, "lm_head": last,
            **{f"model.layers.{i}": d for i, d in enumerate(where)}}


def setup_name(a) -> str:
    if world() > 1 and a.device_map:
        raise SystemExit("--device-map is a one-process setup: run it without torchrun")
    return f"tp{world()}" if world() > 1 else ("map" if a.device_map else "one")


def local_gpus(model) -> list[int]:
    """The GPUs this process computes on: every device of the model's map, or its one device."""
    if DEV != "cuda":
        return []
    devices = set(getattr(model, "hf_device_map", {}).values()) or {model.device}
    return sorted({torch.device(d if not isinstance(d, int) else f"cuda:{d}").index or 0 for d in devices
                   if str(d) not in ("cpu", "disk")})


def gather(value) -> list:
    """`value` of every rank (rank order), or `[value]` in one process."""
    if world() == 1:
        return [value]
    out = [None] * world()
    torch.distributed.all_gather_object(out, value)
    return out


def attention_split(family: str) -> bool:
    """Whether the installed transformers' tensor-parallel plan for `family` splits attention (kv_b_proj colwise)."""
    from transformers import AutoConfig

    plan = AutoConfig.for_model(family).base_model_tp_plan or {}
    return any(k.endswith("kv_b_proj") and v == "colwise" for k, v in plan.items())


@torch.no_grad()
def speed(a) -> None:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from quantmla_hf import QuantMLAConfig
    from quantmla_hf.generation.graphs import graph_stats
    from quantmla_hf.generation.segments import model_segment_plan

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_generate import StepClock

    setup, path = setup_name(a), os.path.join(a.out, a.model)
    dtype = getattr(torch, a.dtype)
    q = QuantMLAConfig(content_bits=a.bits, rope_bits=a.bits, transform="none")
    if setup.startswith("tp"):
        kwargs = tp_kwargs("tp_plan")
    elif setup == "map":
        from transformers import AutoConfig

        kwargs = {"device_map": split_map(AutoConfig.from_pretrained(path), torch.cuda.device_count())}
    else:
        kwargs = {"device_map": first_device()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=q, **kwargs).eval()
    gpus = local_gpus(model)
    weights = gather({g: torch.cuda.memory_allocated(g) / 2**30 for g in gpus})
    stats = graph_stats(model)
    segments = len(model_segment_plan(model).segments)

    def run(ids, n, clock=None):
        extra = {"logits_processor": LogitsProcessorList([clock])} if clock is not None else {}
        sync()
        if world() > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **extra)
        sync()
        return out[:, ids.shape[1]:].cpu(), time.perf_counter() - t

    vocab = model.config.vocab_size
    run(torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(2)).to(model.device), 4)
    rows = []
    for B, N in a.points:
        ids = torch.randint(0, vocab, (B, N), generator=torch.Generator().manual_seed(1)).to(model.device)
        for g in gpus:
            torch.cuda.reset_peak_memory_stats(g)
        c0, clock = stats.captures, StepClock()
        tokens, first = run(ids, a.steps + 2, clock)
        peaks = gather({g: torch.cuda.max_memory_allocated(g) / 2**30 for g in gpus})
        c1, r1 = stats.captures, stats.replays
        _, t_long = run(ids, a.steps + 2)
        _, t_short = run(ids, 2)
        ms = 1000 * (t_long - t_short) / a.steps
        cache = getattr(model, "_quantmla_static_cache", None)
        row = dict(model=a.model, family=SPEED_MODELS[a.model], attention_split=attention_split(SPEED_MODELS[a.model]),
                   dtype=a.dtype, method=f"C{a.bits}R{a.bits}", setup=setup, segments=segments, B=B, N=N,
                   first_call_s=first, ms_per_token=ms, tok_s=1000 * B / ms, step_ms_median=clock.step_ms(),
                   captures_first_call=c1 - c0, captures_later_calls=stats.captures - c1,
                   replays_later_calls=stats.replays - r1, eager_steps=stats.eager_steps,
                   peak_GiB_per_gpu=[v for rank in peaks for v in rank.values()],
                   weights_GiB_per_gpu=[v for rank in weights for v in rank.values()],
                   cache_GiB_per_rank=cache.nbytes() / 2**30 if cache is not None else None,
                   ranks_identical=all(t == tokens.tolist() for t in gather(tokens.tolist())), tokens=tokens.tolist())
        rows.append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "tokens"}))
    name = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
    versions = {m.__name__: m.__version__ for m in (torch, __import__("transformers"), __import__("triton"))}
    save_json(a.out, f"speed_{a.model}_{a.dtype}_C{a.bits}R{a.bits}_{setup}.json",
              dict(rows=rows, gpu=name, versions=versions, argv=sys.argv))


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
    runs = {}
    for path in sorted(glob.glob(os.path.join(a.out, "speed_*.json"))):
        for r in json.load(open(path))["rows"]:
            runs[(r["model"], r["dtype"], r["method"], r["B"], r["N"], r["setup"])] = r
    if not runs:
        return
    print("\n| model (TP plan) | dtype | cache | batch x context | setup | ms/token | x one GPU | tok/s | first call s "
          "| peak GiB per GPU | weights GiB per GPU | cache GiB per rank | captures, replays | tokens equal to 1 GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in sorted(runs.items(), key=lambda kv: (kv[0][:5], kv[0][5] != "one", kv[0][5])):
        one = runs.get((*key[:5], "one"))
        ratio = f"{r['ms_per_token'] / one['ms_per_token']:.2f}" if one else "-"
        same = compare(torch.tensor(one["tokens"]), torch.tensor(r["tokens"])) if one and r is not one else None
        first = same["first_diff"] if same and same["first_diff"] is not None else "none"
        agree = f"{100 * same['equal']:.1f}% (first differing step: {first})" if same else "-"
        plan = "attention + MLP" if r["attention_split"] else "MLP only"
        setup = {"one": "1 GPU", "map": f"device map ({r['segments']} graphs)"}.get(r["setup"], f"TP x{r['setup'][2:]}")
        fmt = ", ".join(f"{v:.2f}" for v in r["peak_GiB_per_gpu"])
        w = ", ".join(f"{v:.2f}" for v in r["weights_GiB_per_gpu"])
        cache = f"{r['cache_GiB_per_rank']:.2f}" if r["cache_GiB_per_rank"] is not None else "-"
        print(f"| {r['model']} ({plan}) | {r['dtype']} | {r['method']} | {r['B']}x{r['N']} | {setup} | "
              f"{r['ms_per_token']:.2f} | {ratio} | {r['tok_s']:.1f} | {r['first_call_s']:.2f} | {fmt} | {w} | "
              f"{cache} | {r['captures_first_call']}+{r['captures_later_calls']}, {r['replays_later_calls']} | "
              f"{agree} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=["build", "reference", "agree", "precision", "speed", "report"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per agreement run")
    ap.add_argument("--steps", type=int, default=64, help="speed: timed new tokens per call")
    ap.add_argument("--model", default="v2lite", choices=sorted(SPEED_MODELS), help="speed: the checkpoint")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="speed: compute dtype")
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4, 8, 16], help="speed: cache bits (content = RoPE)")
    ap.add_argument("--points", default=SPEED_POINTS, help="speed: batch x context points, e.g. 8x32768,32x32768")
    ap.add_argument("--device-map", action="store_true", help="speed: split the layers over every visible GPU")
    ap.add_argument("--no-speed-model", dest="speed_model", action="store_false", help="build: skip the speed models")
    ap.add_argument("--smoke", action="store_true", help="toy speed models (CPU check of the script)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="families of the agreement runs")
    a = ap.parse_args()
    a.points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
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
