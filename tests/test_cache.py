"""QuantMLACache: what update returns, protected tokens, padding, cache operations, budget, and generation."""

import pytest
import torch
from helpers import CACHE_KWARG, KERNEL_DEVICE
from transformers import DynamicCache

from quantmla_hf import CacheFormat, PathFormat, QuantMLACache, QuantMLAConfig, QuantMLALayer, install_cache_hooks
from quantmla_hf.kernels.quant_pack_ref import dequantize_ref, quantize_ref
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_config, tiny_mla_model

D_C, D_R = 64, 16


def _fmt(cb=4, rb=4, sink=2, recent=5):
    return CacheFormat(PathFormat(D_C, cb, 64), PathFormat(D_R, rb, 64), sink, recent)


def _fake_quant(x, path):
    return dequantize_ref(*quantize_ref(x, path), path, x.dtype) if path.quantized else x


def _feed(layer, c, r, chunks):
    """Feed `c: [B, N, d_c]`, `r: [B, N, d_R]` in chunks; return what each update returned."""
    outs, pos = [], 0
    for n in chunks:
        outs.append(layer.update(c[:, None, pos : pos + n], r[:, None, pos : pos + n]))
        pos += n
    return outs


def _expected_history(fmt, c, r, left_padding, total, exact_from):
    """What attention must see for positions [0, total): exact at or after `exact_from`, sink and recent exact,
    fake-quantized elsewhere."""
    exp_c, exp_r = _fake_quant(c[:, :total], fmt.content), _fake_quant(r[:, :total], fmt.rope)
    for b, pad in enumerate(left_padding):
        keep = torch.zeros(total, dtype=torch.bool)
        keep[pad : pad + fmt.sink_tokens] = True
        keep[max(0, total - fmt.recent_tokens) :] = True
        keep[exact_from:] = True
        exp_c[b, keep], exp_r[b, keep] = c[b, :total][keep], r[b, :total][keep]
    return exp_c, exp_r


@pytest.mark.parametrize("cb,rb", [(4, 4), (2, 4), (8, 8), (16, 16), (16, 4)])
def test_update_returns_protected_exact_and_the_rest_dequantized(cb, rb):
    torch.manual_seed(0)
    fmt = _fmt(cb, rb)
    layer = QuantMLALayer(fmt, kernel="torch", block_size=4)
    B, N = 2, 23
    c, r = torch.randn(B, N, D_C), torch.randn(B, N, D_R)
    chunks = [9, 1, 1, 6, 1, 3, 1, 1]
    outs = _feed(layer, c, r, chunks)
    pos = 0
    for n, (hc, hr) in zip(chunks, outs):
        total = pos + n
        exp_c, exp_r = _expected_history(fmt, c, r, [0, 0], total, exact_from=pos)
        assert hc.shape == (B, 1, total, D_C) and hr.shape == (B, 1, total, D_R)
        torch.testing.assert_close(hc[:, 0], exp_c, rtol=0, atol=0)
        torch.testing.assert_close(hr[:, 0], exp_r, rtol=0, atol=0)
        pos = total
    hc, hr = layer.read_history()
    exp_c, exp_r = _expected_history(fmt, c, r, [0, 0], N, exact_from=N)
    assert torch.equal(hc, exp_c) and torch.equal(hr, exp_r)
    assert layer.get_seq_length() == N


def test_sink_tokens_are_the_first_real_tokens_of_each_row():
    torch.manual_seed(1)
    fmt = _fmt(sink=3, recent=4)
    layer = QuantMLALayer(fmt, kernel="torch")
    layer.set_left_padding(torch.tensor([5, 0]))
    B, N = 2, 20
    c, r = torch.randn(B, N, D_C), torch.randn(B, N, D_R)
    _feed(layer, c, r, [12, 1, 1, 1, 5])
    assert torch.equal(layer.sink_content[0], c[0, 5:8]) and torch.equal(layer.sink_content[1], c[1, 0:3])
    hc, hr = layer.read_history()
    exp_c, exp_r = _expected_history(fmt, c, r, [5, 0], N, exact_from=N)
    assert torch.equal(hc, exp_c) and torch.equal(hr, exp_r)


def test_padding_longer_than_the_first_chunk_still_finds_the_sink():
    fmt = _fmt(sink=2, recent=3)
    layer = QuantMLALayer(fmt, kernel="torch")
    layer.set_left_padding(torch.tensor([6]))
    c, r = torch.randn(1, 12, D_C), torch.randn(1, 12, D_R)
    _feed(layer, c, r, [4, 3, 1, 4])
    assert torch.equal(layer.sink_content[0], c[0, 6:8])


def test_triton_and_torch_kernels_build_the_same_cache():
    torch.manual_seed(2)
    c, r = torch.randn(2, 16, D_C), torch.randn(2, 16, D_R)
    layers = [QuantMLALayer(_fmt(2, 4), kernel=k, block_size=8) for k in ("torch", "triton")]
    for layer, device in zip(layers, ("cpu", KERNEL_DEVICE)):
        _feed(layer, c.to(device), r.to(device), [9, 1, 6])
    for name in ("content", "rope"):
        a, b = getattr(layers[0], name).planes, getattr(layers[1], name).planes
        for plane in a:
            assert torch.equal(a[plane][:, :16], b[plane][:, :16].cpu()), (name, plane)


def test_storage_grows_by_whole_blocks():
    layer = QuantMLALayer(_fmt(), kernel="torch", block_size=8)
    c, r = torch.randn(1, 30, D_C), torch.randn(1, 30, D_R)
    pos = 0
    for n in [5, 3, 1, 9, 12]:
        layer.update(c[:, None, pos : pos + n], r[:, None, pos : pos + n])
        pos += n
        assert layer.content.capacity == -(-pos // 8) * 8
        assert layer.rope.capacity == layer.content.capacity


@pytest.mark.parametrize("remove", [-3, -9])
def test_crop_keeps_prefix_and_refills_the_recent_window(remove):
    torch.manual_seed(3)
    fmt = _fmt(sink=2, recent=5)
    layer = QuantMLALayer(fmt, kernel="torch", block_size=4)
    c, r = torch.randn(2, 20, D_C), torch.randn(2, 20, D_R)
    _feed(layer, c, r, [14, 1, 1, 1, 1, 1, 1])
    layer.crop(remove)
    keep = 20 + remove
    assert layer.get_seq_length() == keep
    hc, _ = layer.read_history()
    exp_c, _ = _expected_history(fmt, c, r, [0, 0], keep, exact_from=keep)
    # Recent-window positions older than the pre-crop window come back from their packed copies.
    lost = torch.arange(keep)
    lost = (lost >= keep - 5) & (lost < 20 - 5) & (lost >= 2)
    exp_c[:, lost] = _fake_quant(c[:, :keep], fmt.content)[:, lost]
    assert torch.equal(hc, exp_c)
    assert layer.content.capacity == -(-keep // 4) * 4


def test_crop_positive_follows_the_installed_release():
    from quantmla_hf.cache.growing import LEGACY_POSITIVE_CROP

    layer = QuantMLALayer(_fmt(), kernel="torch")
    _feed(layer, torch.randn(1, 10, D_C), torch.randn(1, 10, D_R), [10])
    if LEGACY_POSITIVE_CROP:  # transformers up to 5.19: the absolute length to keep
        layer.crop(7)
        assert layer.get_seq_length() == 7
    else:
        with pytest.raises(ValueError, match="pass minus the number of tokens to remove"):
            layer.crop(7)
        layer.crop(-3)
    with pytest.raises(ValueError, match="cannot remove 11 tokens from a cache holding 7"):
        layer.crop(-11)


def test_batch_operations_follow_the_rows():
    torch.manual_seed(4)
    fmt = _fmt()
    c, r = torch.randn(3, 12, D_C), torch.randn(3, 12, D_R)
    layer = QuantMLALayer(fmt, kernel="torch")
    layer.set_left_padding(torch.tensor([0, 2, 1]))
    _feed(layer, c, r, [10, 1, 1])
    base_c, base_r = layer.read_history()
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    hc, hr = layer.read_history()
    assert torch.equal(hc, base_c[[2, 0, 0]]) and torch.equal(hr, base_r[[2, 0, 0]])
    assert layer.left_padding.tolist() == [1, 0, 0]
    layer.batch_select_indices(torch.tensor([0, 1]))
    layer.batch_repeat_interleave(2)
    hc, _ = layer.read_history()
    assert torch.equal(hc, base_c[[2, 2, 0, 0]])


def test_reset_empties_the_layer():
    layer = QuantMLALayer(_fmt(), kernel="torch")
    _feed(layer, torch.randn(1, 6, D_C), torch.randn(1, 6, D_R), [6])
    assert layer.nbytes() > 0
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0 and not layer.is_initialized


def test_update_errors_say_what_is_wrong():
    layer = QuantMLALayer(_fmt(), kernel="torch")
    with pytest.raises(ValueError, match=r"latent must be \[B, 1, T, 64\]"):
        layer.update(torch.randn(1, 3, D_C), torch.randn(1, 1, 3, D_R))
    layer.update(torch.randn(2, 1, 3, D_C), torch.randn(2, 1, 3, D_R))
    with pytest.raises(ValueError, match="holds 2 sequences but got a batch of 3"):
        layer.update(torch.randn(3, 1, 1, D_C), torch.randn(3, 1, 1, D_R))
    cache = QuantMLACache(config=tiny_config("deepseek_v3"), quantization_config=QuantMLAConfig())
    with pytest.raises(ValueError, match="layer_idx 5 is past the 2 cache layers"):
        cache.update(torch.randn(1, 1, 1, D_C), torch.randn(1, 1, 1, D_R), 5)


def test_hadamard_rope_rotation_is_transparent_at_16_bits():
    from quantmla_hf.hadamard import hadamard_matrix

    torch.manual_seed(5)
    layer = QuantMLALayer(_fmt(16, 16), kernel="torch", rope_rotation=hadamard_matrix(D_R))
    c, r = torch.randn(2, 9, D_C), torch.randn(2, 9, D_R)
    _feed(layer, c, r, [6, 1, 1, 1])
    _, hr = layer.read_history()
    torch.testing.assert_close(hr, r, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer.rope.planes["values"][:, :9], r)


def _budget_ratio(content_bits, n_tokens, chunk):
    """Dense BF16 latent bytes over the bytes the cache really allocated, DeepSeek widths, one layer."""
    q = QuantMLAConfig(content_bits=content_bits, rope_bits=4, transform="none", advanced={"kernel": "torch"})
    fmt = CacheFormat(PathFormat(512, content_bits, 64), PathFormat(64, 4, 64), q.sink_tokens, q.recent_tokens)
    layer = QuantMLALayer(fmt, kernel="torch", block_size=q.advanced.cache_block_size)
    gen = torch.Generator().manual_seed(0)
    for start in range(0, n_tokens, chunk):
        n = min(chunk, n_tokens - start)
        c = torch.randn(1, 1, n, 512, generator=gen, dtype=torch.bfloat16)
        r = torch.randn(1, 1, n, 64, generator=gen, dtype=torch.bfloat16)
        layer.update(c, r)
    assert layer.get_seq_length() == n_tokens
    return n_tokens * (512 + 64) * 2 / layer.nbytes()


@pytest.mark.parametrize(
    "content_bits,n_tokens,minimum",
    [(4, 4096, 3.25), (4, 131072, 3.60), (2, 131072, 5.8)],
)
def test_persistent_bytes_meet_the_budget(content_bits, n_tokens, minimum):
    ratio = _budget_ratio(content_bits, n_tokens, chunk=65536)
    print(f"C{content_bits}R4 at {n_tokens} tokens: {ratio:.3f}x smaller than the BF16 latent cache")
    assert ratio >= minimum


def _generate(model, ids, mask, cache=None, **kw):
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    kwargs.update(kw)
    if cache is not None:
        kwargs[CACHE_KWARG] = cache
    return model.generate(ids, **kwargs)


def _left_padded_batch(vocab=128):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_generate_on_every_family(model_type):
    model = tiny_mla_model(model_type)
    install_cache_hooks(model)
    ids, mask = _left_padded_batch()
    stock = _generate(model, ids, mask, DynamicCache(config=model.config))
    exact = QuantMLACache(config=model.config, quantization_config=QuantMLAConfig(content_bits=16, rope_bits=16))
    out = _generate(model, ids, mask, exact)
    assert torch.equal(out.sequences, stock.sequences)
    for a, b in zip(out.logits, stock.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert exact.layers[0].left_padding.tolist() == [4, 0]
    for cb in (4, 2):
        q = QuantMLAConfig(content_bits=cb, rope_bits=4, sink_tokens=2, recent_tokens=3, transform="none")
        cache = QuantMLACache(config=model.config, quantization_config=q)
        low = _generate(model, ids, mask, cache)
        assert low.sequences.shape == stock.sequences.shape
        assert cache.get_seq_length() == 16 and len(cache.layers) == exact.dims.num_cache_layers
        assert all(torch.isfinite(step).all() for step in low.logits)
        # The prompt's own step is exact; the first decode step already reads quantized tokens.
        torch.testing.assert_close(low.logits[0], stock.logits[0], rtol=0, atol=0)
        first = (low.logits[1] - stock.logits[1]).norm() / stock.logits[1].norm()
        assert 0 < first < 0.5, f"C{cb}R4 first decode step: relative logit error {first:.3f}"


def test_beam_search_with_the_cache_matches_stock_at_16_bits():
    model = tiny_mla_model("deepseek_v3")
    install_cache_hooks(model)
    ids, mask = _left_padded_batch()
    kw = dict(num_beams=3, output_logits=False, max_new_tokens=5)
    stock = _generate(model, ids, mask, DynamicCache(config=model.config), **kw)
    cache = QuantMLACache(config=model.config, quantization_config=QuantMLAConfig(content_bits=16, rope_bits=16))
    out = _generate(model, ids, mask, cache, **kw)
    assert torch.equal(out.sequences, stock.sequences)
    low = QuantMLACache(config=model.config, quantization_config=QuantMLAConfig(sink_tokens=1, recent_tokens=2))
    assert _generate(model, ids, mask, low, **kw).sequences.shape == stock.sequences.shape


def test_cache_reports_bytes_per_token():
    model = tiny_mla_model("minicpm3")
    install_cache_hooks(model)
    ids, mask = _left_padded_batch()
    cache = QuantMLACache(config=model.config, quantization_config=QuantMLAConfig(advanced={"cache_block_size": 16}))
    _generate(model, ids, mask, cache)
    fmt = cache.format
    per_layer = fmt.persistent_bytes(cache.get_seq_length(), torch.float32, block_size=16)
    assert cache.nbytes() == 2 * len(cache.layers) * per_layer
    assert cache.bytes_per_token(allocated=True) == cache.nbytes() / (2 * cache.get_seq_length())
    assert cache.bytes_per_token() == 2 * len(cache.layers) * fmt.used_bytes(16, torch.float32) / (2 * 16)


def test_update_refuses_non_float_tensors_and_a_changed_dtype():
    layer = QuantMLALayer(_fmt(), kernel="torch")
    for bad in (torch.ones(1, 1, 2, D_C, dtype=torch.int64), torch.ones(1, 1, 2, D_C, dtype=torch.bool),
                torch.ones(1, 1, 2, D_C, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="latent must be a floating-point tensor"):
            layer.update(bad, torch.randn(1, 1, 2, D_R))
    layer.update(torch.randn(1, 1, 2, D_C), torch.randn(1, 1, 2, D_R))
    with pytest.raises(TypeError, match="holds torch.float32 tokens but got torch.bfloat16.*reset"):
        layer.update(torch.randn(1, 1, 1, D_C, dtype=torch.bfloat16), torch.randn(1, 1, 1, D_R, dtype=torch.bfloat16))
    layer.reset()
    layer.update(torch.randn(1, 1, 1, D_C, dtype=torch.bfloat16), torch.randn(1, 1, 1, D_R, dtype=torch.bfloat16))
    cache = QuantMLACache(config=tiny_config("deepseek_v3"), quantization_config=QuantMLAConfig())
    with pytest.raises(ValueError, match="layer_idx must be an integer >= 0, got -1"):
        cache.update(torch.randn(1, 1, 1, D_C), torch.randn(1, 1, 1, D_R), -1)


def test_short_prompts_hold_little_and_bytes_are_reported_used_and_allocated():
    cfg = QuantMLAConfig(sink_tokens=2, recent_tokens=4)  # default block of 256 tokens
    cache = QuantMLACache(config=tiny_config("deepseek_v3"), quantization_config=cfg)
    fmt = cache.format
    for idx in range(len(cache.layers)):
        cache.update(torch.randn(1, 1, 13, D_C), torch.randn(1, 1, 13, D_R), idx)
    assert cache.layers[0].content.capacity == 16  # not a whole block of 256
    assert cache.used_bytes() == len(cache.layers) * (13 * fmt.packed_bytes_per_token(torch.float32)
                                                       + (2 + 4) * fmt.dense_bytes_per_token(torch.float32))
    assert cache.bytes_per_token() == cache.used_bytes() / 13
    assert cache.bytes_per_token(allocated=True) == cache.nbytes() / 13 > cache.bytes_per_token()
    for n, cap in ((20, 32), (40, 64), (200, 256), (300, 512)):
        for idx in range(len(cache.layers)):
            grow = n - cache.layers[idx].length
            cache.update(torch.randn(1, 1, grow, D_C), torch.randn(1, 1, grow, D_R), idx)
        assert cache.layers[0].content.capacity == cap, n
    text = repr(cache)
    assert text.startswith("QuantMLACache(C4R4, 2 layers, 300 tokens x 1 sequences") and len(text) < 160
    assert repr(cache.layers[0]) == "QuantMLALayer(C4R4, 300 tokens x 1)"
