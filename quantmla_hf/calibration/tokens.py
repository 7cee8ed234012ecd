"""Text to token ids, tokenized in bounded pieces (calibration text and `quantmla eval`'s text).

`token_stream(texts, tokenizer)` joins the texts with blank lines and tokenizes the result in pieces of at most
`piece_chars(tokenizer)` characters, each cut where a line starts with a non-blank character, else before a space that
precedes a word. Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2, DeepSeek) split text into words (a leading space
kept with its word) before merging, and never merge across those places, so the pieces give the ids of the whole text
(`tests/test_calibration_plan.py` checks it on the reference model's tokenizer and the default text); no single call
holds more tokens than the model's maximum length, so transformers' "Token indices sequence length is longer than the
specified maximum" warning does not fire, and no call holds the whole text's encoding objects at once.

`text_token_ids(text, tokenizer, needed)` gives what `tokenizer(text)` gives (its special tokens included) the same
way, stopping once `needed` tokens are there: `quantmla eval` on two windows tokenizes a few pieces, not the file.

The last `KEPT` streams are kept (keyed by the tokenizer object and the text): counting the default text's tokens for
`transform="auto"`, checking the calibration inputs and cutting the windows then tokenize it once.
"""

from __future__ import annotations

import hashlib

import torch

MAX_PIECE_CHARS = 16384
KEPT = 2  # streams kept: a text and the prefix that checking counts
_kept: dict = {}


def piece_chars(tokenizer) -> int:
    """Characters per piece: at most `MAX_PIECE_CHARS`, and at most a quarter of the tokenizer's maximum length
    (a byte-level tokenizer gives at most one token per UTF-8 byte, at most 4 bytes per character)."""
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 4 * MAX_PIECE_CHARS:
        return max(64, limit // 4)
    return MAX_PIECE_CHARS


def split_text(text: str, size: int) -> list[str]:
    """`text` in consecutive pieces of at most `size` characters, each cut where a line starts with a non-blank
    character, else before the last space that precedes a word (where byte-level pre-tokenizers split too), else at
    `size`."""
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = _word_start(text, start, end, "\n") or _word_start(text, start, end, " ", before=True) or end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [p for p in pieces if p]


def _word_start(text: str, start: int, end: int, sep: str, before: bool = False) -> int | None:
    """The last place in `text[start + 1 : end]` where `sep` is followed by a non-blank character: just after `sep`
    (a new line), or just before it with `before` (a space stays with the word it precedes); None if there is none."""
    at = text.rfind(sep, start + 1, end - 1)
    while at > start and text[at + 1].isspace():
        at = text.rfind(sep, start + 1, at)
    if at <= start:
        return None
    return at if before else at + 1


def token_list(texts: list[str], tokenizer) -> list:
    """The ids of the texts joined with blank lines, without special tokens, tokenized in pieces (the last `KEPT`
    results kept)."""
    joined = "\n\n".join(texts)
    key = (id(tokenizer), len(joined), hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest())
    if key in _kept and _kept[key][0] is tokenizer:
        return _kept[key][1]
    ids = [t for piece in split_text(joined, piece_chars(tokenizer))
           for t in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    _kept[key] = (tokenizer, ids)  # the tokenizer is held so that its id cannot be reused while the entry lives
    while len(_kept) > KEPT:
        _kept.pop(next(iter(_kept)))
    return ids


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """`[T]` int64 ids of the texts joined with blank lines, without special tokens, tokenized in pieces."""
    return torch.tensor(token_list(texts, tokenizer), dtype=torch.long)


def special_tokens(tokenizer) -> tuple[list, list]:
    """`(prefix, suffix)`: the ids `tokenizer(text)` puts before and after a text's own ids (e.g. `[bos]`, `[]`)."""
    probe = "a"
    full = tokenizer(probe)["input_ids"]
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    for at in range(len(full) - len(bare) + 1):
        if full[at : at + len(bare)] == bare:
            return full[:at], full[at + len(bare) :]
    return [], []


def text_token_ids(text: str, tokenizer, needed: int | None = None) -> torch.Tensor:
    """`[T]` int64 ids of `text` as `tokenizer(text)` gives them, special tokens included, tokenized in bounded
    pieces; with `needed`, pieces stop once at least that many ids are there (the text's end, and a suffix token,
    then left out)."""
    prefix, suffix = special_tokens(tokenizer)
    ids = list(prefix)
    for piece in split_text(text, piece_chars(tokenizer)):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        if needed is not None and len(ids) >= needed:
            return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(ids + list(suffix), dtype=torch.long)
