"""Speculative decoding (assisted generation, prompt lookup) on the QuantMLA cache: the tokens of greedy decoding.

transformers verifies drafts by feeding them to the model in one forward: the accepted sequence's uncached tail and
`k` drafts. Greedy decoding would have fed each draft alone, reading the older positions from their packed copies;
`quantmla_hf.attention.chunk` attends every draft query that way once the cache knows where the drafts start
(`QuantMLACache.mark_drafts`). After cached tokens a short chunk is all drafts, but the first verification feeds the
prompt and its drafts into an empty cache, which is indistinguishable from a prefill. `generate` knows where they
start: `mark_verifications` has the candidate generator of an assisted `generate` call mark the cache before every
verification forward (the model's `_get_candidate_generator` override in `quantmla_hf.hooks` wraps the generator).

`check_draft_verification` refuses, with the fix, the cases where the drafts cannot see what greedy decoding sees
(attention weights asked for, an attention implementation other than "quantmla", `recent_tokens=0`, a static
cache) whenever the sequence can reach a position whose older tokens are read from packed low-bit copies.
"""

from __future__ import annotations

import functools

from ..attention.state import ATTN_IMPLEMENTATION
from ..cache.growing import QuantMLACache


def check_draft_verification(model, cache: QuantMLACache, generation_config) -> None:
    """Refuse assisted or prompt-lookup `generate` where its tokens could differ from greedy decoding's.

    Every query reads its older positions from model-dtype copies while the sequence is at most `sink_tokens +
    recent_tokens` long (and always with 16-bit paths), so nothing is refused then.
    """
    fmt = cache.format
    span = fmt.sink_tokens + fmt.recent_tokens
    if not (fmt.content.quantized or fmt.rope.quantized) or generation_config.max_length <= span:
        return
    reason = None
    if generation_config.output_attentions:
        reason = ("attention weights (output_attentions=True) are computed over one history shared by all the drafts "
                  "of a chunk; generate without output_attentions")
    elif model.config._attn_implementation != ATTN_IMPLEMENTATION:
        reason = (f"the {model.config._attn_implementation!r} attention gives all the drafts of a chunk one history; "
                  f"use model.set_attn_implementation({ATTN_IMPLEMENTATION!r}), which attends each as greedy decoding")
    elif fmt.recent_tokens == 0:
        reason = ("with recent_tokens=0 greedy decoding attends each token through SDPA over the whole history, "
                  "which a chunk of drafts cannot reproduce; use recent_tokens >= 1")
    elif any(layer.is_compileable for layer in cache.layers):
        reason = ("a StaticQuantMLACache writes draft chunks without keeping their rows; pass no cache (generate then "
                  "builds the growing QuantMLACache) or a QuantMLACache")
    if reason is not None:
        raise ValueError(
            f"assisted generation and prompt lookup would not reproduce greedy decoding on this {fmt.name} cache "
            f"(max_length {generation_config.max_length} > sink_tokens + recent_tokens = {span}): {reason}; or "
            "generate without assistant_model / prompt_lookup_num_tokens"
        )


def mark_verifications(generator, cache: QuantMLACache):
    """Make `generator` (a transformers `CandidateGenerator`) mark `cache` after each draft: the next forward of the
    main model verifies the drafts that follow the `input_ids.shape[1]` accepted tokens. Returns `generator`."""
    stock = generator.get_candidates

    @functools.wraps(stock)
    def get_candidates(input_ids, *args, **kwargs):
        candidates = stock(input_ids, *args, **kwargs)
        cache.mark_drafts(input_ids.shape[1])
        return candidates

    generator.get_candidates = get_candidates
    return generator
