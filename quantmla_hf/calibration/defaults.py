"""The default transform: learned when the calibration data is large enough to beat RTN, else RTN.

Learned transforms fit `O(d_c^2)` rotation parameters per layer to the calibration windows; with too little text
they fit those windows and do worse than plain rounding on other text (docs/ACCURACY.md: the demo's embedded
959-token text gave learned transforms worse than RTN on held-out text). `transform="auto"` therefore resolves to
"learned" only from `MIN_LEARNED_TOKENS` calibration tokens up, and to "none" (RTN, which needs no data and cannot
overfit) below that, saying why. 4096 tokens is the smallest calibration measured not to lose to RTN on held-out text:
with 16 x 256 tokens learned C4R4 had lower KL than RTN in 55-62 of 64 windows (issue #13); with 8 x 512 tokens
learned C4R4 had 0.78x RTN's KL [0.73, 0.82] and learned C2R4 tied RTN, over three seeds (docs/ACCURACY.md); with the
demo's 959 tokens learned lost to RTN at both widths (issue #13). Hadamard is not the fallback: at 2 content bits it
had twice RTN's KL on the reference model (docs/ACCURACY.md).
"""

from __future__ import annotations

import os

MIN_LEARNED_TOKENS = 4096


def calibration_token_count(data, tokenizer) -> int:
    """Tokens of `data` (a text-file path, a list of strings or token ids `[N, T]`) as `quantize` would cut them."""
    if data is None:
        return 0
    if hasattr(data, "numel"):
        return int(data.numel())
    if isinstance(data, (str, os.PathLike)):
        with open(data, encoding="utf-8") as f:
            data = [f.read()]
    if tokenizer is None:
        raise ValueError("counting calibration text needs a tokenizer")
    return len(tokenizer("\n\n".join(data), add_special_tokens=False)["input_ids"])


def resolve_transform(transform: str, data, tokenizer, min_tokens: int = MIN_LEARNED_TOKENS) -> tuple[str, str]:
    """`(transform, why)`: `transform` unchanged unless it is "auto", which becomes "learned" with at least
    `min_tokens` calibration tokens and "none" (RTN) otherwise; `why` is a sentence for the user."""
    if transform != "auto":
        return transform, f"transform={transform!r} (as asked)"
    n = calibration_token_count(data, tokenizer)
    if n >= min_tokens:
        return "learned", f"transform='learned': {n} calibration tokens (>= {min_tokens}, enough to learn from)"
    what = "no calibration text" if n == 0 else f"only {n} calibration tokens"
    return "none", (f"transform='none' (RTN): {what}, fewer than the {min_tokens} below which learned transforms lost "
                    "to RTN on held-out text (docs/CALIBRATION.md); pass more text, or ask for transform='learned' to "
                    "learn anyway")
