"""The content objective learning runs (`ContentLearner.loss_sums`: per-window constants, quantized pairs only, merged
with a precomputed exact part) against its definition (`module_loss_sums`: the module's own forward on the doubled
history), values and gradients, for every family and protection; the merged attention and its hand-written backward;
the learner's own check of the two forms; the RoPE objective's quadratic form over per-window Gram matrices; the fake
quantizer's values against the cache's."""

from __future__ import annotations

import functools

import pytest
import torch
from test_calibration import ids, planted

from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.calibration.capture import AttentionRunner, capture_inputs
from quantmla_hf.calibration.learn import ContentLearner, reference_streams
from quantmla_hf.calibration.objectives import (
    attention_partials,
    fake_quantize,
    gram_quadratic,
    quantize_dequantize,
    quantized_pairs_attention,
    query_grams,
)
from quantmla_hf.calibration.transforms import ContentTransform, rope_kind, start_rotations
from quantmla_hf.format import PathFormat
from quantmla_hf.tiny_models import TINY_FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")


def _learner(family, sink, recent, dtype=torch.float64, windows=3, t=23, bits=2, block=4):
    model = planted(family)
    m = mla_attention_modules(model)[-1]
    inputs = capture_inputs(model, m, ids(windows, seed=5, t=t), 2)  # batches of 2 and 1 windows
    runner = AttentionRunner(m, inputs, dtype=dtype)
    streams = reference_streams(runner, rope_kind(model.config))
    fmt = PathFormat(m.kv_a_layernorm.weight.numel(), bits, 64)
    return ContentLearner(runner, streams, fmt, sink, recent, block)  # several query blocks, the last one shorter


def _moved_transform(learner, seed=0):
    """A transform away from its start (random skew part and scales), in the learner's dtype."""
    w = learner.base["kv_a_layernorm.weight"]
    transform = ContentTransform(start_rotations(w)["identity"], w.abs().clamp_min(1e-8)).to(w.dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        transform.a.copy_(0.05 * torch.randn(transform.a.shape, generator=g))
        transform.log_s.add_(0.2 * torch.randn(transform.log_s.shape, generator=g))
    return transform


def _value_and_grads(fn, transform, rows):
    transform.zero_grad()
    num, den = fn(transform.rotation(), transform.scale(), rows)
    (num / den).backward()
    return float(num.detach()), float(den), transform.a.grad.clone(), transform.log_s.grad.clone()


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
@pytest.mark.parametrize("sink, recent", [(0, 0), (2, 5), (0, 7), (3, 0)])
def test_constants_form_equals_the_module_forward_in_value_and_gradient(family, sink, recent):
    learner = _learner(family, sink, recent)
    transform = _moved_transform(learner)
    rows = torch.tensor([2, 0])
    fast = _value_and_grads(learner.loss_sums, transform, rows)
    slow = _value_and_grads(learner.module_loss_sums, transform, rows)
    assert fast[0] > 1e-3 * fast[1]  # a real quantization error, not a vanishing one
    # fp64 everywhere but inside the fake quantizer, which runs in fp32 in both forms (its value last-bit rounded)
    assert fast[0] == pytest.approx(slow[0], rel=1e-6)
    assert fast[1] == pytest.approx(slow[1], rel=1e-12)
    for a, b in zip(fast[2:], slow[2:]):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_block_size_does_not_change_the_objective():
    values = []
    for block in (1, 5, 16, 1000):
        learner = _learner("deepseek_v3", 2, 5, block=block)
        values.append(_value_and_grads(learner.loss_sums, _moved_transform(learner, seed=1), torch.arange(3)))
    for v in values[1:]:
        assert v[0] == pytest.approx(values[0][0], rel=1e-12)
        assert torch.allclose(v[2], values[0][2], rtol=1e-9, atol=1e-15)


def test_fp32_constants_form_is_as_close_to_fp64_as_the_module_forward():
    exact = _learner("deepseek_v3", 2, 5, torch.float64)
    single = _learner("deepseek_v3", 2, 5, torch.float32)
    transform = _moved_transform(exact)
    truth = float(exact.loss_sums(transform.rotation(), transform.scale(), torch.arange(3))[0].detach())
    r, s = transform.rotation().float().detach(), transform.scale().float().detach()
    fast = float(single.loss_sums(r, s, torch.arange(3))[0])
    slow = float(single.module_loss_sums(r, s, torch.arange(3))[0])
    assert abs(fast - truth) <= max(abs(slow - truth), 1e-6 * truth)


@pytest.mark.parametrize("block", [3, 100])
def test_quantized_pairs_attention_is_one_softmax_over_both_key_sets_in_value_and_gradient(block):
    g = torch.Generator().manual_seed(0)
    b, h, n, m = 2, 3, 10, 6  # n queries over n merged keys (causal), m other keys precomputed
    q, q_rot = torch.randn(b * h, n, 5, generator=g), torch.randn(b, h, n, 4, generator=g)
    k = torch.randn(b * h, n, 5, generator=g, requires_grad=True)
    v = torch.randn(b * h, n, 7, generator=g, requires_grad=True)
    k_rot = torch.randn(b, 1, n, 4, generator=g)
    k_other, v_other = torch.randn(b * h, m, 9, generator=g), torch.randn(b * h, m, 7, generator=g)
    q_other = torch.randn(b * h, n, 9, generator=g)
    other = torch.rand(n, m, generator=g) < 0.5  # an arbitrary pattern of other keys, at least one per row
    other[:, 0] = True
    part_out, part_lse = attention_partials(q_other, k_other, v_other, 0.3, other)
    out = quantized_pairs_attention(q, k, v, q_rot, k_rot, 0.3, part_out, part_lse, block)
    # One softmax over [merged keys | other keys], by autograd
    rope = ((q_rot @ k_rot.transpose(-1, -2)) * 0.3).flatten(0, 1)
    scores = torch.cat([(q @ k.transpose(1, 2) + rope).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                                                    float("-inf")),
                        ((q_other @ k_other.transpose(1, 2)) * 0.3).masked_fill(~other, float("-inf"))], -1)
    reference = torch.softmax(scores, -1) @ torch.cat([v, v_other], 1)
    assert torch.allclose(out, reference, atol=1e-6)
    weight = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weight).sum(), (k, v))
    expected = torch.autograd.grad((reference * weight).sum(), (k, v))
    for a, e in zip(grads, expected):
        assert torch.allclose(a, e, atol=1e-5)
    plain = quantized_pairs_attention(q, k, v, q_rot, k_rot, 0.3, block=block)  # nothing precomputed: causal alone
    assert torch.allclose(plain, torch.softmax(scores[..., :n], -1) @ v, atol=1e-6)


def test_the_learner_refuses_a_module_whose_forward_is_not_the_mla_forward_it_assumes():
    model = planted("deepseek_v3")
    m = mla_attention_modules(model)[-1]
    forward = m.forward

    @functools.wraps(forward)  # keeps the forward's signature, so the runner passes the cache as the module names it
    def scaled_forward(*args, **kwargs):
        return 2 * forward(*args, **kwargs)[0], None  # a scale after o_proj

    m.forward = scaled_forward
    inputs = capture_inputs(model, m, ids(2, seed=5, t=23), 2)
    runner = AttentionRunner(m, inputs)
    with pytest.raises(RuntimeError, match="differs from .*own forward"):
        ContentLearner(runner, reference_streams(runner, rope_kind(model.config)), PathFormat(64, 2, 64), 2, 5)


def test_protection_that_leaves_no_quantized_pair_is_refused():
    with pytest.raises(ValueError, match="leave no quantized pair in windows of 23 tokens"):
        _learner("deepseek_v3", 3, 20, torch.float32)


def test_gram_quadratic_reads_each_windows_grams_and_has_the_plain_gradient():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 9, 6, generator=g)
    grams, _ = query_grams(q, 1, 3)
    e = torch.randn(3, 9, 6, generator=g, requires_grad=True)
    rows = torch.tensor([3, 0, 3])
    value = gram_quadratic(e, grams, rows)
    (grad,) = torch.autograd.grad(value, e)
    e2 = e.detach().clone().requires_grad_()
    plain = ((e2.unsqueeze(-2) @ grams[rows]).squeeze(-2) * e2).sum()
    (plain_grad,) = torch.autograd.grad(plain, e2)
    assert float(value.detach()) == pytest.approx(float(plain.detach()), rel=1e-6)
    assert torch.allclose(grad, plain_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fake_quantize_gives_the_caches_values_bit_for_bit_and_the_surrogates_gradient(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 5, 128, generator=g) * torch.rand(3, 5, 1, generator=g) * 4
    x[0, 0, :64] += 1000.0  # a group far from zero: its range is widened to include 0
    x[0, 1, 64:] = 0.25  # a constant group
    x.requires_grad_()
    fmt = PathFormat(128, bits, 64)
    out = fake_quantize(x, fmt)
    assert torch.equal(out.detach(), quantize_dequantize(x.detach(), fmt))
    (grad,) = torch.autograd.grad((out * torch.randn(out.shape, generator=g)).sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
