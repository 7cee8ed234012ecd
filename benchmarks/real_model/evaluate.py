"""Accuracy of the QuantMLA cache on the converted SmolLM2 (a real pretrained model), with paired bootstrap intervals.

Rows (each decoded the way `benchmarks/accuracy.py` does: per window, the first `--prefill` tokens are prefilled,
the rest fed through the cache in chunks of `--chunk` tokens and scored):
    llama       the original Llama, unquantized: what the conversion costs
    bf16        the converted model, unquantized latent cache: the reference of every KL below
                (both scored with one causal forward per window, which for an exact cache equals prefill + chunked
                decode up to float rounding; `tests/test_real_model_conversion.py` checks it)
    rtn/smooth/quarot/quantmla/content/rope/quanto   as in benchmarks/accuracy.py (one calibration seed, 0; calibrated
                variants are stored in and reused from `--calibrated-dir`, keyed by `accuracy.calibration_key`)

Calibration: the first `--calibration-samples` windows of `--calibration-seq-len` tokens of `--calibration` (in
order, not drawn). The objectives model the protection of the row's cache: a protected row's variant is calibrated
with `calibration_protection=--calibration-protection` (default "on": 4 sink + 128 recent), an unprotected row's with
"off" (every cached token quantized), so the two are different calibrated models (different keys).

Statistics: per window we keep the summed NLL, the summed KL(BF16 || row) and the top-1 agreement count. Windows are
resampled with replacement (`--bootstrap` times, the same resample for every row: paired), giving 95% percentile
intervals of the perplexity change vs BF16, of the mean KL, and of paired comparisons: every non-RTN quantized row
against RTN at the same bits and protection, and QuantMLA against the other transforms at its setting (difference of
perplexity change, difference of mean KL, and the KL ratio `mean KL / mean KL of the other`, whose interval comes
from `quantmla_hf.evaluation.intervals.bootstrap` on the same resamples; "tie" when it contains 1).

Example:
    python benchmarks/real_model/evaluate.py --model /tmp/realmodel/mla-dc256 --llama /tmp/realmodel/llama \\
        --text ../shared/data/wiki_en_val.txt.xz --calibration ../shared/data/wiki_en_train.txt.xz \\
        --calibrated-dir /tmp/realmodel/calibrated-dc256 --out /tmp/realmodel/val.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

from quantmla_hf.evaluation.intervals import Interval, bootstrap, ratio_of_means

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared harness
import accuracy as harness  # noqa: E402

sys.path.insert(0, str(HERE))
from one_pass_capture import one_pass_capture  # noqa: E402


# ---------------------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def window_logprobs(model, seq: torch.Tensor, make_cache, prefill: int, chunk: int) -> torch.Tensor:
    """Log-probabilities `[W - prefill, V]` (fp32) of the decoded positions of one window `seq: [W]`.

    Row `j` predicts `seq[prefill + j]`; the prompt `seq[:prefill]` is prefilled, then `seq[prefill:W-1]` is fed
    through the cache `chunk` tokens at a time (as `quantmla_hf.evaluation.perplexity.decode_perplexity` does).
    """
    name = harness.cache_kwarg(model)
    cache = make_cache()
    out = model(seq[None, :prefill], **{name: cache}, use_cache=True)
    parts = [out.logits[0, -1:]]
    for start in range(prefill, seq.numel() - 1, chunk):
        end = min(start + chunk, seq.numel() - 1)
        out = model(seq[None, start:end], **{name: cache}, use_cache=True)
        parts.append(out.logits[0])
    return torch.log_softmax(torch.cat(parts).float(), -1)


@torch.no_grad()
def window_logprobs_exact(model, seq: torch.Tensor, prefill: int) -> torch.Tensor:
    """What `window_logprobs` computes for an unquantized cache, in one forward: with an exact cache, prefill +
    chunked decode and a single causal forward give the same logits up to float rounding."""
    return torch.log_softmax(model(seq[None, :-1], use_cache=False).logits[0, prefill - 1 :].float(), -1)


def window_stats(lp: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None) -> dict:
    """Summed NLL, token count, and (against reference log-probs `ref`) summed KL(ref || lp) and top-1 matches."""
    out = {"nll": float(-lp.gather(1, targets[:, None]).sum()), "n": int(targets.numel())}
    if ref is not None:
        out["kl"] = float((ref.exp() * (ref - lp)).sum())
        out["top1"] = int((ref.argmax(-1) == lp.argmax(-1)).sum())
    return out


# -------------------------------------------------------------------------------------------------- bootstrap


def bootstrap_indices(n_windows: int, draws: int, seed: int = 0) -> torch.Tensor:
    """`[draws, n_windows]` window indices drawn with replacement (shared by all rows: paired comparisons)."""
    return torch.randint(0, n_windows, (draws, n_windows), generator=torch.Generator().manual_seed(seed))


def _agg(rows: list[dict], key: str, idx: torch.Tensor) -> torch.Tensor:
    v = torch.tensor([r[key] for r in rows], dtype=torch.float64)
    return v[idx].sum(-1)


def ppl_change(rows, ref_rows, idx) -> torch.Tensor:
    """Relative perplexity change vs the reference, per bootstrap draw (and the point estimate when idx is all)."""
    nll = _agg(rows, "nll", idx) / _agg(rows, "n", idx)
    ref = _agg(ref_rows, "nll", idx) / _agg(ref_rows, "n", idx)
    return torch.exp(nll - ref) - 1


def mean_kl(rows, idx) -> torch.Tensor:
    return _agg(rows, "kl", idx) / _agg(rows, "n", idx)


def interval(draws: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=draws.dtype)).tolist()
    return lo, hi


def setting_of(name: str) -> tuple[str, str] | None:
    """`(method label, setting)` of a quantized row name, e.g. "QuaRot† C2R4, no protection" ->
    ("QuaRot†", "C2R4, no protection"); None for rows without a bit setting (BF16, Llama, quanto)."""
    m = re.fullmatch(r"(.+?) (C\d+R\d+.*)", name)
    return (m.group(1), m.group(2)) if m else None


def comparisons(rows) -> list[tuple[str, str]]:
    """`(row, against)` pairs among the row names `rows` (in order): every non-RTN quantized row against RTN at the
    same bits and protection; every QuantMLA (learned) row also against the other non-RTN rows of its setting."""
    parsed = {name: setting_of(name) for name in rows}
    out = []
    for name, ps in parsed.items():
        if ps is None or ps[0] == "RTN":
            continue
        rtn = f"RTN {ps[1]}"
        if rtn in parsed:
            out.append((name, rtn))
        if ps[0] == "QuantMLA":
            out += [(name, other) for other, po in parsed.items()
                    if po is not None and po[1] == ps[1] and po[0] not in ("RTN", "QuantMLA")]
    return out


def kl_ratio(rows, other_rows, draws: int) -> Interval:
    """Mean KL of `rows` over the mean KL of `other_rows` (the same windows, each with `kl` summed over `n` tokens)
    with its 95% paired bootstrap interval (`quantmla_hf.evaluation.intervals.bootstrap`, `draws` resamples, the seed of
    `bootstrap_indices`, so the resamples are those of every other interval here)."""
    a = torch.tensor([r["kl"] / r["n"] for r in rows], dtype=torch.float64)
    b = torch.tensor([r["kl"] / r["n"] for r in other_rows], dtype=torch.float64)
    if any(r["n"] != rows[0]["n"] for r in list(rows) + list(other_rows)):
        raise ValueError("kl_ratio needs windows of equal scored length (a ratio of means of per-window means)")
    return bootstrap(ratio_of_means, a, b, resamples=draws, seed=0)


def verdict(ratio: Interval) -> str:
    """"lower" / "higher" KL when the ratio's 95% interval excludes 1, else "tie"."""
    return "lower" if ratio.high < 1 else "higher" if ratio.low > 1 else "tie"


def summarize(results: dict, draws: int) -> dict:
    """Point estimates and 95% intervals of every row against BF16, and of learned - RTN differences. Rows scored
    against the BF16 log-probabilities of another `--out` (its `.ref` folder), with no BF16 row here, get their
    perplexity and KL only (a perplexity change needs the BF16 row's NLL: pair the two `.json` with
    `pair_rows.py`)."""
    rows = results["rows"]
    ref = rows.get("BF16 cache")
    if ref is None and not rows:
        return {}
    n = len(ref["windows"]) if ref is not None else min(len(r["windows"]) for r in rows.values())
    idx = bootstrap_indices(n, draws)
    full = torch.arange(n)[None]
    summary = {}
    for name, row in rows.items():
        w = row["windows"][:n]
        if len(w) < n or not w:
            continue
        s = {"ppl": math.exp(sum(x["nll"] for x in w) / sum(x["n"] for x in w))}
        if ref is not None:
            s.update(dppl=float(ppl_change(w, ref["windows"], full)),
                     dppl_ci=interval(ppl_change(w, ref["windows"], idx)))
        if "kl" in w[0]:
            s.update(kl=float(mean_kl(w, full)), kl_ci=interval(mean_kl(w, idx)),
                     top1=sum(x["top1"] for x in w) / sum(x["n"] for x in w))
        summary[name] = s
    pairs = {}
    for name, other in comparisons(summary) if ref is not None else ():
        a, b = rows[name]["windows"][:n], rows[other]["windows"][:n]
        d_ppl = ppl_change(a, ref["windows"], idx) - ppl_change(b, ref["windows"], idx)
        d_kl = mean_kl(a, idx) - mean_kl(b, idx)
        ratio = kl_ratio(a, b, draws)
        pairs[f"{name} - {other}"] = {
            "dppl": summary[name]["dppl"] - summary[other]["dppl"], "dppl_ci": interval(d_ppl),
            "dkl": summary[name]["kl"] - summary[other]["kl"], "dkl_ci": interval(d_kl),
            "kl_ratio": ratio.value, "kl_ratio_ci": (ratio.low, ratio.high), "verdict": verdict(ratio)}
    return {"windows": n, "draws": draws, "rows": summary, "comparisons": pairs}


def markdown(results: dict) -> str:
    lines = [f"Earlier command (rows kept): `{c}`" for c in results.get("earlier_commands", [])]
    lines += [f"Command: `{results['command']}`", ""]
    for text, res in results["texts"].items():
        s = res.get("summary") or {}
        lines += [f"#### {text} ({s.get('windows', '?')} windows; 95% paired bootstrap over windows, "
                  f"{s.get('draws', '?')} draws)", "",
                  "| row | decode ppl | Δ ppl vs BF16 [95% CI] | KL(BF16‖row) [95% CI] | top-1 agree |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, r in s.get("rows", {}).items():
            kl = f"{r['kl']:.4f} [{r['kl_ci'][0]:.4f}, {r['kl_ci'][1]:.4f}]" if "kl" in r else "—"
            top1 = f"{r['top1']:.3f}" if "top1" in r else "—"
            dppl = (f"{100 * r['dppl']:+.2f}% [{100 * r['dppl_ci'][0]:+.2f}, {100 * r['dppl_ci'][1]:+.2f}]"
                    if "dppl" in r else "— (no BF16 row here)")
            lines.append(f"| {name} | {r['ppl']:.3f} | {dppl} | {kl} | {top1} |")
        if s.get("comparisons"):
            lines += ["", "| paired comparison (row - other) | Δppl (pct points) [95% CI] | ΔKL [95% CI] | "
                      "KL / other's KL [95% CI] | KL verdict |", "| --- | ---: | ---: | ---: | --- |"]
            for name, d in s["comparisons"].items():
                ratio = (f"{d['kl_ratio']:.3f} [{d['kl_ratio_ci'][0]:.3f}, {d['kl_ratio_ci'][1]:.3f}] | {d['verdict']}"
                         if "kl_ratio" in d else "— | —")
                lines.append(f"| {name} | {100 * d['dppl']:+.2f} [{100 * d['dppl_ci'][0]:+.2f}, "
                             f"{100 * d['dppl_ci'][1]:+.2f}] | {d['dkl']:+.4f} [{d['dkl_ci'][0]:+.4f}, "
                             f"{d['dkl_ci'][1]:+.4f}] | {ratio} |")
        lines.append("")
    for key in ("greedy", "needle", "ratio", "calibration"):
        if results.get(key):
            lines += [f"#### {key}", "", "```", json.dumps(results[key], indent=1)[:6000], "```", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- main


LR, SEED, BATCH = 5e-3, 0, 8  # calibration learning rate, seed and batch (the library's defaults)


def calibration_protection_for(method, protected_setting: str) -> str:
    """What the objectives of `method`'s variant model: the row's own protection for the learned variants
    (`protected_setting` when its cache protects sink/recent tokens, "off" when it does not); "off" for variants
    whose calibration does not read it (base, hadamard, smooth)."""
    learns = method.variant.startswith("learned")
    return (protected_setting if method.protect else "off") if learns else "off"


def calibrated_variant(base, variant: str, ids: torch.Tensor, steps: int, protection: str, cache_dir: Path | None,
                       base_digest: str = "", seed: int = SEED):
    """`(model, info)`: `base` with the transform of `variant` fused, calibrated on `ids: [N, T]` (`steps` steps per
    layer and path, learning rate `LR`, `seed`, batch `BATCH`, `calibration_protection=protection`) with every
    calibrated layer by layer as the library does; reused from `cache_dir` when a model of the same key
    (`accuracy.calibration_key`) is stored there, and a stored file of another key is refused.
    `info` as `accuracy.calibrate_variant` returns it (seconds, loaded, record, key)."""
    recipe = harness.CalibrationRecipe(ids=ids, steps=steps, lr=LR, seed=seed, batch_size=BATCH,
                                       protection=protection)
    return harness.calibrate_variant(base, variant, recipe, cache_dir, base_digest)


def chat_prompts(tokenizer) -> list[torch.Tensor]:
    questions = ["What is the capital of France?", "Write one sentence about the ocean.",
                 "List three primary colors.", "How many legs does a spider have?",
                 "Explain photosynthesis in one sentence.", "What is 12 times 12?",
                 "Name a famous painting by Leonardo da Vinci.", "Translate 'thank you' into Spanish."]
    out = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    from transformers import DynamicCache

    return model.generate(prompt[None], max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                          pad_token_id=0, **{harness.cache_kwarg(model): DynamicCache(config=model.config)})[0,
                                                                                                            prompt.numel():]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="converted deepseek_v3 checkpoint folder")
    p.add_argument("--llama", help="the original Llama checkpoint folder (rows 'llama', greedy agreement)")
    p.add_argument("--text", nargs="*", default=[])
    p.add_argument("--max-chars", type=int, default=600_000)
    p.add_argument("--methods", default="llama,bf16,rtn,smooth,quarot,quantmla")
    p.add_argument("--bits", default="C4R4,C2R4")
    p.add_argument("--protect", default="on")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prefill", type=int, default=384)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--calibration", help="calibration text (wiki_en_train; never an evaluation text), or 'default': "
                   "the package's default calibration text (quantmla_hf/assets/calibration_default)")
    p.add_argument("--seeds", default="0", help="calibration seeds, e.g. 0,1,2: with one seed (0) the first "
                   "--calibration-samples windows are used in order; with several, each seed draws its windows "
                   "(accuracy.calibration_windows) and seeds Adam, and each seed is its own row")
    p.add_argument("--calibration-chars", type=int, default=1_500_000)
    p.add_argument("--calibration-samples", type=int, default=8)
    p.add_argument("--calibration-seq-len", type=int, default=256)
    p.add_argument("--calibration-steps", type=int, default=10)
    p.add_argument("--calibration-protection", default="on", choices=("auto", "on", "off"),
                   help="what the objectives of a protected row's variant model (quantize's calibration_protection); "
                        "an unprotected row's variant is always calibrated with 'off'")
    p.add_argument("--calibrated-dir", help="where calibrated variants are saved and reused (keyed by everything that "
                   "changes them: benchmarks/accuracy.py calibration_key)")
    p.add_argument("--greedy-steps", type=int, default=0, help="greedy agreement Llama vs converted (0: skip)")
    p.add_argument("--needle-lengths", default="")
    p.add_argument("--needle-methods", default="bf16")
    p.add_argument("--needle-text", default="../shared/data/wiki_en_val.txt.xz")
    p.add_argument("--ratio-windows", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the models run and calibrate, e.g. cuda (perplexity and "
                   "KL rows only; greedy, needle and ratio run on cpu)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device != "cpu" and (args.greedy_steps or args.needle_lengths or args.ratio_windows):
        p.error("--device other than cpu scores the perplexity/KL rows only; run --greedy-steps, --needle-lengths "
                "and --ratio-windows with --device cpu")
    torch.set_num_threads(1)
    import quantmla_hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    t0 = time.time()
    log = lambda m: print(f"[{time.time() - t0:7.1f}s] {m}", flush=True)  # noqa: E731
    out = Path(args.out)
    results = {"command": "python " + " ".join(sys.argv), "settings": vars(args), "texts": {}, "calibration": {}}
    if out.with_suffix(".json").exists():  # resume: rows already scored are kept
        old = json.loads(out.with_suffix(".json").read_text())
        if old.get("settings", {}).get("window") == args.window and old["settings"].get("prefill") == args.prefill:
            results["texts"] = old.get("texts", {})
            results["calibration"] = old.get("calibration", {})
            results["earlier_commands"] = old.get("earlier_commands", []) + [old["command"]]

    def save():
        for res in results["texts"].values():
            res["summary"] = summarize(res, args.bootstrap)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        out.write_text(markdown(results))

    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    llama = AutoModelForCausalLM.from_pretrained(args.llama, dtype=torch.float32).to(args.device).eval() \
        if args.llama else None
    families = [m.strip() for m in args.methods.split(",") if m.strip()]
    protect = [{"on": True, "off": False}[x] for x in args.protect.split(",")]
    # One calibration seed (0), and row names without "(seed 0)" (the names of the published rows).
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    methods = harness.expand_methods([f for f in families if f != "llama"], harness.parse_bits(args.bits), protect,
                                     seeds=[None] if seeds == [0] else seeds)
    calib = calib_flat = None
    if args.calibration:
        if args.calibration == "default":
            from quantmla_hf.calibration.defaults import default_calibration_text

            text = default_calibration_text()[: args.calibration_chars]
        else:
            text = harness.read_text(args.calibration, args.calibration_chars)
        calib_flat = harness.token_ids(tok, text)
        n = calib_flat.numel() // args.calibration_seq_len
        calib = calib_flat[: n * args.calibration_seq_len].view(n, args.calibration_seq_len)
    cache_dir = Path(args.calibrated_dir) if args.calibrated_dir else None
    base_digest = harness.model_digest(base)
    loaded = {}

    def variant(method):
        """The model `method` runs on, calibrated for its cache's protection (or reused from --calibrated-dir)."""
        protection = calibration_protection_for(method, args.calibration_protection)
        seed = method.seed or 0
        if (method.variant, protection) not in loaded:
            if calib is None and method.variant not in ("base", "hadamard"):
                raise ValueError(f"variant {method.variant} needs --calibration")
            if calib is None:
                sel = torch.zeros(2, 8, dtype=torch.long)
            elif seeds == [0]:
                sel = calib[: args.calibration_samples]
            else:
                sel = harness.calibration_windows(calib_flat, args.calibration_samples, args.calibration_seq_len, seed)
            model, info = calibrated_variant(base, method.variant, sel, args.calibration_steps, protection, cache_dir,
                                             base_digest, seed)
            loaded[(method.variant, protection)] = model
            if method.variant != "base":
                record = info.get("record") or {}
                results["calibration"][f"{method.variant}, protection {protection}"] = {
                    "seconds": info["seconds"], "loaded": info["loaded"], "key": info["key"],
                    "protection_modelled": record.get("protection_modelled"), "windows": record.get("windows")}
                how = "reused from --calibrated-dir (calibrated earlier in" if info["loaded"] else "calibrated in"
                log(f"variant {method.variant} (calibration_protection {protection}): {how} {info['seconds']:.0f} s"
                    f"{')' if info['loaded'] else ''}")
        return loaded[(method.variant, protection)]

    if args.greedy_steps and llama is not None:
        rows = []
        for prompt in chat_prompts(tok):
            a, b = greedy(llama, prompt, args.greedy_steps), greedy(base, prompt, args.greedy_steps)
            same = (a == b).long()
            rows.append({"prompt": tok.decode(prompt), "llama": tok.decode(a), "converted": tok.decode(b),
                         "agree": float(same.float().mean()), "prefix": int(same.cumprod(0).sum())})
            log(f"greedy: prefix {rows[-1]['prefix']}/{args.greedy_steps}: {rows[-1]['converted']!r}")
        results["greedy"] = {"steps": args.greedy_steps, "mean_agree": sum(r["agree"] for r in rows) / len(rows),
                             "mean_prefix": sum(r["prefix"] for r in rows) / len(rows), "prompts": rows}
        save()

    if args.ratio_windows:
        from quantmla_hf.evaluation.analysis import analyze

        start = time.time()
        held = calib[args.calibration_samples : args.calibration_samples + args.ratio_windows]
        with one_pass_capture():
            report = analyze(base, held, progress=False)
        results["ratio"] = {**report.to_dict(), "markdown": report.to_markdown(), "seconds": time.time() - start}
        log(f"ratio {report.ratio:.3f} ({time.time() - start:.0f} s)")
        save()

    for text in args.text:
        ids = harness.token_ids(tok, harness.read_text(text, args.max_chars))
        n_win = min(args.windows, ids.numel() // args.window)
        res = results["texts"].setdefault(Path(text).name, {"rows": {}})
        ref_dir = out.parent / f"{out.stem}.ref" / Path(text).name
        ref_dir.mkdir(parents=True, exist_ok=True)
        order = (["llama"] if "llama" in families and llama is not None else []) + methods
        if "bf16" in families:  # the reference first: every KL needs it
            order = [m for m in order if getattr(m, "family", None) == "bf16"] + \
                [m for m in order if getattr(m, "family", None) != "bf16"]
        for method in order:
            name = "Llama (original)" if method == "llama" else method.name
            row = res["rows"].setdefault(name, {"windows": []})
            if len(row["windows"]) >= n_win:
                continue
            model = llama if method == "llama" else variant(method)
            make = (lambda: DynamicCache(config=llama.config)) if method == "llama" else \
                harness.make_cache_factory(method, model.config)
            start = time.time()
            for w in range(len(row["windows"]), n_win):
                seq = ids[w * args.window : (w + 1) * args.window]
                exact = method == "llama" or method.family == "bf16"
                on = seq.to(args.device)
                lp = window_logprobs_exact(model, on, args.prefill) if exact else \
                    window_logprobs(model, on, make, args.prefill, args.chunk)
                lp = lp.cpu()
                ref_path = ref_dir / f"{w}.pt"
                if method != "llama" and method.family == "bf16":
                    torch.save(lp, ref_path)
                    ref = None
                else:
                    if not ref_path.exists():
                        raise FileNotFoundError(
                            f"the BF16 reference log-probabilities of window {w} are missing ({ref_path}): they are "
                            f"written when the bf16 row is scored into this --out; a BF16 row reused from "
                            f"{out.with_suffix('.json').name} needs its {out.stem}.ref folder too (rerun with a fresh "
                            "--out, or copy/link the .ref folder of the --out that scored it)")
                    ref = torch.load(ref_path)
                row["windows"].append(window_stats(lp, seq[args.prefill :], ref))
            row["seconds"] = time.time() - start
            save()
            s = res["summary"].get("rows", {}).get(name, {})
            dppl = f"{100 * s['dppl']:+.2f}%" if "dppl" in s else "n/a (no BF16 row in this --out)"
            log(f"{Path(text).name} | {name}: ppl {s.get('ppl', float('nan')):.3f} dppl {dppl} "
                f"kl {s.get('kl', float('nan')):.4f} ({row['seconds']:.0f} s)")

    if args.needle_lengths:
        filler = harness.token_ids(tok, harness.read_text(args.needle_text, 200_000))
        wanted = [m.strip() for m in args.needle_methods.split(",") if m.strip()]
        results["needle"] = []
        for method in methods:
            if method.family not in wanted and method.name not in wanted:
                continue
            model = variant(method)
            make = harness.make_cache_factory(method, model.config)
            by_length = {}
            for n in [int(x) for x in args.needle_lengths.split(",")]:
                trials = harness.needle_trials(tok, filler, n, [0.25, 0.75], [1, 3], seed=n)
                answers = harness.needle_answers(model, trials, make, tail=64, answer_tokens=6, chunk=args.chunk,
                                                 tokenizer=tok)
                hits = [harness.exact_match(t.answer, a) for t, a in zip(trials, answers)]
                by_length[n] = {"hits": sum(hits), "trials": len(hits),
                                "answers": [f"{t.answer} -> {a!r}" for t, a in zip(trials, answers)]}
                log(f"needle {method.name} {n}: {sum(hits)}/{len(hits)} {by_length[n]['answers']}")
            results["needle"].append({"method": method.name, "by_length": by_length})
            save()
    save()
    log(f"done; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
