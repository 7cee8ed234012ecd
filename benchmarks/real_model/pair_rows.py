"""Compare one row of an `evaluate.py` output with a row of another output, window by window (paired).

    python benchmarks/real_model/pair_rows.py A.json "ROW A" B.json "ROW B" [--text wiki_en_val.txt.xz]

Both outputs must have scored the same windows of the same text (same --window, --prefill, --windows) against the
same BF16 reference (copy the .ref folder, as evaluate.py's error says). Prints the mean KL of each row, the ratio
KL(A) / KL(B) and the perplexity ratio with paired bootstrap 95% intervals over windows
(`quantmla_hf.evaluation.intervals.bootstrap`): e.g. learned transforms calibrated on the default text (A) against the same
recipe calibrated on the model's training text (B).
"""

from __future__ import annotations

import argparse
import json

import torch

from quantmla_hf.evaluation.intervals import bootstrap, ratio_of_means


def windows(path: str, row: str, text: str | None) -> tuple[str, list[dict]]:
    texts = json.load(open(path))["texts"]
    name = text or next(iter(texts))
    rows = texts[name]["rows"]
    if row not in rows:
        raise SystemExit(f"{path}: no row {row!r} for {name}; rows: {', '.join(rows)}")
    return name, rows[row]["windows"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a_json"), p.add_argument("a_row"), p.add_argument("b_json"), p.add_argument("b_row")
    p.add_argument("--text", default=None, help="text name as in the outputs (default: the first)")
    args = p.parse_args(argv)
    text, a = windows(args.a_json, args.a_row, args.text)
    _, b = windows(args.b_json, args.b_row, text)
    n = min(len(a), len(b))
    if n < 2 or any(x["n"] != y["n"] for x, y in zip(a[:n], b[:n])):
        raise SystemExit("the two rows did not score the same windows")
    kl_a = torch.tensor([w["kl"] / w["n"] for w in a[:n]], dtype=torch.float64)
    kl_b = torch.tensor([w["kl"] / w["n"] for w in b[:n]], dtype=torch.float64)
    nll_a = torch.tensor([w["nll"] / w["n"] for w in a[:n]], dtype=torch.float64)
    nll_b = torch.tensor([w["nll"] / w["n"] for w in b[:n]], dtype=torch.float64)
    out = {
        "text": text, "windows": n, "kl_a": float(kl_a.mean()), "kl_b": float(kl_b.mean()),
        "kl_ratio": bootstrap(ratio_of_means, kl_a, kl_b),
        "ppl_ratio": bootstrap(lambda x, y: torch.exp((x - y).mean(-1)), nll_a, nll_b),
    }
    print(f"{text}, {n} windows: KL {args.a_row} {out['kl_a']:.4f} / {args.b_row} {out['kl_b']:.4f} = "
          f"{out['kl_ratio'].fmt()}; perplexity ratio {out['ppl_ratio'].fmt()}")
    return out


if __name__ == "__main__":
    main()
