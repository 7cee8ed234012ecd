"""The default transform: learned when the calibration data is large enough to beat RTN, else RTN.

Learned transforms fit `O(d_c^2)` rotation parameters per layer to the calibration windows; with too little text
they fit those windows and do worse than plain rounding on other text (docs/ACCURACY.md: the demo's embedded
959-token text gave learned transforms worse than RTN on held-out text). `transform="auto"` therefore resolves to
"learned" only from `MIN_LEARNED_TOKENS` calibration tokens up, and to "none" (RTN, which needs no data and cannot
overfit) below that, saying why. 4096 tokens is the smallest calibration measured not to lose to RTN on held-out text:
with 16 x 256 tokens learned C4R4 had lower KL than RTN in 55-62 of 64 windows; with 8 x 512 tokens
learned C4R4 had 0.78x RTN's KL [0.73, 0.82] and learned C2R4 tied RTN, over three seeds (docs/ACCURACY.md); with the
demo's 959 tokens learned lost to RTN at both widths. Hadamard is not the fallback: at 2 content bits it
had twice RTN's KL on the reference model (docs/ACCURACY.md).

Without user text the transforms that need data calibrate on the package's default text
(`assets/calibration_default/general_text.txt.xz`: The Devil's Dictionary and one entry in three of the Jargon File
4.4.7, both public domain; provenance in that folder's README.md), 195 K tokens with SmolLM2's tokenizer,
so "auto" resolves to "learned" for any model whose tokenizer is at hand. It is read with `lzma` and tokenized with
the model's own tokenizer when calibration runs.
"""

from __future__ import annotations

import lzma
import os
from functools import lru_cache
from pathlib import Path

from .tokens import token_list

MIN_LEARNED_TOKENS = 4096
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "assets" / "calibration_default" / "general_text.txt.xz"
DEFAULT_SOURCE = "the default calibration text (The Devil's Dictionary and the Jargon File 4.4.7, public domain)"
DATA_TRANSFORMS = ("auto", "learned", "smooth")


@lru_cache(maxsize=1)
def default_calibration_text() -> str:
    """The package's default calibration text (about 784 K characters of public-domain English), decompressed."""
    with lzma.open(DEFAULT_TEXT, "rt", encoding="utf-8") as f:
        return f.read()


def calibration_data_or_default(transform: str, data):
    """`(data, source)`: `data` as given (source None), or, when it is None and `transform` learns from data,
    the default text as a one-string list with `DEFAULT_SOURCE`."""
    if data is None and transform in DATA_TRANSFORMS:
        return [default_calibration_text()], DEFAULT_SOURCE
    return data, None


def calibration_token_count(data, tokenizer) -> int:
    """Tokens of `data` (a text-file path, a list of strings or token ids `[N, T]`) as `calibrate` would cut them."""
    if data is None:
        return 0
    if hasattr(data, "numel"):
        return int(data.numel())
    if isinstance(data, (str, os.PathLike)):
        with open(data, encoding="utf-8") as f:
            data = [f.read()]
    if tokenizer is None:
        raise ValueError("counting calibration text needs a tokenizer; pass the model's tokenizer")
    return len(token_list(list(data), tokenizer))


def resolve_transform(transform: str, data, tokenizer) -> tuple[str, str]:
    """`(transform, why)`: `transform` unchanged unless it is "auto", which becomes "learned" with at least
    `MIN_LEARNED_TOKENS` calibration tokens and "none" (RTN) otherwise; `why` is a sentence for the user.

    `data=None` with a `tokenizer` counts the default text (`calibration_data_or_default`), which is what
    `calibrate` then learns from; without a tokenizer no text can be counted and "auto" is RTN.
    """
    if transform != "auto":
        return transform, f"transform={transform!r} (as asked)"
    source = None
    if tokenizer is not None:
        data, source = calibration_data_or_default(transform, data)
    n = calibration_token_count(data, tokenizer)
    if n >= MIN_LEARNED_TOKENS:
        return "learned", (f"transform='learned': {n} calibration tokens (>= {MIN_LEARNED_TOKENS}, enough to learn from)"
                           + (f" from {source}" if source else ""))
    what = "no calibration text" if n == 0 else f"only {n} calibration tokens"
    return "none", (f"transform='none' (RTN): {what}, fewer than the {MIN_LEARNED_TOKENS} below which learned transforms lost "
                    "to RTN on held-out text (docs/CALIBRATION.md); pass more text, or ask for transform='learned' to "
                    "learn anyway")
