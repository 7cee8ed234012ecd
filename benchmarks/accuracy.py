"""Accuracy harness of the QuantMLA cache: decode perplexity, KL and greedy agreement against the unquantized cache,
needle-in-a-haystack retrieval, the paper's ablation order and the dual-path matched-error ratio per layer.

Every metric reads the cache the way generation does: a prompt is prefilled exactly, then tokens are fed through the
cache (teacher-forced in chunks of `--chunk` tokens, or greedily one at a time), so each scored token attends to the
history as the cache holds it.

Methods (`--methods`, each run at every `--bits` setting and `--protect` choice where it applies):
    bf16        unquantized latent cache (transformers `DynamicCache`); the reference of KL and agreement
    rtn         QuantMLA cache, no transform (round-to-nearest, per-token groups of 64)
    smooth      SmoothQuant-style scales, calibrated and fused (`quantmla_hf.calibration.quantize`, "smooth")
    quarot      QuaRot-style Hadamard (content fused, RoPE rotated online in the cache)
    quantmla    learned transform, calibrated per bit setting and fused ("learned")
    content     ablation: learned content transform only (calibrated with rope_bits=16, so the RoPE path is untouched)
    quanto      transformers `QuantizedCache(backend="quanto")`, nbits = content bits, residual 128, group 64
                (it quantizes both paths at the same width; its residual window is its own protection)
Protection: "on" keeps 4 sink + 128 recent tokens in the model dtype, "off" sets sink_tokens = recent_tokens = 0.

Example (what docs/ACCURACY.md ran):
    python benchmarks/accuracy.py --text /work/shared/data/wiki_en_val.txt.xz \\
        --calibration /work/shared/data/wiki_en_train.txt.xz --out results.md
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import lzma
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "quantmla_hf" / "assets" / "reference_model"
METHODS = ("bf16", "rtn", "smooth", "quarot", "quanto", "quantmla", "content")
LABELS = {"bf16": "BF16 cache", "rtn": "RTN", "smooth": "SmoothQuant†", "quarot": "QuaRot†", "quantmla": "QuantMLA",
          "content": "RTN + content transform", "quanto": "QuantizedCache (quanto)"}
NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kavya", "Lars",
         "Mireille", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Stefan", "Tomas", "Ursula", "Viktor", "Wanda")


# ----------------------------------------------------------------------------------------------------------- text


def read_text(path: str, max_chars: int | None = None) -> str:
    """The UTF-8 text of `path` (`.xz` files decompressed with lzma), at most `max_chars` characters."""
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read(max_chars) if max_chars else f.read()


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """`[T]` int64 ids of `text`, without special tokens."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


# -------------------------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One row: a method at one cache precision, with or without the sink/recent protection."""

    family: str
    content_bits: int = 16
    rope_bits: int = 16
    protect: bool = True

    @property
    def name(self) -> str:
        if self.family == "bf16":
            return LABELS["bf16"]
        if self.family == "quanto":
            return f"{LABELS['quanto']} int{self.content_bits}"
        prot = "" if self.protect else ", no protection"
        return f"{LABELS[self.family]} C{self.content_bits}R{self.rope_bits}{prot}"

    @property
    def variant(self) -> str:
        """Which fused weights the method runs on."""
        return {"bf16": "base", "rtn": "base", "quanto": "base", "smooth": "smooth", "quarot": "hadamard",
                "quantmla": f"learned-C{self.content_bits}R{self.rope_bits}",
                "content": f"learned-C{self.content_bits}R16"}[self.family]


def expand_methods(families: list[str], bits: list[tuple[int, int]], protect: list[bool]) -> list[Method]:
    """Rows for `families` x `bits` x `protect` (bf16 once; quanto once per content width)."""
    out: list[Method] = []
    for fam in families:
        if fam not in METHODS:
            raise ValueError(f"unknown method {fam!r}; choose among {', '.join(METHODS)}")
        if fam == "bf16":
            out.append(Method("bf16"))
        elif fam == "quanto":
            out += [Method("quanto", c, c) for c in dict.fromkeys(c for c, _ in bits)]
        else:
            out += [Method(fam, c, r, p) for c, r in bits for p in protect]
    return list(dict.fromkeys(out))


def parse_bits(spec: str) -> list[tuple[int, int]]:
    """"C4R4,C2R4" -> [(4, 4), (2, 4)]."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"C(\d+)R(\d+)", item.strip())
        if not m:
            raise ValueError(f"bit setting {item!r} is not of the form C<content bits>R<rope bits>, e.g. C4R4")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def make_cache_factory(method: Method, config):
    """A function building a fresh cache for `method` (the model config `config`)."""
    from transformers import DynamicCache

    from quantmla_hf import QuantMLACache, QuantMLAConfig

    if method.family == "bf16":
        return lambda: DynamicCache(config=config)
    if method.family == "quanto":
        from transformers import QuantizedCache

        return lambda: QuantizedCache(backend="quanto", config=config, nbits=method.content_bits, q_group_size=64,
                                      residual_length=128)
    qconfig = QuantMLAConfig(
        content_bits=method.content_bits, rope_bits=method.rope_bits, transform="hadamard" if method.family == "quarot"
        else "none", sink_tokens=4 if method.protect else 0, recent_tokens=128 if method.protect else 0, kernel="torch",
    )
    return lambda: QuantMLACache(config=config, quantization_config=qconfig)


def calibrate_variant(base, variant: str, calib_ids: torch.Tensor, steps: int, cache_dir: Path | None):
    """A copy of `base` with the transform of `variant` fused (loaded from `cache_dir` when calibrated before).

    Returns `(model, seconds spent calibrating, calibration record)`.
    """
    from quantmla_hf import QuantMLAConfig
    from quantmla_hf.calibration import quantize

    if variant == "base":
        return base, 0.0, {}
    content_only = re.fullmatch(r"learned-C(\d+)R16", variant)
    if content_only:
        # The content transform (kv_a content rows, kv_a_layernorm, kv_b_proj) and the RoPE transform (kv_a RoPE
        # rows, query RoPE rows) touch disjoint weights, and calibration learns the content path with the RoPE path
        # exact; so "content only" is the full learned model with the RoPE rows put back.
        full, seconds, record = calibrate_variant(base, f"learned-C{content_only.group(1)}R4", calib_ids, steps,
                                                  cache_dir)
        return restore_rope_rows(full, base), seconds, record
    path = cache_dir / f"{variant}.pt" if cache_dir is not None else None
    model = copy.deepcopy(base)
    if path is not None and path.exists():
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["state_dict"])
        return model, saved["seconds"], saved["record"]
    transform = {"smooth": "smooth", "hadamard": "hadamard"}.get(variant, "learned")
    bits = re.fullmatch(r"learned-C(\d+)R(\d+)", variant)
    c, r = (int(bits.group(1)), int(bits.group(2))) if bits else (4, 4)
    cfg = QuantMLAConfig(content_bits=c, rope_bits=r, transform=transform, calibration_samples=calib_ids.shape[0],
                         calibration_seq_len=calib_ids.shape[1], calibration_steps=steps)
    start = time.time()
    quantize(model, cfg, calib_ids, progress=False)
    seconds = time.time() - start
    record = cfg.extra.get("calibration", {})
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"state_dict": model.state_dict(), "seconds": seconds, "record": record}, tmp)
        tmp.rename(path)  # atomic: another process never reads a partial file
    return model, seconds, record


def restore_rope_rows(model, base):
    """A copy of `model` whose RoPE rows (key rows of `kv_a_proj_with_mqa`, query rows of every head) are `base`'s."""
    from quantmla_hf.calibration.fusion import query_projection
    from quantmla_hf.hooks import mla_attention_modules

    out = copy.deepcopy(model)
    for m, b in zip(mla_attention_modules(out), mla_attention_modules(base)):
        d_c, d_nope, d_r = m.kv_a_layernorm.weight.numel(), m.qk_nope_head_dim, m.qk_rope_head_dim
        with torch.no_grad():
            m.kv_a_proj_with_mqa.weight[d_c:] = b.kv_a_proj_with_mqa.weight[d_c:]
            q, qb = query_projection(m).weight, query_projection(b).weight
            rows = q.view(-1, d_nope + d_r, q.shape[-1])
            rows[:, d_nope:] = qb.view(-1, d_nope + d_r, qb.shape[-1])[:, d_nope:]
    return out


# -------------------------------------------------------------------------------------------------------- metrics


def cache_kwarg(model) -> str:
    """`cache` (transformers >= 5.18) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class ScoredLogProbs:
    """Forward hook recording the log-probabilities `decode_perplexity` scores, in order: `[N_scored, V]` fp32.

    `decode_perplexity` makes `1 + len(range(prefill, window - 1, chunk))` forwards per window; of the first (the
    prefill) only the last position is a scored prediction, of the others every position.
    """

    def __init__(self, window: int, prefill: int, chunk: int):
        self.calls_per_window = 1 + len(range(prefill, window - 1, chunk))
        self.count = 0
        self.parts: list[torch.Tensor] = []

    def __call__(self, module, args, kwargs, output):
        logits = output.logits[0]
        if self.count % self.calls_per_window == 0:
            logits = logits[-1:]
        self.count += 1
        self.parts.append(torch.log_softmax(logits.float(), dim=-1))

    def result(self) -> torch.Tensor:
        return torch.cat(self.parts, 0)


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Per-position `KL(P_ref || P) = sum_v p_ref (log p_ref - log p)` of `[N, V]` log-probabilities -> `[N]`."""
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"log-probabilities disagree in shape: {tuple(ref_logprobs.shape)} vs {tuple(logprobs.shape)}")
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1)


@torch.no_grad()
def scored_decode(model, ids: torch.Tensor, make_cache, window: int, prefill: int, chunk: int, max_windows: int):
    """`decode_perplexity` of `ids: [T]` plus the log-probabilities it scored: `(DecodePerplexity, [N, V])`."""
    from quantmla_hf.evaluation import decode_perplexity

    recorder = ScoredLogProbs(window, prefill, chunk)
    handle = model.register_forward_hook(recorder, with_kwargs=True)
    try:
        result = decode_perplexity(model, ids, make_cache=make_cache, window=window, prefill=prefill, chunk=chunk,
                                   max_windows=max_windows)
    finally:
        handle.remove()
    logprobs = recorder.result()
    if logprobs.shape[0] != result.tokens:
        raise RuntimeError(f"recorded {logprobs.shape[0]} predictions but decode_perplexity scored {result.tokens}")
    return result, logprobs


@torch.no_grad()
def greedy_tokens(model, prompts: torch.Tensor, steps: int, make_cache) -> torch.Tensor:
    """Greedy continuation `[B, steps]` of equal-length `prompts: [B, P]`, one token per forward through the cache."""
    name = cache_kwarg(model)
    cache = make_cache()
    out = model(prompts, **{name: cache}, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(steps - 1):
        out = model(tokens[-1][:, None], **{name: cache}, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


def agreement(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """`(fraction of identical tokens position by position, mean length of the identical prefix)` of `[B, N]`."""
    same = ref == out
    prefix = same.long().cumprod(1).sum(1).float()
    return float(same.float().mean()), float(prefix.mean())


# --------------------------------------------------------------------------------------------------------- needle


@dataclass
class NeedleTrial:
    ids: torch.Tensor  # [L] prompt (haystack with needles, then the question)
    answer: str  # 5 digits
    keys: int
    depth: float


def needle_trials(tokenizer, filler: torch.Tensor, length: int, depths: list[float], keys: list[int],
                  seed: int) -> list[NeedleTrial]:
    """Prompts of exactly `length` tokens: filler text with `k` sentences "The secret number of <name> is <5 digits>."
    (the asked one at `depth`, the others at random depths), then "What is the secret number of <name>?"."""
    rng = random.Random(seed)
    trials = []
    for k in keys:
        for depth in depths:
            names = rng.sample(NAMES, k)
            numbers = [f"{rng.randrange(10000, 100000)}" for _ in names]
            target = 0
            needles = [token_ids(tokenizer, f" The secret number of {n} is {x}.") for n, x in zip(names, numbers)]
            question = token_ids(tokenizer, f"\n\nQuestion: What is the secret number of {names[target]}?\n"
                                            f"Answer: The secret number of {names[target]} is")
            n_fill = length - len(question) - sum(len(t) for t in needles)
            if n_fill < 16 or filler.numel() < n_fill:
                raise ValueError(f"needle length {length} leaves {n_fill} filler tokens of {filler.numel()} available")
            offset = rng.randrange(0, filler.numel() - n_fill + 1)
            hay = filler[offset : offset + n_fill]
            spots = [int(depth * n_fill)] + [rng.randrange(0, n_fill) for _ in range(k - 1)]
            order = sorted(range(k), key=lambda i: spots[i])
            pieces, prev = [], 0
            for i in order:
                pieces += [hay[prev : spots[i]], needles[i]]
                prev = spots[i]
            pieces += [hay[prev:], question]
            ids = torch.cat(pieces)
            assert ids.numel() == length
            trials.append(NeedleTrial(ids, numbers[target], k, depth))
    return trials


@torch.no_grad()
def needle_answers(model, trials: list[NeedleTrial], make_cache, tail: int, answer_tokens: int, chunk: int,
                   tokenizer) -> list[str]:
    """Greedy answers: prefill all but the last `tail` tokens, feed the tail through the cache in `chunk`-token
    pieces (so the question reads the cached haystack), then decode `answer_tokens` greedily."""
    name = cache_kwarg(model)
    ids = torch.stack([t.ids for t in trials])
    cache = make_cache()
    out = model(ids[:, :-tail], **{name: cache}, use_cache=True)
    for start in range(ids.shape[1] - tail, ids.shape[1], chunk):
        out = model(ids[:, start : start + chunk], **{name: cache}, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(answer_tokens - 1):
        out = model(tokens[-1][:, None], **{name: cache}, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return tokenizer.batch_decode(torch.stack(tokens, 1))


def exact_match(answer: str, text: str) -> bool:
    """True when the first number in the generated `text` is `answer`."""
    m = re.search(r"\d+", text)
    return m is not None and m.group(0) == answer


# ---------------------------------------------------------------------------------------------------------- report


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(results: dict) -> str:
    """Tables of a results dict written by `main`."""
    lines = [f"Command: `{results['command']}`", "", f"Settings: {results['settings']}", ""]
    for text, rows in results["texts"].items():
        ref = next((r for r in rows if r["method"] == LABELS["bf16"]), None)
        lines += [f"### {text}", "",
                  "| method | decode ppl | Δ vs BF16 | KL(BF16‖q) | top-1 agree | greedy agree | greedy prefix | s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            delta = 100 * (r["ppl"] / ref["ppl"] - 1) if ref else float("nan")
            lines.append(f"| {r['method']} | {r['ppl']:.3f} | {delta:+.2f}% | {_fmt(r.get('kl'), 4)} | "
                         f"{_fmt(r.get('top1'))} | {_fmt(r.get('greedy'))} | {_fmt(r.get('greedy_prefix'), 1)} | "
                         f"{r['seconds']:.0f} |")
        lines.append("")
    if results.get("needle"):
        lengths = sorted({int(k) for row in results["needle"] for k in row["by_length"]})
        lines += ["### Needle in a haystack (exact match of the greedy answer)", "",
                  "| method | keys | " + " | ".join(f"{n} tok" for n in lengths) + " |",
                  "| --- | ---: | " + " | ".join("---:" for _ in lengths) + " |"]
        for row in results["needle"]:
            for k, by in row["by_keys"].items():
                lines.append(f"| {row['method']} | {k} | " + " | ".join(
                    f"{by[str(n)][0]}/{by[str(n)][1]}" for n in lengths) + " |")
        lines.append("")
    if results.get("ratio"):
        lines += ["### Dual-path matched-error ratio", "", results["ratio"]["markdown"]]
    if results.get("calibration"):
        lines += ["### Calibration", "", "| variant | seconds |", "| --- | ---: |"]
        lines += [f"| {k} | {v['seconds']:.0f} |" for k, v in results["calibration"].items()]
    return "\n".join(lines) + "\n"


def plot_ratio(report, path: str) -> None:
    """Bar chart of the per-layer RoPE/content response ratio of a `DualPathReport`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r.layer_idx for r in report.layers]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(layers, [r.ratio for r in report.layers], color="#ff7f0e")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.axhline(report.ratio, color="#1f77b4", lw=1.5, label=f"model aggregate {report.ratio:.2f}")
    ax.set_xlabel("attention layer")
    ax.set_ylabel("RoPE response / content response")
    ax.set_title(f"Matched-error ratio (INT{report.bits} error directions, cache NMSE {report.target_nmse:g})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: the embedded model)")
    p.add_argument("--text", nargs="*", default=[], help="evaluation text file(s) (.xz read with lzma)")
    p.add_argument("--max-chars", type=int, default=400_000, help="characters read from each text file")
    p.add_argument("--calibration", help="calibration text file (.xz ok); needed for smooth/quantmla/content")
    p.add_argument("--calibration-chars", type=int, default=2_000_000)
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--calibration-seq-len", type=int, default=256)
    p.add_argument("--calibration-steps", type=int, default=40)
    p.add_argument("--calibrated-dir", help="where fused variants are saved and reused (e.g. /tmp/quantmla-acc)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--bits", default="C4R4,C2R4")
    p.add_argument("--protect", default="on,off", help="on, off or on,off")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--chunk", type=int, default=16, help="decoded tokens per forward (1..16)")
    p.add_argument("--windows", type=int, default=16, help="windows per text")
    p.add_argument("--greedy-prompts", type=int, default=0, help="prompts for greedy agreement (0: skip)")
    p.add_argument("--greedy-prompt-len", type=int, default=512)
    p.add_argument("--greedy-steps", type=int, default=64)
    p.add_argument("--needle-lengths", default="", help="e.g. 1024,2048,4088 (empty: skip)")
    p.add_argument("--needle-depths", default="0.25,0.75")
    p.add_argument("--needle-keys", default="1,3")
    p.add_argument("--needle-text", help="filler text file (default: the first --text)")
    p.add_argument("--needle-methods", default="", help="methods of the needle task (default: all rows)")
    p.add_argument("--ratio-windows", type=int, default=0, help="windows of --calibration-seq-len for the ratio (0: skip)")
    p.add_argument("--ratio-plot", help="PNG of the per-layer RoPE/content ratio")
    p.add_argument("--calibrate-only", action="store_true", help="calibrate and save the variants, then stop")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--out", required=True, help="markdown output (a .json with the raw numbers is written beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    import quantmla_hf  # noqa: F401  (registers the attention implementation and the quantizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    log = lambda msg: print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    families = [m.strip() for m in args.methods.split(",") if m.strip()]
    protect = [{"on": True, "off": False}[p.strip()] for p in args.protect.split(",")]
    methods = expand_methods(families, parse_bits(args.bits), protect)
    results = {"command": "python " + " ".join([sys.argv[0].split("/work/main/")[-1]] + sys.argv[1:]),
               "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "texts": {}, "calibration": {}}
    out = Path(args.out)

    calib_ids = None
    variants = list(dict.fromkeys(m.variant for m in methods))
    if any(v not in ("base", "hadamard") for v in variants) or args.ratio_windows:
        if not args.calibration:
            raise ValueError("smooth/quantmla/content and the ratio need --calibration TEXT_FILE")
        ids = token_ids(tokenizer, read_text(args.calibration, args.calibration_chars))
        n = ids.numel() // args.calibration_seq_len
        calib_ids = ids[: n * args.calibration_seq_len].view(n, args.calibration_seq_len)
        log(f"calibration text: {ids.numel()} tokens, {n} windows of {args.calibration_seq_len}")
    cache_dir = Path(args.calibrated_dir) if args.calibrated_dir else None
    loaded = {"base": base}

    def models_get(v: str):
        """The model of variant `v`, calibrated (or loaded from --calibrated-dir) on first use."""
        if v not in loaded:
            sel = calib_ids[: args.calibration_samples] if calib_ids is not None else torch.zeros(2, 8, dtype=torch.long)
            loaded[v], seconds, record = calibrate_variant(base, v, sel, args.calibration_steps, cache_dir)
            results["calibration"][v] = {"seconds": seconds, "record": record}
            log(f"variant {v}: calibrated in {seconds:.0f} s")
        return loaded[v]

    if args.calibrate_only:
        for v in variants:
            models_get(v)
        out.write_text(markdown(results))
        return 0

    if args.ratio_windows:
        from quantmla_hf.analysis import analyze

        start = time.time()
        # Held-out windows: the ones after the calibration samples.
        held = calib_ids[args.calibration_samples : args.calibration_samples + args.ratio_windows]
        report = analyze(base, held, progress=False)
        results["ratio"] = {**report.to_dict(), "markdown": report.to_markdown(), "seconds": time.time() - start}
        if args.ratio_plot:
            plot_ratio(report, args.ratio_plot)
        log(f"ratio {report.ratio:.3f} in {time.time() - start:.0f} s")

    for text_path in args.text:
        ids = token_ids(tokenizer, read_text(text_path, args.max_chars))
        label = f"{Path(text_path).name} ({min(args.windows, ids.numel() // args.window)} windows of {args.window}, " \
                f"prefill {args.prefill}, chunk {args.chunk})"
        rows, ref_lp, ref_greedy = [], None, None
        prompts = None
        if args.greedy_prompts:
            prompts = torch.stack([ids[i * args.window : i * args.window + args.greedy_prompt_len]
                                   for i in range(args.greedy_prompts)])
        for method in methods:
            model = models_get(method.variant)
            make = make_cache_factory(method, model.config)
            start = time.time()
            res, lp = scored_decode(model, ids, make, args.window, args.prefill, args.chunk, args.windows)
            row = {"method": method.name, "spec": asdict(method), "ppl": res.perplexity, "nll": res.nll,
                   "tokens": res.tokens}
            if method.family == "bf16":
                ref_lp = lp
            elif ref_lp is not None:
                row["kl"] = float(kl_divergence(ref_lp, lp).mean())
                row["top1"] = float((ref_lp.argmax(-1) == lp.argmax(-1)).float().mean())
            if prompts is not None:
                toks = greedy_tokens(model, prompts, args.greedy_steps, make)
                if method.family == "bf16":
                    ref_greedy = toks
                elif ref_greedy is not None:
                    row["greedy"], row["greedy_prefix"] = agreement(ref_greedy, toks)
            row["seconds"] = time.time() - start
            rows.append(row)
            log(f"{Path(text_path).name} | {method.name}: ppl {res.perplexity:.3f} kl {row.get('kl', 0):.4f} "
                f"greedy {row.get('greedy', float('nan')):.3f} ({row['seconds']:.0f} s)")
            results["texts"][label] = rows
            out.with_suffix(".json").write_text(json.dumps(results, indent=1))
            out.write_text(markdown(results))

    if args.needle_lengths:
        filler_path = args.needle_text or args.text[0]
        filler = token_ids(tokenizer, read_text(filler_path, args.max_chars))
        lengths = [int(x) for x in args.needle_lengths.split(",")]
        depths = [float(x) for x in args.needle_depths.split(",")]
        keys = [int(x) for x in args.needle_keys.split(",")]
        wanted = [m.strip() for m in args.needle_methods.split(",") if m.strip()]
        results["needle"] = []
        for method in methods:
            if wanted and method.name not in wanted and method.family not in wanted:
                continue
            model = models_get(method.variant)
            make = make_cache_factory(method, model.config)
            start = time.time()
            by_length, by_keys = {}, {}
            for n in lengths:
                trials = needle_trials(tokenizer, filler, n, depths, keys, seed=n)
                answers = needle_answers(model, trials, make, tail=64, answer_tokens=6, chunk=args.chunk,
                                         tokenizer=tokenizer)
                for t, a in zip(trials, answers):
                    ok = exact_match(t.answer, a)
                    for table, key in ((by_length, str(n)), (by_keys.setdefault(str(t.keys), {}), str(n))):
                        hit, tot = table.get(key, (0, 0))
                        table[key] = (hit + ok, tot + 1)
                if method.family == "bf16":
                    log(f"needle {n}: " + "; ".join(f"{t.answer} -> {a!r}" for t, a in zip(trials, answers)))
            results["needle"].append({"method": method.name, "by_length": by_length, "by_keys": by_keys,
                                      "seconds": time.time() - start})
            log(f"needle | {method.name}: {by_length} ({time.time() - start:.0f} s)")
            out.with_suffix(".json").write_text(json.dumps(results, indent=1))
            out.write_text(markdown(results))

    results["total_seconds"] = time.time() - t_start
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.write_text(markdown(results))
    log(f"done; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
