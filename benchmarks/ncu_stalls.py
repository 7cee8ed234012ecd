"""Where a kernel's warps wait: the warp-state samples of an Nsight Compute report, summed per stall reason, and the
instructions that collect most of one reason; with two reports, the second's excess over the first per reason.

    ncu --clock-control none -k regex:mla_decode_gluon -s 3 -c 1 --set full --warp-sampling-interval 0 -o C4R4 \
        python3 benchmarks/bench_decode.py --profile 16:1:32768:C4R4 --iters 4
    ncu -i C4R4.ncu-rep --page source --csv --print-source sass > C4R4_sass.csv
    python3 benchmarks/ncu_stalls.py C4R4_sass.csv C2R4_sass.csv [--reason stall_lg] [--top 8]
    python3 benchmarks/ncu_stalls.py C4R4_sass.csv --loops  # each innermost hot loop's samples by reason

Input: the SASS source page of one profiled kernel as CSV (a title row, a header row, one row per instruction).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> list[dict]:
    """The instruction rows of `ncu --page source --csv --print-source sass`: `{"sass": text, "samples": n,
    "executed": n, reason: n for every stall reason}` (all-sample counts; the not-issued columns are left out)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if head is None:
        raise ValueError(f"{path}: no header with 'Source' and '{SAMPLES}': write it with "
                         "`ncu -i REPORT --page source --csv --print-source sass`")
    header = rows[head]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[head + 1:]:
        if len(r) != len(header):
            continue
        cell = dict(zip(header, r))
        row = {"sass": cell["Source"].strip(), "samples": _number(cell[SAMPLES]),
               "executed": _number(cell.get(EXECUTED, "0")), "address": int(cell.get("Address", "0"), 16)}
        row.update({k: _number(cell[k]) for k in reasons})
        out.append(row)
    return out


def reason_totals(rows: list[dict]) -> collections.Counter:
    """Samples per stall reason, plus `samples` and `executed` (warp instructions) over the kernel."""
    total = collections.Counter()
    for row in rows:
        for k, v in row.items():
            if k not in ("sass", "address"):
                total[k] += v
    return total


def hot_loops(rows: list[dict], min_executed: float = 1000.0) -> list[tuple[int, int]]:
    """The innermost loops of a listing: `(first, last)` row indices of each body closed by a branch back to an
    earlier instruction of the listing that ran at least `min_executed` times, keeping only bodies that hold no other
    such body (a warp-specialized kernel: one per warpgroup's main loop)."""
    at = {row["address"]: i for i, row in enumerate(rows)}
    bodies = set()
    for i, row in enumerate(rows):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", row["sass"])
        target = at.get(int(m.group(1), 16), i) if m else i
        if target < i and row["executed"] >= min_executed:
            bodies.add((target, i))
    return sorted(b for b in bodies if not any(o != b and b[0] <= o[0] and o[1] <= b[1] for o in bodies))


def print_loops(rows: list[dict], top: int):
    """One line per innermost hot loop (`hot_loops`) holding at least 1% of the kernel's samples: its instructions,
    the `wgmma`s among them, its warp instructions executed and stall samples, and its `top` commonest stall reasons
    with their share of its samples."""
    total = sum(r["samples"] for r in rows)
    print("| loop rows | instructions | HGMMA | executed | samples (share of the kernel's) | commonest reasons |")
    print("| --- | --- | --- | --- | --- | --- |")
    for first, last in hot_loops(rows):
        body = rows[first:last + 1]
        t = reason_totals(body)
        if t["samples"] < 0.01 * total:
            continue  # a barrier's retry loop or a setup loop
        reasons = sorted((k for k in t if k.startswith("stall_")), key=lambda k: -t[k])[:top]
        hgmma = sum("HGMMA" in r["sass"] for r in body)
        share = ", ".join(f"{k[6:]} {t[k] / max(t['samples'], 1):.0%}" for k in reasons)
        print(f"| {first}-{last} | {len(body)} | {hgmma} | {t['executed']:.0f} | {t['samples']:.0f} "
              f"({t['samples'] / max(total, 1):.0%}) | {share} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="+", help="CSV source pages (one or two)")
    ap.add_argument("--reason", default="", help="list the instructions with most samples of this reason "
                                                 "(default: the reason the second page exceeds the first by most, or "
                                                 "the one page's commonest)")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--loops", action="store_true", help="per innermost hot loop of the (last) page: its samples "
                                                         "by reason (`--top` reasons)")
    args = ap.parse_args()
    if len(args.pages) > 2:
        ap.error("give one or two source pages")
    pages = [read_source_page(p) for p in args.pages]
    if args.loops:
        print_loops(pages[-1], args.top)
        return
    totals = [reason_totals(rows) for rows in pages]
    keys = ["executed", "samples"] + sorted((k for k in totals[-1] if k.startswith("stall_")),
                                            key=lambda k: -totals[-1][k])
    print("| " + " | ".join(["count"] + args.pages + (["last - first"] if len(pages) == 2 else [])) + " |")
    print("| --- " * (len(pages) + 1 + (len(pages) == 2)) + "|")
    for k in keys:
        cells = [f"{t[k]:.0f}" for t in totals] + ([f"{totals[1][k] - totals[0][k]:+.0f}"] if len(pages) == 2 else [])
        print(f"| {k} | " + " | ".join(cells) + " |")
    base = totals[0] if len(pages) == 2 else collections.Counter()  # one page: the reason with most samples
    reason = args.reason or (max(keys[2:], key=lambda k: totals[-1][k] - base[k]) if keys[2:] else "samples")
    print(f"\nmost {reason} in {args.pages[-1]}:")
    for row in sorted(pages[-1], key=lambda r: -r.get(reason, 0.0))[:args.top]:
        print(f"  {row.get(reason, 0.0):7.0f}  {row['sass']}")


if __name__ == "__main__":
    main()
