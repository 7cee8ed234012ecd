"""The one latent decode (`ops.decode.decode` on a cache layer's `DecodeView`) over every cache kind against the fp64
reference.

The same tokens go into a growing `QuantMLACache`, a `StaticQuantMLACache` and a `PagedQuantMLACache` (prompts
through their prefill paths, then decode steps of one token, the last of which is attended): rows of unequal real
lengths (left padding in the contiguous caches, requests of different lengths in the paged one), lengths around the
sink and recent boundaries, on the PyTorch reference backend and the Triton kernels (the interpreter on a CPU). Each
kind's output and log-sum-exp must match `mla_decode_ref` in fp64 over what that cache holds; on the Triton kernels
the growing and the static cache (planes of other capacities, the same split boundaries) must agree bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import KERNEL_DEVICE, assert_close

from quantmla_hf import QuantMLACache, QuantMLAConfig, StaticQuantMLACache
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref
from quantmla_hf.ops.decode import decode
from quantmla_hf.tiny_models import tiny_config

SINK, RECENT, HEADS, SCALING = 2, 8, 4, 0.125


def _qconfig(content_bits: int, kernel: str) -> QuantMLAConfig:
    return QuantMLAConfig(content_bits=content_bits, rope_bits=16 if content_bits == 16 else 4, group_size=16,
                          sink_tokens=SINK, recent_tokens=RECENT, transform="none", advanced={"kernel": kernel})


def _tokens(lengths: list[int], d_c: int, d_r: int, seed: int):
    """Latents `[B, N, d_c]`, `[B, N, d_R]` of rows with `lengths[b]` real tokens, left-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    c, r = torch.randn(len(lengths), n, d_c, generator=g), torch.randn(len(lengths), n, d_r, generator=g)
    return c.to(KERNEL_DEVICE), r.to(KERNEL_DEVICE), torch.tensor([n - L for L in lengths], device=KERNEL_DEVICE)


def _fill_contiguous(cache, c, r, padding, steps: int):
    """Prefill all but the last `steps` positions in one chunk, then one token at a time (native decode writes)."""
    mask = torch.arange(c.shape[1], device=c.device)[None, :] >= padding[:, None]
    cache.set_left_padding(mask[:, : c.shape[1] - steps])
    n0 = c.shape[1] - steps
    cache.update(c[:, None, :n0], r[:, None, :n0], 0)
    cache.set_native(True)
    for t in range(n0, c.shape[1]):
        cache.update(c[:, None, t:t + 1], r[:, None, t:t + 1], 0)
    return cache.layers[0]


def _fill_paged(paged, c, r, padding, steps: int):
    """Each row as a request of its real tokens: its prompt in one step, then one token a step; returns the step
    of the last tokens (what their attention reads; counted as cached, so the reference sees them too)."""
    ids = [f"r{b}" for b in range(c.shape[0])]
    lengths = [c.shape[1] - int(p) for p in padding]
    rows = [(c[b, int(padding[b]):], r[b, int(padding[b]):]) for b in range(c.shape[0])]
    step = paged.begin_step(ids, [L - steps for L in lengths])
    paged.write(0, step, torch.cat([x[: L - steps] for (x, _), L in zip(rows, lengths)]),
                torch.cat([y[: L - steps] for (_, y), L in zip(rows, lengths)]))
    paged.end_step(step)
    for s in range(steps, 0, -1):
        step = paged.begin_step(ids, [1] * len(ids))
        paged.write(0, step, torch.stack([x[L - s] for (x, _), L in zip(rows, lengths)]),
                    torch.stack([y[L - s] for (_, y), L in zip(rows, lengths)]))
        paged.end_step(step)
    return step


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("content_bits", [4, 2, 16])
@pytest.mark.parametrize("lengths", [[23, 23], [37, 11, 4], [SINK + RECENT + 1, 9, 2]])
def test_every_cache_kind_decodes_its_contents_as_the_reference(kernel, content_bits, lengths):
    config = tiny_config("deepseek_v3")
    d_c, d_r = config.kv_lora_rank, config.qk_rope_head_dim
    qc = _qconfig(content_bits, kernel)
    c, r, padding = _tokens(lengths, d_c, d_r, seed=sum(lengths) + content_bits)
    steps = min(3, min(lengths) - 1)  # every request keeps a prompt of at least one token
    g = torch.Generator().manual_seed(7)
    B, N = c.shape[:2]
    q_lat = torch.randn(B, HEADS, 1, d_c, generator=g).to(KERNEL_DEVICE)
    q_rot = torch.randn(B, HEADS, 1, d_r, generator=g).to(KERNEL_DEVICE)

    outs = {}
    growing = _fill_contiguous(QuantMLACache(config=config, quantization_config=qc), c, r, padding, steps)
    static = _fill_contiguous(StaticQuantMLACache(config=config, quantization_config=qc, max_cache_len=N + 21), c, r,
                              padding, steps)
    for name, layer in (("growing", growing), ("static", static)):
        view = layer.decode_view()
        outs[name] = decode(view, q_lat, q_rot, SCALING)
        ref = mla_decode_ref(q_lat, q_rot, view.content, view.rope, view.fmt, view.sink_content, view.sink_rope,
                             view.recent_content, view.recent_rope, view.left_padding, N, SCALING, dtype=torch.float64)
        assert_close(f"{name} out", ref[0], outs[name][0], 2e-5)
        assert_close(f"{name} lse", ref[1], outs[name][1], 2e-6)
    if kernel == "triton":  # the same kernel, the same splits (sized from the length, not the capacity): the same bits
        assert torch.equal(outs["growing"][0], outs["static"][0]) and torch.equal(outs["growing"][1], outs["static"][1])

    paged = PagedQuantMLACache(config, qc, page_size=4, max_requests=4, num_pages=64, dtype=torch.float32,
                               device=KERNEL_DEVICE)
    step = _fill_paged(paged, c, r, padding, steps)
    o, lse = decode(paged.decode_view(0, step), q_lat.transpose(0, 2), q_rot.transpose(0, 2), SCALING)
    S, R = paged.sink_tokens, paged.recent_tokens  # a 16-bit paged cache keeps no copies
    fmt = dataclasses.replace(paged.format, sink_tokens=S, recent_tokens=R)
    for b, L in enumerate(lengths):  # each request against the reference over its own pages, gathered
        content, rope = paged.request_planes(0, f"r{b}")
        row = int(step.rows[b])
        copies = [t[0][row:row + 1] if n else t[0].new_zeros((1, 0, t[0].shape[-1]))
                  for t, n in ((paged.sink_content, S), (paged.sink_rope, S), (paged.recent_content, R),
                               (paged.recent_rope, R))]
        ref = mla_decode_ref(q_lat[b:b + 1], q_rot[b:b + 1], content, rope, fmt, *copies,
                             torch.zeros(1, dtype=torch.long, device=KERNEL_DEVICE), L, SCALING, dtype=torch.float64)
        assert_close(f"paged out row {b}", ref[0], o[:, :, b:b + 1], 2e-5)
        assert_close(f"paged lse row {b}", ref[1], lse[:, :, b:b + 1], 2e-6)
