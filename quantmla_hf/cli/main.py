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
import os
import sys
import warnings
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import _http
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils.logging import tqdm  # honours transformers.utils.logging.disable_progress_bar()

from ..calibration import calibration_token_ids
from ..calibration.checks import (
    CLI_NAMES,
    check_calibration_inputs,
    no_tokenizer_for_default_text,
    read_calibration_text,
)
from ..calibration.defaults import resolve_transform
from ..calibration.threads import cpu_threads, retune
from ..calibration.tokens import text_token_ids
from ..config import DEFAULTS, QUANT_METHOD, QuantMLAConfig, nest_options, weight_conflicts
from ..evaluation.analysis import analyze
from ..evaluation.perplexity import window_nll
from ..integration import build_cache, generated_cache
from ..mla import mla_dims, text_config
from ..saving.hub import upload_saved_files
from ..saving.model_card import write_model_card
from ..saving.staged_output import check_destination, check_file_destination, staged_directory, write_text_atomic
from .demo import main as demo_main

DTYPES = ("auto", "bfloat16", "float16", "float32")
# Seconds a Hub request may wait for the connection or for each piece of the answer (not the whole transfer).
HUB_TIMEOUT = 60.0


class CLIError(Exception):
    """An error the user can fix; printed without a traceback."""


class UsageError(CLIError):
    """A command line that cannot work as given (exit status 2, as argparse's own usage errors)."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="checkpoint directory or Hub id")
    p.add_argument("--hub-timeout", type=float, default=HUB_TIMEOUT, metavar="SECONDS",
                   help=f"give up on a Hub request that gets no answer for this long (default {HUB_TIMEOUT:g})")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weights dtype (default: the checkpoint's)")
    p.add_argument("--device-map", default=None, help='accelerate device map, e.g. "auto" or "cpu"')


# Cache options of the command line: (flag, QuantMLAConfig option as `config.OPTIONS` names it). Their defaults are
# QuantMLAConfig's; the parser leaves them None so that a flag given on the command line can be told apart from a
# default.
CACHE_FLAGS = (("--content-bits", "content_bits"), ("--rope-bits", "rope_bits"), ("--group-size", "group_size"),
               ("--sink-tokens", "sink_tokens"), ("--recent-tokens", "recent_tokens"))
# Options that describe how weights are made: a MODEL already quantized with QuantMLA cannot take them.
WEIGHT_FLAGS = (("--transform", "transform"), ("--calibration", "calibration_data"),
                ("--calibration-samples", "advanced.calibration_samples"),
                ("--calibration-seq-len", "advanced.calibration_seq_len"),
                ("--calibration-steps", "advanced.calibration_steps"),
                ("--calibration-checkpoint-dir", "advanced.calibration_checkpoint_dir"))


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache options (a MODEL already quantized with QuantMLA takes the first five; the others "
                             "must match it)")
    g.add_argument("--content-bits", type=int, default=None, choices=(2, 4, 8, 16),
                   help=f"(default {DEFAULTS['content_bits']})")
    g.add_argument("--rope-bits", type=int, default=None, choices=(4, 8, 16),
                   help=f"(default {DEFAULTS['rope_bits']})")
    g.add_argument("--group-size", type=int, default=None, help=f"(default {DEFAULTS['group_size']})")
    g.add_argument("--sink-tokens", type=int, default=None, help=f"(default {DEFAULTS['sink_tokens']})")
    g.add_argument("--recent-tokens", type=int, default=None, help=f"(default {DEFAULTS['recent_tokens']})")
    g.add_argument("--transform", default=None, choices=("auto", "learned", "hadamard", "smooth", "none"),
                   help="(default auto: learned when the calibration text (--calibration, else the package's default text, "
                        "read with the model's tokenizer) is large enough to beat RTN, else none (RTN), "
                        "said in the output)")
    g.add_argument("--calibration", metavar="FILE", default=None, help="UTF-8 text for learned/smooth transforms")
    g.add_argument("--calibration-samples", type=int, default=None,
                   help=f"(default {DEFAULTS['advanced.calibration_samples']})")
    g.add_argument("--calibration-seq-len", type=int, default=None,
                   help=f"(default {DEFAULTS['advanced.calibration_seq_len']})")
    g.add_argument("--calibration-steps", type=int, default=None,
                   help=f"(default {DEFAULTS['advanced.calibration_steps']})")
    g.add_argument("--calibration-checkpoint-dir", metavar="DIR", default=None,
                   help="keep each finished layer's transforms here; a killed run started again with the same DIR "
                        "resumes after the last finished layer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantmla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("quantize", help="quantize an MLA checkpoint and save it (optionally push it to the Hub)")
    _add_model_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="also upload to this Hub repo")
    _add_cache_args(p)

    p = sub.add_parser("generate", help="generate text with the QuantMLA cache")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, action="append", help="prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    _add_cache_args(p)

    p = sub.add_parser("eval", help="decode perplexity on a text file: DynamicCache (model dtype) vs QuantMLA cache")
    _add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--window", type=int, default=512, help="tokens per window")
    p.add_argument("--prefill", type=int, default=128, help="tokens prefilled (not scored) at each window start")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default window-prefill)")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument("--floor", default=None, action=argparse.BooleanOptionalAction,
                   help="also score a lossless C16R16 cache: what the attention arithmetic alone moves "
                        "(default: on in bfloat16/float16)")
    _add_cache_args(p)

    p = sub.add_parser("analyze", help="dual-path (content vs RoPE) matched-error analysis: table + PNG")
    _add_model_args(p)
    p.add_argument("--calibration", metavar="FILE", required=True, help="UTF-8 text the windows are cut from")
    p.add_argument("--bits", type=int, default=4, help="bits of the error direction (default INT4)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="windows of text")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--out", metavar="DIR", default=None, help="write report.json, report.md and dual_path.png here")

    # Parsed by quantmla_hf.cli.demo itself (`quantmla demo --help` lists its options); here only for the listing.
    sub.add_parser("demo", help="the embedded reference model end to end (`quantmla demo --help`)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible server, continuous batching on the paged packed cache "
                                 "(`quantmla serve --help`)", add_help=False)
    return parser


def _dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


def _given(args, flags) -> dict:
    """The QuantMLAConfig options of `flags` given on the command line (not left to their default), by name."""
    return {field: getattr(args, _dest(flag)) for flag, field in flags if getattr(args, _dest(flag), None) is not None}


def _dest(flag: str) -> str:
    """The attribute argparse stores `flag` under ("--content-bits" -> "content_bits")."""
    return flag[2:].replace("-", "_")


def _quant_config(args):
    """The QuantMLAConfig of the command line's options ("auto" resolved and said, as the API logs it)."""
    if args.calibration is not None:
        args.calibration = str(Path(args.calibration).expanduser())
    options = {**_given(args, CACHE_FLAGS), **_given(args, WEIGHT_FLAGS)}
    if options.get("transform", "auto") == "auto":
        texts = None
        if args.calibration is not None:
            try:  # a missing, binary or non-UTF-8 file is refused here, naming it and the flag
                texts = [read_calibration_text(args.calibration, CLI_NAMES)]
            except (OSError, ValueError) as err:
                raise CLIError(str(err)) from err
        try:  # without --calibration, the package's default text is counted with the model's tokenizer
            tokenizer = _load_tokenizer(args.model)
        except CLIError:
            if texts is not None:
                raise
            tokenizer = None  # nothing can be counted: "auto" is RTN, and says so
        options["transform"], why = resolve_transform("auto", texts, tokenizer)
        print(why)
    return QuantMLAConfig(**nest_options(options))


def _cache_options_for_checkpoint(args, saved):
    """A QuantMLAConfig of the cache flags given for a MODEL already quantized with QuantMLA (`saved`: its
    quantization_config), None if none given; each one applies, also one equal to its default. A weight flag that
    differs from the checkpoint is a usage error naming it (one equal to it changes nothing)."""
    checkpoint = saved if isinstance(saved, QuantMLAConfig) else QuantMLAConfig.from_dict(saved)
    given = _given(args, CACHE_FLAGS)
    conflicts = weight_conflicts(QuantMLAConfig(**nest_options({**given, **_given(args, WEIGHT_FLAGS)})), checkpoint)
    if conflicts:
        flags = {field: flag for flag, field in WEIGHT_FLAGS}
        named = [f"{flags[k]} {value}" + (f" (the checkpoint has {ckpt})" if ckpt is not None else "")
                 for k, (value, ckpt) in conflicts.items()]
        raise UsageError(
            f"{args.model} is already quantized with QuantMLA (its weights were made with "
            f"transform={checkpoint.transform}); {', '.join(named)} cannot change it: drop "
            f"{'it' if len(named) == 1 else 'them'}, or quantize the unquantized model. Cache options (--content-bits, "
            "--rope-bits, --group-size, --sink-tokens, --recent-tokens) do apply")
    return QuantMLAConfig(**nest_options(given)) if given else None


def _load_tokenizer(model: str):
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as err:
        raise CLIError(f"no tokenizer found with {model} ({err})") from err


def load_quantized(args, quantize_if_needed: bool = True, need_tokenizer: bool = True):
    """(model, tokenizer) for `args.model`: as saved when already QuantMLA, else quantized with the cache options.

    Everything that can be checked without the weights (the options, the calibration file and its token count)
    is checked before they load. With `need_tokenizer=False` a checkpoint without a tokenizer gives `None`.
    """
    config = _load_config(args.model)
    saved = getattr(config, "quantization_config", None)
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    kwargs = {"dtype": _dtype(args.dtype)}
    if args.device_map:
        kwargs["device_map"] = args.device_map
    tokenizer = None
    if method == QUANT_METHOD and hasattr(args, "content_bits"):
        cache_options = _cache_options_for_checkpoint(args, saved)
        if cache_options is not None:
            kwargs["quantization_config"] = cache_options
    if method != QUANT_METHOD:
        if saved is not None:
            raise CLIError(f"{args.model} is already quantized with {method!r}; QuantMLA needs an unquantized checkpoint")
        if quantize_if_needed:
            mla_dims(config)  # not an MLA model: say so before loading it
            qconfig = _quant_config(args)
            if qconfig.needs_calibration:
                try:
                    tokenizer = _load_tokenizer(args.model)
                except CLIError as err:
                    if args.calibration is not None:
                        raise
                    raise CLIError(no_tokenizer_for_default_text(qconfig.transform, str(err), CLI_NAMES)) from err
            check_calibration_inputs(qconfig, tokenizer=tokenizer, names=CLI_NAMES)
            kwargs["quantization_config"] = qconfig
    if tokenizer is None and need_tokenizer:
        tokenizer = _load_tokenizer(args.model)
    with warnings.catch_warnings():  # the cache options given were checked above; transformers' merge note is noise
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).eval()
    if tokenizer is None:
        try:
            tokenizer = _load_tokenizer(args.model)
        except CLIError:
            tokenizer = None  # --transform none/hadamard needs none; the checkpoint is saved without one
    return model, tokenizer


def _load_config(model: str):
    """MODEL's config, or a one-line error: a path that does not exist is said to be one (not a bad Hub id)."""
    looks_local = model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", os.sep, 1) \
        or model.count("/") > 1 or (os.altsep is not None and os.altsep in model and os.altsep != "/")
    if looks_local and not os.path.exists(os.path.expanduser(model)):
        raise CLIError(f"{model}: no such directory (give a local checkpoint folder or a Hub id owner/name)")
    try:
        return AutoConfig.from_pretrained(model)
    except HFValidationError as err:
        raise CLIError(f"{model} is neither an existing local folder nor a valid Hub id (owner/name): {err}") from err


def cmd_quantize(args) -> int:
    check_destination(args.out, args.overwrite, "--overwrite")  # before loading or calibrating anything
    model, tokenizer = load_quantized(args, need_tokenizer=False)
    qconfig = model.config.quantization_config
    repo_id = None
    if args.push_to_hub:
        api = HfApi()
        repo_id = api.create_repo(args.push_to_hub, exist_ok=True).repo_id
    with staged_directory(args.out, args.overwrite, "--overwrite") as staged:
        model.save_pretrained(staged.path)
        if tokenizer is not None:
            tokenizer.save_pretrained(staged.path)
        if repo_id is not None:
            write_model_card(model, staged.path, overwrite=True, repo_id=repo_id)
    print(f"saved {qconfig.name} (transform={qconfig.transform}, calibrated={qconfig.calibrated}) to {args.out}"
          + ("" if tokenizer is not None else f" (no tokenizer: {args.model} has none)"))
    if repo_id is not None:
        info = upload_saved_files(api, repo_id, staged.destination, staged.files, "Upload QuantMLA model")
        print(f"pushed to {getattr(info, 'commit_url', None) or repo_id}")
    return 0


def cmd_generate(args) -> int:
    empty = [i for i, p in enumerate(args.prompt) if not p.strip()]
    if empty:
        raise CLIError(f"--prompt number {empty[0] + 1} is empty; give some text to continue, e.g. --prompt \"The\"")
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


def perplexity_side_by_side(model, token_ids, window: int, prefill: int, stride: int, max_windows=None,
                            floor: bool = False, batch: int = 8) -> dict:
    """Decode perplexity of `token_ids: [T]` with a `DynamicCache` (model dtype) and with the model's QuantMLA cache.

    Windows of `window` tokens start every `stride` tokens; each prefills `prefill` tokens and decodes the rest
    one token at a time against the cache, scoring every decoded token (see `quantmla_hf.evaluation.perplexity`); `batch`
    windows decode together. With `floor`, also a lossless C16R16 QuantMLA cache: same attention path, nothing
    quantized, so its difference to the baseline is the attention arithmetic alone (in bf16/fp16 the latent-space path
    rounds differently). On a CPU the thread count is measured first (`quantmla_hf.calibration.threads`).
    """
    if token_ids.numel() < window:
        raise CLIError(f"the text has {token_ids.numel()} tokens, fewer than one window of {window}; "
                       "pass a longer text or a smaller --window")
    starts = list(range(0, token_ids.numel() - window + 1, stride))[:max_windows]
    windows = torch.stack([token_ids[s : s + window] for s in starts])
    caches = {"baseline": lambda: DynamicCache(config=text_config(model.config)), "quantmla": lambda: build_cache(model)}
    if floor:
        lossless = model.config.quantization_config.copy()
        lossless.update(content_bits=16, rope_bits=16)
        caches["floor"] = lambda: build_cache(model, lossless)
    totals = {name: 0.0 for name in caches}
    groups = [windows[i : i + batch] for i in range(0, len(starts), batch)]
    with cpu_threads(model.device), tqdm(total=len(groups) * len(caches), desc="windows x caches", unit="batch") as bar:
        for group in groups:
            for name, make in caches.items():
                retune(model.device)  # a shared machine's load changes between batches
                totals[name] += float(window_nll(model, group, make, prefill).sum())
                bar.update(1)
    tokens = len(starts) * (window - prefill)
    out = {f"{name}_perplexity": math.exp(total / tokens) for name, total in totals.items()}
    out.update(baseline_dtype=str(model.dtype).removeprefix("torch."), tokens_scored=tokens,
               windows=len(starts), window=window, prefill=prefill, stride=stride)
    return out


def check_window_reads_quantized(window: int, sink_tokens: int, recent_tokens: int, flags: bool = True) -> None:
    """Refuse an evaluation in which no decoded token reads a quantized cache entry (it would show +0.00%).

    The last scored token is predicted from `window - 1` cached tokens, of which the first `sink_tokens` and the
    last `recent_tokens` stay unquantized: some entry is read quantized exactly when `window >= sink_tokens +
    recent_tokens + 2`, the bound the message names.
    """
    protected = sink_tokens + recent_tokens
    if window - 1 <= protected:
        raise CLIError(
            f"--window {window}: a decoded token sees at most {window - 1} cached tokens, and the first {sink_tokens} "
            f"(sink) and last {recent_tokens} (recent) stay unquantized, so no quantized entry is ever read and every "
            f"format would score the same as the baseline; pass --window {protected + 2} or more (at "
            f"{protected + 2} only the last decoded token reads one quantized entry: {2 * protected + 2} or more "
            "makes most of them read many)" + (" or fewer --recent-tokens" if flags else "")
        )


def cmd_eval(args) -> int:
    text = Path(args.text)
    if not text.is_file():
        raise CLIError(f"--text {args.text}: no such file")
    if args.prefill < 1 or args.window <= args.prefill + 1:
        raise CLIError(f"need 1 <= --prefill < --window - 1, got prefill={args.prefill}, window={args.window}")
    if args.json:
        check_file_destination(args.json)  # before the evaluation, not after it
    saved = getattr(_load_config(args.model), "quantization_config", None)
    if saved is None:  # quantized here with the cache options: check them before loading
        options = {**DEFAULTS, **_given(args, CACHE_FLAGS)}
        check_window_reads_quantized(args.window, options["sink_tokens"], options["recent_tokens"])
    model, tokenizer = load_quantized(args)
    qconfig = model.config.quantization_config
    check_window_reads_quantized(args.window, qconfig.sink_tokens, qconfig.recent_tokens, flags=saved is None)
    stride = args.stride or args.window - args.prefill
    needed = (args.max_windows - 1) * stride + args.window if args.max_windows else None
    ids = text_token_ids(text.read_text(encoding="utf-8"), tokenizer, needed)
    low_precision = model.dtype in (torch.bfloat16, torch.float16)
    floor = args.floor if args.floor is not None else low_precision
    floor = floor and (qconfig.content_bits, qconfig.rope_bits) != (16, 16)
    res = perplexity_side_by_side(model, ids, args.window, args.prefill, stride, args.max_windows, floor=floor)
    name = qconfig.name
    res["cache"] = name
    base = res["baseline_perplexity"]
    label = f"{res['baseline_dtype']} DynamicCache"
    width = max(len(label), len(name), 24) + 2
    print(f"{'cache':<{width}}{'perplexity':>12}")
    print(f"{label:<{width}}{base:>12.4f}")
    print(f"{name + ' QuantMLA':<{width}}{res['quantmla_perplexity']:>12.4f}  "
          f"({100 * (res['quantmla_perplexity'] / base - 1):+.2f}%)")
    if floor:
        change = 100 * (res["floor_perplexity"] / base - 1)
        res["floor_change_percent"] = change
        print(f"{'C16R16 QuantMLA (floor)':<{width}}{res['floor_perplexity']:>12.4f}  ({change:+.2f}%)")
        print(f"floor: with nothing quantized the latent-space attention in {res['baseline_dtype']} already moves "
              f"perplexity by {change:+.2f}%; a difference of {name} within that is arithmetic, not the cache")
    elif low_precision:
        print(f"(no floor row: --no-floor; in {res['baseline_dtype']} the latent-space attention alone moves perplexity "
              "slightly, pass --floor to measure it)")
    print(f"{res['tokens_scored']} tokens decoded in {res['windows']} windows of {args.window} "
          f"({args.prefill} prefilled, stride {stride})")
    if args.json:
        write_text_atomic(args.json, json.dumps(res, indent=2) + "\n")
    return 0


def cmd_analyze(args) -> int:
    if not Path(args.calibration).is_file():
        raise CLIError(f"--calibration {args.calibration}: no such file")
    if args.out:
        check_destination(args.out)  # before the analysis, not after it
    model, tokenizer = load_quantized(args, quantize_if_needed=False)
    ids = calibration_token_ids(args.calibration, tokenizer, args.samples, args.seq_len, 0,
                                getattr(model.config.get_text_config(decoder=True), "vocab_size", None))
    report = analyze(model, ids, bits=args.bits, group_size=args.group_size)
    print(report.to_markdown())
    if args.out:
        with staged_directory(args.out) as staged:
            (staged.path / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
            (staged.path / "report.md").write_text(report.to_markdown() + "\n", encoding="utf-8")
            plot = Path(report.save_plot(str(staged.path / "dual_path.png")))
        print(f"plot: {staged.destination / plot.name}")
    return 0


def cmd_demo(argv: list[str]) -> int:
    return int(demo_main(argv) or 0)


def set_hub_timeout(seconds: float) -> None:
    """Make every `huggingface_hub` request of this process give up after `seconds` without an answer.

    huggingface_hub's shared HTTP client waits forever by default for API calls (create_repo, upload): a Hub that
    accepts the connection and never answers would hang the command.
    """
    stock = _http.default_client_factory

    def client_with_timeout():
        client = stock()
        client.timeout = seconds
        return client

    huggingface_hub.set_client_factory(client_with_timeout)


def _hub_error(err: BaseException) -> bool:
    """True for a failure to talk to the Hub (connection, timeout, HTTP error), from any HTTP library in use."""
    names = {c.__module__.split(".")[0] for c in type(err).__mro__}
    return bool(names & {"httpx", "httpx2", "requests", "urllib3", "huggingface_hub"})


def _hub_message(err: BaseException) -> str:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    kind = type(err).__name__
    if "Timeout" in kind or "timed out" in detail.lower():
        what = "did not answer in time (--hub-timeout)"
    elif "Connect" in kind:
        what = "could not be reached"
    else:
        what = "refused the request"
    return f"the Hub at {constants.ENDPOINT} {what}: {kind}: {detail} (HF_ENDPOINT sets the endpoint)"


def cmd_serve(argv: list[str]) -> int:
    from ..serving.server import serve_main

    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"quantize": cmd_quantize, "generate": cmd_generate, "eval": cmd_eval, "analyze": cmd_analyze}
    if argv[:1] == ["demo"]:  # the demo parses its own options (`quantmla demo --help`)
        command, run = "demo", lambda: cmd_demo(argv[1:])
    elif argv[:1] == ["serve"]:  # so does the server (`quantmla serve --help`)
        command, run = "serve", lambda: cmd_serve(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command, run = args.command, lambda: commands[args.command](args)
    try:
        if command not in ("demo", "serve") and getattr(args, "hub_timeout", None) is not None:
            if not args.hub_timeout > 0:
                raise CLIError(f"--hub-timeout must be a positive number of seconds, got {args.hub_timeout}")
            set_hub_timeout(args.hub_timeout)
        return run()
    except Exception as err:
        if _hub_error(err):
            message = _hub_message(err)
        elif isinstance(err, (CLIError, ValueError, FileNotFoundError, ImportError, OSError)):
            message = str(err)
        else:
            raise
        print(f"quantmla {command}: error: {message}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
