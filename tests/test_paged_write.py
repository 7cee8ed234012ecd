"""The one-launch write of a layer's new tokens into the paged cache (`kernels/paged_write.py`): bit for bit what the
PyTorch path writes (codes, scales, zero points, sink and recent copies), for every packed format, with rows that are
strided, constant, or far from zero, and tokens that enter the sink, the ring, both or neither."""

import pytest
import torch
from helpers import KERNEL_DEVICE, to_device

from quantmla_hf import QuantMLAConfig
from quantmla_hf.cache.paged import PagedQuantMLACache
from quantmla_hf.kernels.paged_write import paged_write
from quantmla_hf.tiny_models import tiny_config


def _cache(cb, rb, kernel, device):
    qc = QuantMLAConfig(content_bits=cb, rope_bits=rb, group_size=16, sink_tokens=3, recent_tokens=5, transform="none",
                        advanced={"kernel": kernel})
    return PagedQuantMLACache(tiny_config("deepseek_v3"), qc, page_size=4, max_requests=3, num_pages=24,
                              dtype=torch.bfloat16, device=device)


def _state(cache):
    planes = [t for layer in cache.content + cache.rope for t in layer.values()]
    copies = cache.sink_content + cache.sink_rope + cache.recent_content + cache.recent_rope
    return [t.cpu() for t in planes + copies]


@pytest.mark.parametrize("cb,rb", [(4, 4), (2, 4), (8, 8), (4, 8)])
def test_one_launch_writes_what_the_pytorch_path_writes(cb, rb):
    torch.manual_seed(cb * 10 + rb)
    caches = {"torch": _cache(cb, rb, "torch", "cpu"), "triton": _cache(cb, rb, "triton", KERNEL_DEVICE)}
    # a prefill across the sink window and the ring, a new short request, then decode steps of both
    schedule = [[("a", 9)], [("a", 1), ("b", 2)], [("a", 1), ("b", 1)], [("b", 1)]]
    for plan in schedule:
        steps = {k: c.begin_step([r for r, _ in plan], [q for _, q in plan]) for k, c in caches.items()}
        n = sum(q for _, q in plan)
        for layer in range(caches["torch"].num_layers):
            wide = torch.randn(n, 64 + 16 + 8) * 3  # latent and k_rot as strided slices of one projection
            wide[0, :16] = 0.75  # a constant group
            wide[-1, 16:32] += 400.0  # a group far from zero (the zero point's range widens)
            latent, k_rot = wide[:, :64].bfloat16(), wide[:, 64:80].bfloat16()
            for kind, cache in caches.items():
                c, r = to_device((latent, k_rot), cache.device)
                cache.write(layer, steps[kind], c, r)
        for cache, step in zip(caches.values(), steps.values()):
            cache.end_step(step)
    for got, want in zip(_state(caches["triton"]), _state(caches["torch"])):
        assert torch.equal(got, want)


def test_bad_arguments_are_refused():
    cache = _cache(4, 4, "triton", "cpu")
    step = cache.begin_step(["a"], [2])
    copies = (cache.sink_content[0], cache.sink_rope[0], cache.recent_content[0], cache.recent_rope[0])
    c, r = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"c must be \[N, 64\]"):
        paged_write(c[:, :32], r, cache.content[0], cache.rope[0], step.slots, copies, step.copy_rows, cache.format)
    with pytest.raises(ValueError, match="copy_rows int64"):
        paged_write(c, r, cache.content[0], cache.rope[0], step.slots, copies, step.copy_rows[:1], cache.format)
    c16 = _cache(16, 4, "triton", "cpu")
    with pytest.raises(ValueError, match="keeps a 16-bit path"):
        paged_write(c, r, c16.content[0], c16.rope[0], step.slots, copies, step.copy_rows, c16.format)
