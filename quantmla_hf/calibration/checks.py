"""Checks of the calibration inputs that run before any weight is loaded.

A learned or smooth transform needs calibration text; a missing or unreadable file, text that is not UTF-8, or
text too short for two windows (one to learn from, one held out) would otherwise fail only after the whole model
has loaded. `check_calibration_inputs` reads the text and counts its tokens with the checkpoint's tokenizer
(cheap next to loading weights) and names the option to change, as the Python keyword or as the CLI flag.
"""

from __future__ import annotations

import os

import torch

from ..config import QuantMLAConfig
from .defaults import calibration_data_or_default
from .tokens import token_list

# How an error names each option: as a `QuantMLAConfig` keyword, or as the `quantmla` command-line flag.
PYTHON_NAMES = {
    "calibration_data": "calibration_data={}",
    "calibration_seq_len": "advanced={{'calibration_seq_len': {}}}",
    "transform": "transform={!r}",
}
CLI_NAMES = {
    "calibration_data": "--calibration {}",
    "calibration_seq_len": "--calibration-seq-len {}",
    "transform": "--transform {}",
}
# The shortest calibration window QuantMLAConfig accepts (advanced calibration_seq_len).
MIN_SEQ_LEN = 8
# Characters tokenized first when counting: enough for two windows in any tokenizer we know of (>= 1 char/token).
_PREFIX_CHARS_PER_TOKEN = 16


def _data_option(path, names: dict) -> str:
    """How a message names the calibration file option: `calibration_data='x.txt'` or `--calibration x.txt`."""
    return names["calibration_data"].format(repr(str(path)) if names is PYTHON_NAMES else str(path))


def read_calibration_text(path: str | os.PathLike, names: dict = PYTHON_NAMES) -> str:
    """The UTF-8 text of `path`, or a `ValueError`/`FileNotFoundError` naming the file and the option."""
    option = _data_option(path, names)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{option}: no such file; give a UTF-8 text file (or, in Python, a list of strings)")
    with open(path, "rb") as f:
        raw = f.read()
    if b"\x00" in raw:
        raise ValueError(f"{option}: the file is binary (it holds NUL bytes); give a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{option}: the file is not UTF-8 text (byte {err.start} cannot be decoded); "
                         "convert it to UTF-8") from err
    if not text.strip():
        raise ValueError(f"{option}: the file is empty; give a UTF-8 text file with the calibration text")
    return text


def count_tokens_up_to(texts: list[str], tokenizer, needed: int) -> int:
    """Tokens of the texts joined as calibration joins them, counted exactly up to `needed` (at least that many
    when the count is `>= needed`): a long text is not tokenized whole just to learn that it is long enough."""
    joined = "\n\n".join(texts)
    prefix = joined[: needed * _PREFIX_CHARS_PER_TOKEN]
    n = len(token_list([prefix], tokenizer))  # in bounded pieces, as calibration tokenizes (no length warning)
    if n >= needed or len(prefix) == len(joined):
        return n
    return len(token_list([joined], tokenizer))


def no_tokenizer_for_default_text(transform: str, why: str, names: dict) -> str:
    """The message for a data-dependent transform with no text given and no tokenizer to read the default text."""
    return (
        f"{names['transform'].format(transform)} with no calibration text learns from the package's default text, "
        f"which needs the model's tokenizer, and none was found ({why}); add the tokenizer to the checkpoint (or pass "
        "one), or use " + " / ".join(names["transform"].format(t) for t in ("hadamard", "none")) + ", which need no text"
    )


def check_calibration_inputs(qconfig: QuantMLAConfig, data=None, tokenizer=None, names: dict = PYTHON_NAMES) -> None:
    """Fail now, with the option to change, when `qconfig`'s calibration could not run.

    Args:
        qconfig: the config; nothing is checked when its transform needs no data or is already calibrated.
        data: the calibration data when given apart from the config (else `qconfig.calibration_data`).
        tokenizer: a tokenizer, or a callable returning one (called only when text must be counted), or None
            to skip the token count.
        names: `PYTHON_NAMES` or `CLI_NAMES`: how the messages name the options.
    """
    if not qconfig.needs_calibration:
        return
    data = data if data is not None else qconfig.calibration_data
    data, default_source = calibration_data_or_default(qconfig.transform, data)
    # `data` is never None here: without text, learned and smooth read the default text.
    if isinstance(data, torch.Tensor):
        return  # token ids: their shape and range are checked by the calibration itself
    source = None
    if isinstance(data, (str, os.PathLike)):
        source = _data_option(data, names)
        texts = [read_calibration_text(data, names)]
    elif isinstance(data, (list, tuple)) and data and all(isinstance(t, str) for t in data):
        texts = list(data)
        if not any(t.strip() for t in texts):
            raise ValueError("calibration_data holds only empty strings; give at least one non-empty text")
    else:
        raise ValueError("calibration_data must be a text-file path, a non-empty list of strings or token ids [N, T]")
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        try:
            tokenizer = tokenizer()
        except ValueError as err:
            if default_source is None:
                raise
            raise ValueError(no_tokenizer_for_default_text(qconfig.transform, str(err), names)) from err
    if tokenizer is None:
        return
    seq_len = qconfig.advanced.calibration_seq_len
    n = count_tokens_up_to(texts, tokenizer, 2 * seq_len)
    if n < 2 * seq_len:
        what = source or f"the {len(texts)} calibration text(s)"
        # Shorter windows help only when two windows of at least the minimum length fit in the text.
        fits = n // 2 >= MIN_SEQ_LEN
        advice = (f"pass a longer text or {names['calibration_seq_len'].format(n // 2)}"
                  + (" or less" if n // 2 > MIN_SEQ_LEN else "") if fits else
                  f"pass a longer text (at least {2 * MIN_SEQ_LEN} tokens: two windows of the shortest length, "
                  f"{MIN_SEQ_LEN})")
        raise ValueError(
            f"{what} gives {n} tokens, fewer than 2 windows of {names['calibration_seq_len'].format(seq_len)} "
            f"(one to learn from, one held out); {advice}"
        )
