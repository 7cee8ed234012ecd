"""`quantmla`: quantize, generate with, evaluate and analyze MLA models with a QuantMLA KV cache.

    quantmla quantize MODEL --out DIR [--push-to-hub REPO] [--calibration FILE] [cache options]
    quantmla generate MODEL --prompt TEXT [--max-new-tokens N] [cache options when MODEL is not quantized]
    quantmla eval MODEL --text FILE [--window N --prefill N --stride N] [cache options]
    quantmla analyze MODEL --calibration FILE [--out DIR]   (the dual-path error report: table + PNG)
    quantmla demo [...]                              (the embedded reference model, end to end)

MODEL is a local directory or a Hub id (the Hub is `HF_ENDPOINT`). A MODEL whose config.json already carries a
QuantMLA quantization_config loads as it is; any other MLA checkpoint is quantized with the cache options.
Exit status: 0 on success, 1 on an error (message on stderr), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")


class CLIError(Exception):
    """An error the user can fix; printed without a traceback."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="checkpoint directory or Hub id")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--device-map", default=None, help='accelerate device map, e.g. "auto" or "cpu"')


def _add_cache_args(p: argparse.ArgumentParser, transform_default: str) -> None:
    g = p.add_argument_group("cache options (used when MODEL is not already quantized)")
    g.add_argument("--content-bits", type=int, default=4, choices=(2, 4, 8, 16))
    g.add_argument("--rope-bits", type=int, default=4, choices=(4, 8, 16))
    g.add_argument("--group-size", type=int, default=64)
    g.add_argument("--sink-tokens", type=int, default=4)
    g.add_argument("--recent-tokens", type=int, default=128)
    g.add_argument("--transform", default=transform_default, choices=("auto", "learned", "hadamard", "smooth", "none"),
                   help="auto: learned when --calibration is large enough to beat RTN, else none (RTN), said in the output")
    g.add_argument("--calibration", metavar="FILE", default=None, help="UTF-8 text for learned/smooth transforms")
    g.add_argument("--calibration-samples", type=int, default=64)
    g.add_argument("--calibration-seq-len", type=int, default=512)
    g.add_argument("--calibration-steps", type=int, default=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantmla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("quantize", help="quantize an MLA checkpoint and save it (optionally push it to the Hub)")
    _add_model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="also upload to this Hub repo")
    _add_cache_args(p, "auto")

    p = sub.add_parser("generate", help="generate text with the QuantMLA cache")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, action="append", help="prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    _add_cache_args(p, "none")

    p = sub.add_parser("eval", help="decode perplexity on a text file: BF16 cache vs QuantMLA cache")
    _add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--prefill", type=int, default=128, help="tokens prefilled (not scored) at each window start")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default window-prefill)")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    _add_cache_args(p, "none")

    p = sub.add_parser("analyze", help="dual-path (content vs RoPE) matched-error analysis: table + PNG")
    _add_model_args(p)
    p.add_argument("--calibration", metavar="FILE", required=True, help="UTF-8 text the windows are cut from")
    p.add_argument("--bits", type=int, default=4, help="bits of the error direction (default INT4)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="windows of text")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--out", metavar="DIR", default=None, help="write report.json, report.md and dual_path.png here")

    p = sub.add_parser("demo", help="the embedded reference model end to end", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def _quant_config(args):
    from .config import QuantMLAConfig

    transform = args.transform
    if transform == "auto":
        from transformers import AutoTokenizer

        from .calibration.defaults import resolve_transform

        tokenizer = AutoTokenizer.from_pretrained(args.model) if args.calibration else None
        transform, why = resolve_transform("auto", args.calibration, tokenizer)
        print(why)
    return QuantMLAConfig(
        content_bits=args.content_bits, rope_bits=args.rope_bits, group_size=args.group_size,
        sink_tokens=args.sink_tokens, recent_tokens=args.recent_tokens, transform=transform,
        calibration_data=args.calibration, calibration_samples=args.calibration_samples,
        calibration_seq_len=args.calibration_seq_len, calibration_steps=args.calibration_steps,
    )


def load_quantized(args, quantize_if_needed: bool = True):
    """(model, tokenizer) for `args.model`: as saved when already QuantMLA, else quantized with the cache options."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .config import QUANT_METHOD

    config = AutoConfig.from_pretrained(args.model)
    saved = getattr(config, "quantization_config", None)
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    kwargs = {"dtype": _dtype(args.dtype)}
    if args.device_map:
        kwargs["device_map"] = args.device_map
    if method != QUANT_METHOD:
        if saved is not None:
            raise CLIError(f"{args.model} is already quantized with {method!r}; QuantMLA needs an unquantized checkpoint")
        if quantize_if_needed:
            kwargs["quantization_config"] = _quant_config(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as err:
        raise CLIError(f"no tokenizer found with {args.model} ({err})") from err
    return model, tokenizer


def cmd_quantize(args) -> int:
    model, tokenizer = load_quantized(args)
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    qconfig = model.config.quantization_config
    print(f"saved {qconfig.name} (transform={qconfig.transform}, calibrated={qconfig.calibrated}) to {out}")
    if args.push_to_hub:
        info = model.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        print(f"pushed to {getattr(info, 'repo_url', args.push_to_hub)}")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .integration import generated_cache

    model, tokenizer = load_quantized(args)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    inputs = tokenizer(args.prompt, return_tensors="pt", padding=True).to(model.device)
    torch.manual_seed(args.seed)
    out = model.generate(
        **inputs, max_new_tokens=args.max_new_tokens, do_sample=args.sample, return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    cache = generated_cache(out)
    for prompt, seq in zip(args.prompt, out.sequences):
        text = tokenizer.decode(seq[inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"{prompt}{text}")
    print(f"[{type(cache).__name__} {model.config.quantization_config.name}: {cache.get_seq_length()} tokens, "
          f"{cache.nbytes()} bytes]", file=sys.stderr)
    return 0


def perplexity_side_by_side(model, token_ids, window: int, prefill: int, stride: int, max_windows=None) -> dict:
    """Decode perplexity of `token_ids: [T]` with a BF16 `DynamicCache` and with the model's QuantMLA cache.

    Windows of `window` tokens start every `stride` tokens; each prefills `prefill` tokens and decodes the rest
    one token at a time against the cache, scoring every decoded token (see `quantmla_hf.evaluation`).
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from .evaluation import decode_perplexity
    from .integration import build_cache
    from .mla import text_config

    if token_ids.numel() < window:
        raise CLIError(f"the text has {token_ids.numel()} tokens, fewer than one window of {window}; "
                       "pass a longer text or a smaller --window")
    starts = list(range(0, token_ids.numel() - window + 1, stride))[:max_windows]
    caches = {"bf16": lambda: DynamicCache(config=text_config(model.config)), "quantmla": lambda: build_cache(model)}
    totals = {name: [0.0, 0] for name in caches}
    for start in tqdm(starts, desc="windows", unit="window"):
        ids = token_ids[start:start + window]
        for name, make in caches.items():
            r = decode_perplexity(model, ids, make_cache=make, window=window, prefill=prefill)
            totals[name][0] += r.nll * r.tokens
            totals[name][1] += r.tokens
    out = {f"{name}_perplexity": math.exp(s / n) for name, (s, n) in totals.items()}
    out.update(tokens_scored=totals["bf16"][1], windows=len(starts), window=window, prefill=prefill, stride=stride)
    return out


def cmd_eval(args) -> int:
    text = Path(args.text)
    if not text.is_file():
        raise CLIError(f"--text {args.text}: no such file")
    if args.prefill < 1 or args.window <= args.prefill + 1:
        raise CLIError(f"need 1 <= --prefill < --window - 1, got prefill={args.prefill}, window={args.window}")
    model, tokenizer = load_quantized(args)
    ids = tokenizer(text.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    stride = args.stride or args.window - args.prefill
    res = perplexity_side_by_side(model, ids, args.window, args.prefill, stride, args.max_windows)
    name = model.config.quantization_config.name
    res["cache"] = name
    change = 100 * (res["quantmla_perplexity"] / res["bf16_perplexity"] - 1)
    print(f"{'cache':<12}{'perplexity':>12}")
    print(f"{'BF16':<12}{res['bf16_perplexity']:>12.4f}")
    print(f"{name:<12}{res['quantmla_perplexity']:>12.4f}  ({change:+.2f}%)")
    print(f"{res['tokens_scored']} tokens decoded in {res['windows']} windows of {args.window} "
          f"({args.prefill} prefilled, stride {stride})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


def cmd_analyze(args) -> int:
    try:
        from .analysis import analyze
        from .calibration import calibration_token_ids
    except ImportError as err:
        raise CLIError(f"the dual-path analysis (quantmla_hf.analysis) is not available in this installation: {err}")
    if not Path(args.calibration).is_file():
        raise CLIError(f"--calibration {args.calibration}: no such file")
    model, tokenizer = load_quantized(args, quantize_if_needed=False)
    ids = calibration_token_ids(args.calibration, tokenizer, args.samples, args.seq_len, 0,
                                getattr(model.config.get_text_config(decoder=True), "vocab_size", None))
    report = analyze(model, ids, bits=args.bits, group_size=args.group_size)
    print(report.to_markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        (out / "report.md").write_text(report.to_markdown() + "\n", encoding="utf-8")
        print(f"plot: {report.save_plot(str(out / 'dual_path.png'))}")
    return 0


def cmd_demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return int(demo_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return cmd_demo(args.args)
        commands = {"quantize": cmd_quantize, "generate": cmd_generate, "eval": cmd_eval, "analyze": cmd_analyze}
        return commands[args.command](args)
    except (CLIError, ValueError, FileNotFoundError, ImportError, OSError) as err:
        print(f"quantmla {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
