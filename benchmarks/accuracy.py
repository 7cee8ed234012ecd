"""Accuracy harness of the QuantMLA cache: decode perplexity, KL and greedy agreement against the unquantized cache,
needle-in-a-haystack retrieval, the paper's ablation order and the dual-path matched-error ratio per layer.

Every metric reads the cache the way generation does: a prompt is prefilled exactly, then tokens are fed through the
cache (teacher-forced in chunks of `--chunk` tokens, or greedily one at a time), so each scored token attends to the
history as the cache holds it.

Methods (`--methods`, each run at every `--bits` setting and `--protect` choice where it applies):
    bf16        unquantized latent cache (transformers `DynamicCache`); the reference of KL and agreement
    rtn         QuantMLA cache, no transform (round-to-nearest, per-token groups of 64)
    smooth      SmoothQuant-style scales, calibrated and fused (`quantmla_hf.calibration.calibrate`, "smooth")
    quarot      QuaRot-style Hadamard (content fused, RoPE rotated online in the cache)
    quantmla    learned transform, calibrated per bit setting and fused ("learned"), objectives as
                --calibration-protection says
    quantmla_allq  the same, with objectives that quantize every cached token (calibration_protection="off")
    content     ablation: learned content transform only (the learned model with its RoPE rows put back)
    rope        ablation: learned RoPE transform only (the learned model with its content rows put back)
    quanto      transformers `QuantizedCache(backend="quanto")`, nbits = content bits, residual 128, group 64
                (it quantizes both paths at the same width; its residual window is its own protection)
Protection: "on" keeps 4 sink + 128 recent tokens in the model dtype, "off" sets sink_tokens = recent_tokens = 0.

Per-window NLL, KL and top-1 agreement are recorded for every row; the tables give 95% paired bootstrap intervals over
windows (`quantmla_hf.evaluation.intervals`), and every non-RTN row is compared with RTN at the same setting (KL ratio, verdict
"better" / "worse" / "tie"), per seed and as the mean over `--seeds`.

Example (what docs/ACCURACY.md ran):
    python benchmarks/accuracy.py --text ../shared/data/wikitext-2-raw-test.raw \\
        --calibration ../shared/data/wiki_en_train.txt.xz --calibration-chars 1500000 \\
        --calibration-samples 8 --calibration-seq-len 512 --calibration-steps 30 --methods bf16,rtn,quantmla \\
        --bits C2R4 --protect on --calibrated-dir /tmp/acc --out results.md
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import lzma
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from quantmla_hf.evaluation.intervals import Interval

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "quantmla_hf" / "assets" / "reference_model"
METHODS = ("bf16", "rtn", "smooth", "quarot", "quanto", "quantmla", "quantmla_allq", "content", "rope")
LABELS = {"bf16": "BF16 cache", "rtn": "RTN", "smooth": "SmoothQuant†", "quarot": "QuaRot†", "quantmla": "QuantMLA",
          "content": "RTN + content transform", "rope": "RTN + RoPE transform", "quanto": "QuantizedCache (quanto)",
          "quantmla_allq": "QuantMLA, objectives without protection"}
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
    seed: int | None = None  # calibration seed of the calibrated families (smooth, quantmla, content, rope)

    @property
    def calibrated(self) -> bool:
        return self.family in CALIBRATED

    @property
    def name(self) -> str:
        if self.family == "bf16":
            return LABELS["bf16"]
        if self.family == "quanto":
            return f"{LABELS['quanto']} int{self.content_bits}"
        prot = "" if self.protect else ", no protection"
        seed = f" (seed {self.seed})" if self.calibrated and self.seed is not None else ""
        return f"{LABELS[self.family]} C{self.content_bits}R{self.rope_bits}{prot}{seed}"

    @property
    def variant(self) -> str:
        """Which fused weights the method runs on."""
        v = {"bf16": "base", "rtn": "base", "quanto": "base", "smooth": "smooth", "quarot": "hadamard",
             "quantmla": f"learned-C{self.content_bits}R{self.rope_bits}",
             "quantmla_allq": f"learned-C{self.content_bits}R{self.rope_bits}-allq",
             "content": f"learned-C{self.content_bits}R16",
             "rope": f"learned-C{self.content_bits}R{self.rope_bits}-rope"}[self.family]
        return f"{v}-seed{self.seed or 0}" if self.calibrated else v


CALIBRATED = ("smooth", "quantmla", "quantmla_allq", "content", "rope")


def expand_methods(families: list[str], bits: list[tuple[int, int]], protect: list[bool],
                   seeds: list[int] = (0,)) -> list[Method]:
    """Rows for `families` x `bits` x `protect` (x `seeds` for calibrated families; bf16 once; quanto once per
    content width)."""
    out: list[Method] = []
    for item in families:
        fam, _, only = item.partition("@")  # "quantmla_allq@0": that family with seed 0 only
        fam_seeds = [int(x) for x in only.split("+")] if only else list(seeds)
        if fam not in METHODS:
            raise ValueError(f"unknown method {fam!r}; choose among {', '.join(METHODS)}")
        if fam == "bf16":
            out.append(Method("bf16"))
        elif fam == "quanto":
            out += [Method("quanto", c, c) for c in dict.fromkeys(c for c, _ in bits)]
        elif fam in CALIBRATED:
            out += [Method(fam, c, r, p, sd) for c, r in bits for p in protect for sd in fam_seeds]
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
        else "none", sink_tokens=4 if method.protect else 0, recent_tokens=128 if method.protect else 0,
        advanced={"kernel": "torch"},
    )
    return lambda: QuantMLACache(config=config, quantization_config=qconfig)


@dataclass(frozen=True)
class CalibrationRecipe:
    """Everything besides the model and the variant that changes a calibrated model."""

    ids: torch.Tensor  # [N, T] calibration windows (already drawn with the seed)
    steps: int
    lr: float
    seed: int
    batch_size: int = 8
    protection: str = "auto"  # calibrate(calibration_protection=...)
    machine: str = ""  # where the calibration ran (`machine_tag`); "" = this process's CPU


def machine_tag(device: torch.device | str = "cpu") -> str:
    """Where a calibration computes: on a CPU its kernel set and thread count (e.g. "cpu-AVX2-1t"), on a GPU its
    name (e.g. "cuda-NVIDIA_H200"). Both change the float rounding of calibration, hence (slightly) the fused
    weights."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda-" + torch.cuda.get_device_name(device).replace(" ", "_")
    return f"cpu-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t"


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the shapes, dtypes and bytes of `tensors` (hex)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_digest(model) -> str:
    """sha256 over the model's state dict (names, shapes, dtypes, values)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor_digest(t).encode())
    return h.hexdigest()


def calibration_key(base_digest: str, variant: str, recipe: CalibrationRecipe,
                    device: torch.device | str = "cpu") -> dict:
    """What a stored calibrated model must match to be reused: the base weights, the variant (transform, bits,
    seed), the calibration windows, steps, learning rate, batch, protection setting, where it computes (`device`:
    `machine_tag`) and the library version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        library = version("quantmla-hf")
    except PackageNotFoundError:
        library = "unknown"
    return {"base_model_sha256": base_digest, "variant": variant, "calibration_ids_sha256": tensor_digest(recipe.ids),
            "calibration_windows": list(recipe.ids.shape), "steps": recipe.steps, "lr": recipe.lr, "seed": recipe.seed,
            "batch_size": recipe.batch_size, "protection": recipe.protection, "machine": recipe.machine or machine_tag(device),
            "quantmla_hf": library, "torch": torch.__version__}


def calibrate_variant(base, variant: str, recipe: CalibrationRecipe, cache_dir: Path | None, base_digest: str = ""):
    """A copy of `base` with the transform of `variant` fused, loaded from `cache_dir` when a model calibrated with
    exactly the same key (`calibration_key`) is stored there.

    Returns `(model, info)`: info holds `seconds` (calibration time, or the stored model's), `loaded` (True when
    reused), `record` (the calibration record) and `key`.
    """
    from quantmla_hf import QuantMLAConfig
    from quantmla_hf.calibration import calibrate

    if variant == "base":
        return base, {"seconds": 0.0, "loaded": False, "record": {}, "key": {}}
    content_only = re.fullmatch(r"learned-C(\d+)R16(-seed\d+)?", variant)
    if content_only:
        # The content transform (kv_a content rows, kv_a_layernorm, kv_b_proj) and the RoPE transform (kv_a RoPE
        # rows, query RoPE rows) touch disjoint weights, and calibration learns the content path with the RoPE path
        # exact; so "content only" is the full learned model with the RoPE rows put back.
        full, info = calibrate_variant(base, f"learned-C{content_only.group(1)}R4{content_only.group(2) or ''}",
                                       recipe, cache_dir, base_digest)
        return restore_rope_rows(full, base), info
    rope_only = re.fullmatch(r"learned-C(\d+)R(\d+)-rope(-seed\d+)?", variant)
    if rope_only:
        # The mirror image: the full learned model with the content rows (kv_a content rows, kv_a_layernorm,
        # kv_b_proj) put back, so only the RoPE transform remains.
        c, r, seed = rope_only.groups()
        full, info = calibrate_variant(base, f"learned-C{c}R{r}{seed or ''}", recipe, cache_dir, base_digest)
        return restore_content_rows(full, base), info
    if re.fullmatch(r"learned-C(\d+)R(\d+)-allq(-seed\d+)?", variant):
        recipe = replace(recipe, protection="off")
    device = next(base.parameters()).device
    key = calibration_key(base_digest or model_digest(base), variant, recipe, device)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"{variant}-{digest}.pt" if cache_dir is not None else None
    model = copy.deepcopy(base)
    if path is not None and path.exists():
        saved = torch.load(path, weights_only=False)
        if saved.get("key") != key:
            raise ValueError(f"{path} was calibrated with {saved.get('key')}, not {key}; delete it or use another "
                             "--calibrated-dir")
        model.load_state_dict(saved["state_dict"])
        return model, {"seconds": saved["seconds"], "loaded": True, "record": saved["record"], "key": key}
    if recipe.machine and recipe.machine != machine_tag(device):
        raise ValueError(f"no model of {variant} calibrated on {recipe.machine} in {cache_dir}; calibrate it there first "
                         f"(this process is {machine_tag(device)}: set ATEN_CPU_CAPABILITY / --threads and use "
                         "--calibrate-only)")
    transform = "hadamard" if variant == "hadamard" else ("smooth" if variant.startswith("smooth") else "learned")
    bits = re.fullmatch(r"learned-C(\d+)R(\d+)(-allq)?(-seed\d+)?", variant)
    c, r = (int(bits.group(1)), int(bits.group(2))) if bits else (4, 4)
    recipe_options = {"calibration_samples": recipe.ids.shape[0], "calibration_seq_len": recipe.ids.shape[1],
                      "calibration_steps": recipe.steps, "calibration_lr": recipe.lr, "seed": recipe.seed}
    cfg = QuantMLAConfig(content_bits=c, rope_bits=r, transform=transform, advanced=recipe_options)
    start = time.time()
    calibrate(model, cfg, recipe.ids, batch_size=recipe.batch_size, progress=False,
             calibration_protection=recipe.protection)
    seconds = time.time() - start
    record = cfg.extra.get("calibration", {})
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"state_dict": model.state_dict(), "seconds": seconds, "record": record, "key": key}, tmp)
        tmp.rename(path)  # atomic: another process never reads a partial file
    return model, {"seconds": seconds, "loaded": False, "record": record, "key": key}


def calibration_windows(ids: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` non-overlapping windows `[samples, seq_len]` of the token stream `ids: [T]`, drawn with `seed`
    (sorted by position), as `quantmla_hf.calibration.calibration_token_ids` draws them from text."""
    n = ids.numel() // seq_len
    if n < 2:
        raise ValueError(f"the calibration text gives {ids.numel()} tokens, fewer than 2 windows of {seq_len}")
    windows = ids[: n * seq_len].view(n, seq_len)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(samples, n)]
    return windows[pick.sort().values]


def restore_rope_rows(model, base):
    """A copy of `model` whose RoPE rows (key rows of `kv_a_proj_with_mqa`, query rows of every head) are `base`'s."""
    from quantmla_hf.calibration.fusion import query_projection
    from quantmla_hf.attention.state import mla_attention_modules

    out = copy.deepcopy(model)
    for m, b in zip(mla_attention_modules(out), mla_attention_modules(base)):
        d_c, d_nope, d_r = m.kv_a_layernorm.weight.numel(), m.qk_nope_head_dim, m.qk_rope_head_dim
        with torch.no_grad():
            m.kv_a_proj_with_mqa.weight[d_c:] = b.kv_a_proj_with_mqa.weight[d_c:]
            q, qb = query_projection(m).weight, query_projection(b).weight
            rows = q.view(-1, d_nope + d_r, q.shape[-1])
            rows[:, d_nope:] = qb.view(-1, d_nope + d_r, qb.shape[-1])[:, d_nope:]
    return out


def restore_content_rows(model, base):
    """A copy of `model` whose content weights (content rows of `kv_a_proj_with_mqa` and of its bias, the
    `kv_a_layernorm` weight, `kv_b_proj`) are `base`'s: the RoPE transform alone."""
    from quantmla_hf.attention.state import mla_attention_modules

    out = copy.deepcopy(model)
    for m, b in zip(mla_attention_modules(out), mla_attention_modules(base)):
        d_c = m.kv_a_layernorm.weight.numel()
        with torch.no_grad():
            m.kv_a_proj_with_mqa.weight[:d_c] = b.kv_a_proj_with_mqa.weight[:d_c]
            if m.kv_a_proj_with_mqa.bias is not None:
                m.kv_a_proj_with_mqa.bias[:d_c] = b.kv_a_proj_with_mqa.bias[:d_c]
            m.kv_a_layernorm.weight.copy_(b.kv_a_layernorm.weight)
            m.kv_b_proj.weight.copy_(b.kv_b_proj.weight)
    return out


# -------------------------------------------------------------------------------------------------------- metrics


def cache_kwarg(model) -> str:
    """`cache` (transformers >= 5.24) or `past_key_values` (earlier releases)."""
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
    from quantmla_hf.evaluation.perplexity import decode_perplexity

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
def window_logprobs(model, ids: torch.Tensor, make_cache, window: int, prefill: int, chunk: int, n_windows: int,
                    batch: int):
    """Decode the first `n_windows` windows of `ids: [T]` as `decode_perplexity` does (prefill `prefill` tokens,
    then `chunk` tokens per forward through the cache), `batch` windows at a time (one cache per batch).

    Yields `(logprobs [b, window - prefill, V] fp32, targets [b, window - prefill])` per batch: the scored
    next-token log-probabilities of positions `prefill - 1 .. window - 2` and the tokens they predict.
    """
    if n_windows < 1 or ids.numel() < n_windows * window:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than {n_windows} windows of {window}")
    if prefill < 1 or window <= prefill + 1:
        raise ValueError(f"need 1 <= prefill < window - 1, got prefill={prefill}, window={window}")
    name = cache_kwarg(model)
    windows = ids[: n_windows * window].view(n_windows, window)
    for w0 in range(0, n_windows, batch):
        seq = windows[w0 : w0 + batch]
        cache = make_cache()
        out = model(seq[:, :prefill], **{name: cache}, use_cache=True)
        logits = [out.logits[:, -1:].float()]
        for start in range(prefill, window - 1, chunk):
            out = model(seq[:, start : min(start + chunk, window - 1)], **{name: cache}, use_cache=True)
            logits.append(out.logits.float())
        yield torch.log_softmax(torch.cat(logits, 1), -1), seq[:, prefill:]


def window_scores(model, ids: torch.Tensor, make_cache, window: int, prefill: int, chunk: int, n_windows: int,
                  batch: int, ref: list[torch.Tensor] | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Per-window scores of one method: `({"nll": [W], "kl": [W], "top1": [W]}, logprobs per batch)`.

    nll: mean next-token NLL of the window's scored tokens; kl: mean `KL(P_ref || P)` over them against `ref` (the
    reference method's logprobs per batch, as returned here); top1: fraction whose argmax matches the reference's.
    Without `ref`, kl and top1 are absent and the logprobs are returned (to serve as the reference).
    """
    nll, kl, top1, kept = [], [], [], []
    for i, (lp, targets) in enumerate(window_logprobs(model, ids, make_cache, window, prefill, chunk, n_windows,
                                                      batch)):
        nll.append(-lp.gather(-1, targets[..., None])[..., 0].mean(-1))
        if ref is None:
            kept.append(lp)
        else:
            kl.append(kl_divergence(ref[i], lp).mean(-1))
            top1.append((ref[i].argmax(-1) == lp.argmax(-1)).float().mean(-1))
    scores = {"nll": torch.cat(nll).double()}
    if ref is not None:
        scores.update(kl=torch.cat(kl).double(), top1=torch.cat(top1).double())
    return scores, kept


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


def verdict(ratio: Interval) -> str:
    """"better" / "worse" when the 95% interval of a KL ratio excludes 1, else "tie"."""
    return "better" if ratio.high < 1 else "worse" if ratio.low > 1 else "tie"


def summarize(rows: list[dict]) -> dict:
    """Per-row intervals and paired comparisons of the rows of one text (as `main` records them).

    Returns `{"rows": [...], "vs_rtn": [...], "seed_mean": [...]}`:
    - rows: per method `ppl`, `dppl` (relative change vs BF16, paired bootstrap), `kl` (mean, bootstrap), `top1`;
    - vs_rtn: per non-RTN QuantMLA-cache row, against RTN at the same bits and protection: `kl_ratio` (mean KL
      over mean RTN KL, paired bootstrap), `dppl` (perplexity change vs RTN, paired bootstrap), `kl_diff` (t
      interval of the per-window KL difference), `wins` (windows with lower KL than RTN), `verdict`;
    - seed_mean: the same against RTN for a calibrated family averaged over its seeds window by window, with the
      range of the per-seed ratios (the calibration spread).
    """
    from quantmla_hf.evaluation.intervals import bootstrap, mean_of, perplexity_change, ratio_of_means, t_interval

    ref = next((r for r in rows if r["spec"]["family"] == "bf16"), None)
    nll = lambda r: torch.tensor(r["nll"], dtype=torch.float64)  # noqa: E731
    kl = lambda r: torch.tensor(r["kl"], dtype=torch.float64)  # noqa: E731
    out = {"rows": [], "vs_rtn": [], "seed_mean": []}
    for r in rows:
        entry = {"method": r["method"], "ppl": math.exp(float(nll(r).mean())), "windows": len(r["nll"])}
        if ref is not None and r is not ref:
            entry["dppl"] = bootstrap(perplexity_change, nll(r), nll(ref))
        if "kl" in r:
            entry["kl"] = bootstrap(mean_of, kl(r))
            entry["top1"] = float(torch.tensor(r["top1"]).mean())
        out["rows"].append(entry)

    def setting(r):
        sp = r["spec"]
        return sp["content_bits"], sp["rope_bits"], sp["protect"]

    rtn = {setting(r): r for r in rows if r["spec"]["family"] == "rtn" and "kl" in r}

    def compare(name, kl_m, nll_m, base):
        ratio = bootstrap(ratio_of_means, kl_m, kl(base))
        return {"method": name, "against": base["method"], "kl_ratio": ratio,
                "dppl": bootstrap(perplexity_change, nll_m, nll(base)), "kl_diff": t_interval(kl_m - kl(base)),
                "wins": int((kl_m < kl(base)).sum()), "windows": int(kl_m.numel()), "verdict": verdict(ratio)}

    groups: dict = {}
    for r in rows:
        sp = r["spec"]
        if sp["family"] in ("bf16", "rtn", "quanto") or "kl" not in r or setting(r) not in rtn:
            continue
        out["vs_rtn"].append(compare(r["method"], kl(r), nll(r), rtn[setting(r)]))
        if sp.get("seed") is not None:
            groups.setdefault((sp["family"], *setting(r), r.get("machine", "")), []).append(r)
    for (family, c, rb, prot, machine), members in groups.items():
        if len(members) < 2:
            continue
        base = rtn[(c, rb, prot)]
        kl_m = torch.stack([kl(r) for r in members]).mean(0)
        nll_m = torch.stack([nll(r) for r in members]).mean(0)
        name = Method(family, c, rb, prot).name + f" (mean of {len(members)} seeds)" + (f" [{machine}]" if machine else "")
        entry = compare(name, kl_m, nll_m, base)
        per_seed = [float(kl(r).mean() / kl(base).mean()) for r in members]
        entry["seed_ratios"] = per_seed
        out["seed_mean"].append(entry)
    return out


def markdown(results: dict) -> str:
    """Tables of a results dict written by `main`, with 95% intervals over windows."""
    lines = [f"Command: `{results['command']}`", "", f"Settings: {results['settings']}", ""]
    for text, rows in results["texts"].items():
        summary = summarize(rows)
        lines += [f"### {text}", "", "Intervals: 95% paired bootstrap over windows (2000 resamples).", "",
                  "| method | decode ppl | Δ ppl vs BF16 [95%] | KL(BF16‖q) ×1e3 [95%] | top-1 agree | greedy agree | s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r, e in zip(rows, summary["rows"]):
            d = e["dppl"].fmt(2, 100, sign=True) + "%" if "dppl" in e else "—"
            k = e["kl"].fmt(3, 1e3) if "kl" in e else "—"
            lines.append(f"| {e['method']} | {e['ppl']:.3f} | {d} | {k} | {_fmt(e.get('top1'))} | "
                         f"{_fmt(r.get('greedy'))} | {r['seconds']:.0f} |")
        lines.append("")
        comps = summary["vs_rtn"] + summary["seed_mean"]
        if comps:
            lines += ["Against RTN at the same bits and protection (paired over the same windows; verdict from the KL "
                      "ratio's interval: better / worse when it excludes 1, else tie):", "",
                      "| method | KL / RTN KL [95%] | KL − RTN KL ×1e3 [95% t] | Δ ppl vs RTN [95%] | windows with lower KL | verdict |",
                      "| --- | ---: | ---: | ---: | ---: | --- |"]
            for c in comps:
                spread = ""
                if "seed_ratios" in c:
                    spread = f" (seeds {min(c['seed_ratios']):.3f}–{max(c['seed_ratios']):.3f})"
                lines.append(f"| {c['method']} | {c['kl_ratio'].fmt(3)}{spread} | {c['kl_diff'].fmt(3, 1e3, sign=True)} | "
                             f"{c['dppl'].fmt(2, 100, sign=True)}% | {c['wins']}/{c['windows']} | {c['verdict']} |")
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
        lines += ["### Calibration", "", "| variant | seconds | reused from --calibrated-dir |", "| --- | ---: | --- |"]
        lines += [f"| {k} | {v['seconds']:.0f} | {'yes' if v.get('loaded') else 'no'} |"
                  for k, v in results["calibration"].items()]
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
    p.add_argument("--calibration-lr", type=float, default=5e-3)
    p.add_argument("--calibration-protection", default="auto", choices=("auto", "on", "off"),
                   help="model the cache's sink/recent protection in the objectives (quantize's calibration_protection)")
    p.add_argument("--calibrated-on", default="", help="use the variants calibrated on this machine tag (e.g. "
                   "cpu-DEFAULT-1t, see machine_tag) from --calibrated-dir instead of this process's; their rows get "
                   "the tag in their name")
    p.add_argument("--reuse-rows", help="results .json of an earlier run with the same text settings: its rows of "
                   "the methods asked for are taken from it (per-window values), not recomputed, except BF16")
    p.add_argument("--seeds", default="0,1,2", help="calibration seeds (windows drawn and batch order) of smooth/"
                   "quantmla/content; each seed is its own row and the tables give the mean and spread over seeds")
    p.add_argument("--calibrated-dir", help="where fused variants are saved and reused (e.g. /tmp/quantmla-acc)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}; a calibrated "
                   "family may name its own seeds, e.g. quantmla_allq@0 or quantmla@0+1")
    p.add_argument("--bits", default="C4R4,C2R4")
    p.add_argument("--protect", default="on,off", help="on, off or on,off")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32, help="decoded tokens per forward (keep it below the 128 recent "
                   "tokens: the chunk's own tokens are exact, as the recent window keeps them anyway)")
    p.add_argument("--windows", type=int, default=64, help="windows per text (the intervals are over windows)")
    p.add_argument("--batch", type=int, default=8, help="windows decoded together (one cache per batch)")
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
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    methods = expand_methods(families, parse_bits(args.bits), protect, seeds)
    results = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
               "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}, "texts": {}, "calibration": {}}
    out = Path(args.out)

    calib_stream = None
    variants = list(dict.fromkeys(m.variant for m in methods))
    if any(v not in ("base", "hadamard") for v in variants) or args.ratio_windows:
        if not args.calibration:
            raise ValueError("smooth/quantmla/content and the ratio need --calibration TEXT_FILE")
        calib_stream = token_ids(tokenizer, read_text(args.calibration, args.calibration_chars))
        log(f"calibration text: {calib_stream.numel()} tokens, {calib_stream.numel() // args.calibration_seq_len} "
            f"windows of {args.calibration_seq_len}; {args.calibration_samples} drawn per seed")
    cache_dir = Path(args.calibrated_dir) if args.calibrated_dir else None
    loaded = {"base": base}
    base_digest = model_digest(base)

    def recipe_for(seed: int) -> CalibrationRecipe:
        ids = (calibration_windows(calib_stream, args.calibration_samples, args.calibration_seq_len, seed)
               if calib_stream is not None else torch.zeros(2, 8, dtype=torch.long))
        return CalibrationRecipe(ids=ids, steps=args.calibration_steps, lr=args.calibration_lr, seed=seed,
                                 protection=args.calibration_protection, machine=args.calibrated_on)

    def models_get(v: str):
        """The model of variant `v`, calibrated (or loaded from --calibrated-dir) on first use."""
        if v not in loaded:
            seed = int(re.search(r"-seed(\d+)$", v).group(1)) if re.search(r"-seed(\d+)$", v) else 0
            loaded[v], info = calibrate_variant(base, v, recipe_for(seed), cache_dir, base_digest)
            results["calibration"][v] = info
            how = "loaded from --calibrated-dir (calibrated earlier in" if info["loaded"] else "calibrated in"
            log(f"variant {v}: {how} {info['seconds']:.0f} s{')' if info['loaded'] else ''}")
        return loaded[v]

    if args.calibrate_only:
        for v in variants:
            models_get(v)
        out.write_text(markdown(results))
        return 0

    if args.ratio_windows:
        from quantmla_hf.evaluation.analysis import analyze

        start = time.time()
        # Held-out windows: windows of the calibration text that no seed drew.
        T = args.calibration_seq_len
        n = calib_stream.numel() // T
        drawn = set()
        for seed in seeds:
            drawn |= set(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: args.calibration_samples]
                         .tolist())
        free = [i for i in range(n) if i not in drawn][: args.ratio_windows]
        held = calib_stream[: n * T].view(n, T)[free]
        report = analyze(base, held, progress=False)
        results["ratio"] = {**report.to_dict(), "markdown": report.to_markdown(), "seconds": time.time() - start}
        if args.ratio_plot:
            plot_ratio(report, args.ratio_plot)
        log(f"ratio {report.ratio:.3f} in {time.time() - start:.0f} s")

    for text_path in args.text:
        ids = token_ids(tokenizer, read_text(text_path, args.max_chars))
        n_windows = min(args.windows, ids.numel() // args.window)
        if n_windows < args.windows:
            log(f"{text_path}: only {n_windows} windows of {args.window} in --max-chars {args.max_chars}")
        label = f"{Path(text_path).name} ({n_windows} windows of {args.window}, prefill {args.prefill}, " \
                f"chunk {args.chunk}, {n_windows * (args.window - args.prefill)} scored tokens)"
        rows, ref_lp, ref_greedy = [], None, None
        prompts = None
        if args.greedy_prompts:
            prompts = torch.stack([ids[i * args.window : i * args.window + args.greedy_prompt_len]
                                   for i in range(args.greedy_prompts)])
        reusable = {}
        if args.reuse_rows:
            earlier = json.loads(Path(args.reuse_rows).read_text())
            same = ("text", "max_chars", "window", "prefill", "chunk", "windows", "batch", "model")
            if any(earlier["settings"].get(k) != results["settings"].get(k) for k in same if k != "text") or \
                    text_path not in earlier["settings"]["text"]:
                raise ValueError(f"--reuse-rows {args.reuse_rows} was run with other text settings; rerun those rows")
            reusable = {r["method"]: r for r in earlier["texts"].get(label, []) if r["spec"]["family"] != "bf16"}
        for method in methods:
            name = method.name + (f" [{args.calibrated_on}]" if args.calibrated_on and method.calibrated else "")
            if name in reusable:
                rows.append({**reusable[name], "reused_from": args.reuse_rows})
                log(f"{Path(text_path).name} | {name}: taken from {args.reuse_rows}")
                continue
            model = models_get(method.variant)
            make = make_cache_factory(method, model.config)
            start = time.time()
            scores, kept = window_scores(model, ids, make, args.window, args.prefill, args.chunk, n_windows,
                                         args.batch, ref_lp)
            if method.family == "bf16":
                ref_lp = kept
            row = {"method": name, "spec": asdict(method), "machine": args.calibrated_on if method.calibrated else "",
                   **{k: v.tolist() for k, v in scores.items()}}
            if prompts is not None:
                toks = greedy_tokens(model, prompts, args.greedy_steps, make)
                if method.family == "bf16":
                    ref_greedy = toks
                elif ref_greedy is not None:
                    row["greedy"], row["greedy_prefix"] = agreement(ref_greedy, toks)
            row["seconds"] = time.time() - start
            rows.append(row)
            log(f"{Path(text_path).name} | {name}: ppl {math.exp(scores['nll'].mean()):.3f} "
                f"kl {float(scores['kl'].mean()) if 'kl' in scores else 0:.5f} ({row['seconds']:.0f} s)")
            results["texts"][label] = rows
            out.with_suffix(".json").write_text(json.dumps(results, indent=1))
            out.write_text(markdown(results))
        del ref_lp

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
