"""Held-out accuracy of calibration recipes against a reference recipe: which shorter recipe loses nothing.

    python benchmarks/calibration_recipes.py --text ../shared/data/wikitext-2-raw-test.raw \\
        --recipes default:64:512:8:100:auto,cpu:32:256:8:25:auto --bits C4R4,C2R4 --seeds 0,1,2 --out recipes.json

A recipe is `NAME:WINDOWS:TOKENS:BATCH:STEPS:PROTECTION[:SEEDS[:LR]]` (calibration windows and their length, windows
per step, Adam steps per layer and path, `calibrate`'s `calibration_protection`, its own seeds joined by "+" instead
of `--seeds` (empty for `--seeds`), and its own learning rate instead of `--lr`); the first one is the reference. Every recipe
calibrates learned transforms on the package's default text (`--calibration default`, what `QuantMLAConfig()` uses
without text of yours) or on `--calibration FILE`, with each seed drawing its own windows and seeding Adam, at each
`--bits` setting; every calibrated model and RTN are scored on `--windows` windows of the held-out `--text` through
the cache (4 sink + 128 recent tokens protected; `benchmarks/accuracy.py`'s decode protocol: prefill, then chunks)
against the unquantized cache. Printed per recipe and bits: the seed-mean perplexity change and KL, and the paired
95% intervals (`quantmla_hf.evaluation.intervals`, over windows, seed means per window) of its KL over the reference recipe's
and over RTN's. A ratio whose interval holds 1 is a tie; "loses nothing" needs the upper bound near 1 too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as harness  # noqa: E402

from quantmla_hf.calibration.defaults import DEFAULT_TEXT  # noqa: E402
from quantmla_hf.evaluation.intervals import bootstrap, perplexity_change, ratio_of_means  # noqa: E402


def parse_recipe(spec: str) -> dict:
    try:
        name, n, t, b, s, prot, *rest = spec.split(":")
        if len(rest) > 2:
            raise ValueError("too many fields")
        out = dict(name=name, samples=int(n), seq_len=int(t), batch=int(b), steps=int(s), protection=prot,
                   seeds=[int(x) for x in rest[0].split("+")] if rest and rest[0] else None,
                   lr=float(rest[1]) if len(rest) > 1 else None)
    except ValueError as err:
        raise SystemExit(f"--recipes item {spec!r} is not NAME:WINDOWS:TOKENS:BATCH:STEPS:PROTECTION[:SEEDS[:LR]] "
                         f"({err})")
    if out["protection"] not in ("auto", "on", "off"):
        raise SystemExit(f"--recipes item {spec!r}: protection must be auto, on or off")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(harness.DEFAULT_MODEL))
    p.add_argument("--text", required=True, help="held-out evaluation text (.xz read with lzma)")
    p.add_argument("--max-chars", type=int, default=400_000)
    p.add_argument("--calibration", default="default", help="'default' (the package's text) or a text file")
    p.add_argument("--recipes", required=True, help="comma list of NAME:WINDOWS:TOKENS:BATCH:STEPS:PROTECTION[:SEEDS[:LR]]")
    p.add_argument("--calibrated-dir", default=None, help="store and reuse calibrated models here (keyed by recipe)")
    p.add_argument("--bits", default="C4R4,C2R4")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="evaluation windows decoded together")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="JSON with every row's per-window values and the summary")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import quantmla_hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)  # noqa: E731
    recipes = [parse_recipe(s) for s in args.recipes.split(",") if s.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().to(args.device)
    cache_dir = Path(args.calibrated_dir) if args.calibrated_dir else None
    calib_path = str(DEFAULT_TEXT) if args.calibration == "default" else args.calibration
    stream = harness.token_ids(tokenizer, harness.read_text(calib_path))
    ids = harness.token_ids(tokenizer, harness.read_text(args.text, args.max_chars)).to(args.device)
    n_windows = min(args.windows, ids.numel() // args.window)
    score = lambda model, method, ref=None: harness.window_scores(  # noqa: E731
        model, ids, harness.make_cache_factory(method, model.config), args.window, args.prefill, args.chunk,
        n_windows, args.batch, ref)
    results = {"command": "python " + " ".join(sys.argv), "settings": vars(args), "device": args.device,
               "torch": torch.__version__, "rows": {}, "summary": []}
    with torch.no_grad():
        _, ref_lp = score(base, harness.Method("bf16"))
        results["rows"]["bf16"] = {"nll": score(base, harness.Method("bf16"), ref_lp)[0]["nll"].tolist()}
    bf16_nll = torch.tensor(results["rows"]["bf16"]["nll"], dtype=torch.float64)
    for c, r in harness.parse_bits(args.bits):
        method = harness.Method("rtn", c, r)
        with torch.no_grad():
            rtn = score(base, method, ref_lp)[0]
        results["rows"][f"RTN C{c}R{r}"] = {k: v.tolist() for k, v in rtn.items()}
        log(f"RTN C{c}R{r}: KL {float(rtn['kl'].mean()):.5f}")
        means = {}
        for recipe in recipes:
            kls, nlls, seconds = [], [], []
            for seed in recipe["seeds"] or seeds:
                windows = harness.calibration_windows(stream, recipe["samples"], recipe["seq_len"], seed)
                cal = harness.CalibrationRecipe(ids=windows, steps=recipe["steps"], lr=recipe["lr"] or args.lr, seed=seed,
                                                batch_size=recipe["batch"], protection=recipe["protection"])
                model, info = harness.calibrate_variant(base, f"learned-C{c}R{r}-seed{seed}", cal, cache_dir)
                with torch.no_grad():
                    scores = score(model, harness.Method("quantmla", c, r, seed=seed), ref_lp)[0]
                del model
                name = f"{recipe['name']} C{c}R{r} seed {seed}"
                results["rows"][name] = {**{k: v.tolist() for k, v in scores.items()}, "seconds": info["seconds"],
                                         "protection": info["record"].get("protection")}
                kls.append(scores["kl"])
                nlls.append(scores["nll"])
                seconds.append(info["seconds"])
                log(f"{name}: KL {float(scores['kl'].mean()):.5f} in {info['seconds']:.1f} s "
                    f"({info['record'].get('protection')})")
            means[recipe["name"]] = (torch.stack(kls).mean(0), torch.stack(nlls).mean(0), seconds)
        ref_name = recipes[0]["name"]
        for recipe in recipes:
            kl, nll, seconds = means[recipe["name"]]
            row = {"bits": f"C{c}R{r}", "recipe": recipe, "kl": float(kl.mean()),
                   "ppl_change": bootstrap(perplexity_change, nll, bf16_nll).fmt(2, 100, sign=True) + "%",
                   "kl_over_rtn": bootstrap(ratio_of_means, kl, rtn["kl"]).fmt(3),
                   "kl_over_reference": bootstrap(ratio_of_means, kl, means[ref_name][0]).fmt(3),
                   "calibration_seconds": seconds}
            results["summary"].append(row)
            print(f"C{c}R{r} {recipe['name']:>10}: KL {row['kl']:.5f}  ppl {row['ppl_change']}  "
                  f"/RTN {row['kl_over_rtn']}  /{ref_name} {row['kl_over_reference']}  "
                  f"calibration {min(seconds):.1f}-{max(seconds):.1f} s", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    results["seconds"] = time.time() - start
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
