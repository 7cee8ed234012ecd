"""Static QuantMLA cache: device-side lengths, custom ops, compiled decode without graph breaks.

CPU only, cheap: `torch.compile(backend="eager", fullgraph=True)` traces exactly what inductor would receive
(dynamo + the ops' fake implementations) without C++ compilation; one-layer tiny models keep tracing short.
"""

import pytest
import torch
import torch._dynamo
from helpers import CACHE_KWARG, KERNEL_DEVICE, assert_close, to_device
from test_mla_decode import LSE_ABS, OUT_RATIO, random_case
from transformers.generation import CompileConfig

from quantmla_hf import (
    PathFormat,
    QuantMLACache,
    QuantMLAConfig,
    StaticQuantMLACache,
    apply_quantmla,
    install_cache_hooks,
)
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref, mla_decode_static_ref
from quantmla_hf.kernels.quant_pack import quantize_pack
from quantmla_hf.kernels.quant_pack_ref import quantize_pack_at_ref, quantize_ref
from quantmla_hf.ops import decode as ops
from quantmla_hf.ops import write  # noqa: F401
from quantmla_hf.ops.backends import mla_decode_static
from quantmla_hf.tiny_models import tiny_mla_model


def _qconfig(kernel="torch", **advanced):
    return QuantMLAConfig(content_bits=4, rope_bits=4, sink_tokens=2, recent_tokens=4, transform="none",
                          advanced={"kernel": kernel, **advanced})


def _prompt(batch=2, length=9, seed=1):
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of row 1
    return ids, mask


def _compile_config():
    cc = CompileConfig(backend="eager", fullgraph=True, mode=None)
    cc._compile_all_devices = True  # generate compiles on CPU too
    return cc


def _gen_kwargs(mask, new_tokens):
    return dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                return_dict_in_generate=True)


# ---------------------------------------------------------------------------------------- compiled decode
def test_compiled_generate_matches_eager_without_recompiles():
    """generate builds the static cache itself (advanced static_cache=True) and compiles the decode step with
    fullgraph=True: DeepSeek-V2 (complex-number RoPE), a 250-token prompt decoding across position 256 and across
    the recent window (4 tokens), logits of the eager QuantMLACache, one graph for every step and for a second
    call of the same shape, the host-side length right after each call."""
    ids = torch.randint(3, 128, (2, 250), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    eager = apply_quantmla(tiny_mla_model("deepseek_v2", num_hidden_layers=1), _qconfig(static_cache=False))
    ref = eager.generate(ids, **_gen_kwargs(mask, 9))
    model = apply_quantmla(tiny_mla_model("deepseek_v2", num_hidden_layers=1), _qconfig(static_cache=True))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for call in range(2):
        out = model.generate(ids, **_gen_kwargs(mask, 9), compile_config=_compile_config())
        assert isinstance(model._quantmla_static_cache, StaticQuantMLACache)
        assert model._quantmla_static_cache.max_cache_len == 512
        # The compiled steps ran no Python: the host-side length is read back from the device, not stuck.
        assert model._quantmla_static_cache.host_length() == 250 + 8
        assert torch.equal(out.sequences, ref.sequences), f"call {call}: tokens differ from eager"
        for a, b in zip(out.logits, ref.logits):
            assert_close("logits", b, a, 1e-5)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "a decode step recompiled"


def _compile_decode_attention(model):
    """Compile (fullgraph) every MLA attention module's forward for one-token steps; prefill stays eager."""
    from quantmla_hf.attention.state import mla_attention_modules

    modules = mla_attention_modules(model)
    for attn in modules:
        stock = attn.forward
        compiled = torch.compile(stock, backend="eager", fullgraph=True)
        attn.forward = lambda hidden_states, *a, _c=compiled, _s=stock, **k: (
            _c if hidden_states.shape[1] == 1 else _s)(hidden_states, *a, **k)
    return modules


# One layer each (MoE tracing adds time, not cache code). LongCat-Flash's stock MoE loops over the experts it hits
# (data-dependent: a graph break in transformers' code, not in the cache), so its whole model does not trace in one
# graph; every family's attention + static cache + custom ops do (DeepSeek-V2: the whole model, above).
@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3"])
def test_every_family_decodes_compiled_in_one_graph(model_type):
    """The attention of every family, compiled with fullgraph=True over the static cache (torch reference
    path): eager logits, one graph per attention module for all 6 steps (across the 4-token recent window)."""
    ids, mask = _prompt()
    layers = {"num_layers": 1} if model_type == "longcat_flash" else {"num_hidden_layers": 1}
    model = tiny_mla_model(model_type, **layers)
    install_cache_hooks(model)
    model.set_attn_implementation("quantmla")
    kw = _gen_kwargs(mask, 6)
    ref = model.generate(ids, **kw, **{CACHE_KWARG: QuantMLACache(config=model.config, quantization_config=_qconfig())})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    modules = _compile_decode_attention(model)
    cache = StaticQuantMLACache(config=model.config, quantization_config=_qconfig(), max_cache_len=20)
    out = model.generate(ids, **kw, **{CACHE_KWARG: cache})
    for attn in modules:
        del attn.forward
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert_close("logits", b, a, 1e-5)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(modules), "a decode step recompiled"


def test_growing_and_static_caches_decode_bit_for_bit(monkeypatch):
    """bf16, Triton kernels (the fast kernel, in the interpreter here): the growing QuantMLACache (planes of 16-32
    positions, grown geometrically) and the static cache (80 positions: a larger grid of splits) call the same
    decode (`ops.decode.decode`, which runs `decode_contiguous` for both) with the same split boundaries (sized from the length) and the
    same combine order: every decode step's attention output (fp32, before the bf16 rounding that would hide last
    bits), every step's logits and the greedy tokens are identical, with tokens leaving the recent window (4) for
    the packed planes at every step. (Several non-empty splits: tests/test_mla_decode.py.)"""
    calls = []
    decode = ops.decode_contiguous

    def recording(*args):
        out = decode(*args)
        calls[-1].append(out[0].clone())
        return out

    monkeypatch.setattr(ops, "decode_contiguous", recording)
    ids, mask = to_device(_prompt(length=12, seed=7))
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=1, dtype=torch.bfloat16).to(KERNEL_DEVICE)
    install_cache_hooks(model)
    model.set_attn_implementation("quantmla")
    q = _qconfig(kernel="triton")
    kw = dict(_gen_kwargs(mask, 5), disable_compile=True)  # eager steps on a GPU too: the recording needs them
    grow = QuantMLACache(config=model.config, quantization_config=q)
    calls.append([])
    ref = model.generate(ids, **kw, **{CACHE_KWARG: grow})
    static = StaticQuantMLACache(config=model.config, quantization_config=q, max_cache_len=80)
    calls.append([])
    out = model.generate(ids, **kw, **{CACHE_KWARG: static})
    assert grow.layers[0].content.capacity < 80 and grow.layers[0].length == 16
    assert all(layer.last_update_native for layer in grow.layers)
    assert len(calls[0]) == len(calls[1]) == 4, [len(c) for c in calls]  # 4 decode steps each, same dispatch
    for step, (a, b) in enumerate(zip(*calls)):
        assert torch.equal(a, b), f"step {step}: attention differs by {(a - b).abs().max():.3g}"
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a.float() - b.float()).abs().max():.3g}"


def test_growing_and_static_caches_agree_bit_for_bit_fp32_fallback():
    """fp32 model: the Gluon kernels do not take fp32 copies, so both caches decode through the portable Triton
    kernel's fp32 path (`select_backend` in `quantmla_hf/ops/backends.py`), the growing one with a capacity just above
    its length, the static one with 8192 positions and a larger grid. Its splits are sized from the device-side
    length and its combine is grid-independent, so every step's logits (fp32 all the way: nothing rounds the last
    bits away) and the greedy tokens are identical. A 140-token prompt gives several non-empty splits, and the
    8192-position static cache a grid whose capacity-sized splits would be 128 positions against the growing
    cache's 80: splits sized that way made the logits differ at the second decode step by 6e-8."""
    ids, mask = to_device(_prompt(length=140, seed=9))
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=1, dtype=torch.float32).to(KERNEL_DEVICE)
    install_cache_hooks(model)
    model.set_attn_implementation("quantmla")
    q = _qconfig(kernel="triton")
    # eager steps on a GPU too: a captured or compiled step rounds the rest of the model differently
    kw = dict(_gen_kwargs(mask, 3), disable_compile=True)
    grow = QuantMLACache(config=model.config, quantization_config=q)
    ref = model.generate(ids, **kw, **{CACHE_KWARG: grow})
    static = StaticQuantMLACache(config=model.config, quantization_config=q, max_cache_len=8192)
    out = model.generate(ids, **kw, **{CACHE_KWARG: static})
    assert all(layer.last_update_native for layer in grow.layers)
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max():.3g}"


# ---------------------------------------------------------------------------------------- eager semantics
def test_beam_search_crop_and_reset_keep_the_buffers():
    """Beam search (in-place reorder) gives the dynamic cache's sequences; crop and reset keep every address."""
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=1)
    install_cache_hooks(model)
    model.set_attn_implementation("quantmla")
    ids, mask = _prompt()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=2)
    ref = model.generate(ids, **kw, **{CACHE_KWARG: QuantMLACache(config=model.config, quantization_config=_qconfig())})
    cache = StaticQuantMLACache(config=model.config, quantization_config=_qconfig(), max_cache_len=24)
    out = model.generate(ids, **kw, **{CACHE_KWARG: cache})
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    ptrs = [t.data_ptr() for t in layer._buffers()]
    n = layer.length
    c_before, r_before = layer.read_history()
    cache.crop(-3)
    assert int(cache.get_seq_length()) == n - 3 and layer.length == n - 3
    c_after, r_after = layer.read_history()
    assert torch.equal(c_after, c_before[:, : n - 3]) and torch.equal(r_after, r_before[:, : n - 3])
    cache.reset()
    assert layer.length == 0 and not cache.holds_tokens()
    assert ptrs == [t.data_ptr() for t in layer._buffers()]


def test_which_cache_generate_builds():
    """"auto": the static cache only for a call asking for compilation, on CUDA; True/False force the choice."""
    from types import SimpleNamespace

    from quantmla_hf.generation.plan import static_cache_wanted

    model = apply_quantmla(tiny_mla_model("deepseek_v3", num_hidden_layers=1), _qconfig())
    asks = SimpleNamespace(compile_config=CompileConfig())
    plain = SimpleNamespace(compile_config=None)
    assert not static_cache_wanted(model, _qconfig(), asks)  # CPU
    assert static_cache_wanted(model, _qconfig(static_cache=True), plain)
    assert not static_cache_wanted(model, _qconfig(static_cache=False), asks)
    with pytest.raises(ValueError, match="static_cache must be"):
        static_cache_wanted(model, _qconfig(static_cache="yes"), plain)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='quantmla'"):
        static_cache_wanted(model, _qconfig(static_cache=True), plain)


def test_static_cache_errors_say_what_to_do():
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=1)
    with pytest.raises(ValueError, match="max_cache_len"):
        StaticQuantMLACache(config=model.config, quantization_config=_qconfig())
    with pytest.raises(ValueError, match="recent_tokens >= 1"):
        StaticQuantMLACache(config=model.config, quantization_config=QuantMLAConfig(recent_tokens=0, transform="none"),
                            max_cache_len=8)
    cache = StaticQuantMLACache(config=model.config, quantization_config=_qconfig(), max_cache_len=8)
    with pytest.raises(ValueError, match="larger max_cache_len"):
        cache.update(torch.randn(1, 1, 9, 64), torch.randn(1, 1, 9, 16), 0)


# ---------------------------------------------------------------------------------------- kernels and ops
def _static_args(B, N, cap, H, Tq, cb, rb, S, R, dtype, lps, seed):
    """A random packed cache of `cap` positions holding `N`, with the length as a device tensor."""
    args = list(random_case(B, cap, H, Tq, 64, 16, cb, rb, S, R, dtype, lps, seed))
    args[10] = N
    return args


@pytest.mark.parametrize("N, lps", [(5, [0, 2]), (9, [3, 0]), (38, [0, 11]), (61, [7, 1])])
def test_static_reference_equals_the_host_length_reference(N, lps):
    args = _static_args(2, N, 64, 2, 1, 4, 4, 2, 4, torch.float32, lps, seed=N)
    ref_o, ref_lse = mla_decode_ref(*args)
    cap = args[2]["codes"].shape[1]
    static = args[:10] + [torch.tensor([N]), cap, args[11]]
    o, lse = mla_decode_static_ref(*static)
    assert torch.allclose(o, ref_o, atol=1e-5) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], ref_lse[torch.isfinite(ref_lse)], atol=1e-5)


@pytest.mark.parametrize("N, tq, cb, rb", [(7, 1, 4, 4), (40, 2, 2, 4), (53, 1, 16, 16)])
def test_static_triton_kernel_matches_the_reference(N, tq, cb, rb):
    """Triton (interpreter on CPU) with the length on the device: splits over the whole capacity, those past the
    length empty; odd lengths, unequal left padding, the sink/recent edges."""
    dtype = torch.bfloat16
    args = _static_args(2, N, 70, 3, tq, cb, rb, 2, 4, dtype, [0, 5], seed=N + cb)
    cap = (args[2].get("codes", args[2].get("values"))).shape[1]
    static = args[:10] + [torch.tensor([N]), cap, args[11]]
    o, lse = mla_decode_static(*static)
    ref_o, ref_lse = mla_decode_ref(*args, dtype=torch.float64)
    assert_close("o_lat", ref_o, o, OUT_RATIO)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < LSE_ABS


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_at_device_position_matches_the_reference(bits):
    fmt = PathFormat(64, bits, 32)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 2, 64, generator=g) * 3
    planes = [torch.zeros(3, 11, fmt.code_bytes, dtype=torch.uint8), torch.zeros(3, 11, 2, dtype=torch.float16),
              torch.zeros(3, 11, 2, dtype=torch.int8)]
    ref = [p.clone() for p in planes]
    _pack_on_kernel_device(x, planes, torch.tensor([9]), fmt)
    quantize_pack_at_ref(x, *ref, torch.tensor([9]), fmt)
    for a, b in zip(planes, ref):
        assert torch.equal(a, b)
    codes, scale, zero = quantize_ref(x, fmt)
    assert torch.equal(planes[0][:, 9:], codes) and torch.equal(planes[1][:, 9:], scale)
    assert torch.equal(planes[2][:, 9:], zero) and not planes[0][:, :9].any()
    # a write past the capacity is dropped, not wrapped
    _pack_on_kernel_device(x, planes, torch.tensor([10]), fmt)
    assert torch.equal(planes[0][:, 10], codes[:, 0])


def _pack_on_kernel_device(x, planes, start, fmt):
    """`quantize_pack` at the device-side `start` on `KERNEL_DEVICE`, the CPU `planes` updated in place."""
    on_device = to_device(planes)
    quantize_pack(to_device(x), *on_device, to_device(start), fmt)
    for plane, written in zip(planes, on_device):
        plane.copy_(written.cpu())


def test_ops_fake_implementations_and_opcheck():
    """opcheck: schema, fake (meta) shapes, dispatch under FakeTensor and functionalization, for the three ops."""
    args = _static_args(2, 21, 24, 2, 1, 4, 16, 2, 4, torch.float32, [0, 3], seed=5)
    c, r = args[2], args[3]
    e = torch.empty(0, dtype=torch.uint8)
    decode_args = (args[0], args[1], c["codes"], c["scale"], c["zero"], r["values"], e, e, *args[5:10],
                   torch.tensor([21]), c["codes"].shape[1], args[11], 4, 64, 16, 16, 2, 4, False)
    torch.library.opcheck(torch.ops.quantmla.mla_decode.default, decode_args)
    o, lse = torch.ops.quantmla.mla_decode(*decode_args)
    ref_o, ref_lse = mla_decode_ref(*args)
    assert o.shape == (2, 2, 1, 64) and lse.shape == (2, 2, 1)
    assert torch.allclose(o, ref_o, atol=1e-5)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in decode_args]
        fo, fl = torch.ops.quantmla.mla_decode(*fake)
        assert fo.shape == (2, 2, 1, 64) and fo.dtype == torch.float32 and fl.shape == (2, 2, 1)
    x = torch.randn(2, 1, 64)
    torch.library.opcheck(torch.ops.quantmla.quant_append.default,
                          (x, c["codes"].clone(), c["scale"].clone(), c["zero"].clone(), torch.tensor([3]), 4, 64, False))


def test_decode_op_without_triton_runs_the_reference():
    """`use_triton=False` (a layer whose kernel is "torch") takes the PyTorch reference through the same op."""
    args = _static_args(1, 12, 16, 2, 1, 4, 4, 2, 4, torch.float32, [0], seed=2)
    c, r = args[2], args[3]
    decode_args = (args[0], args[1], c["codes"], c["scale"], c["zero"], r["codes"], r["scale"], r["zero"],
                   *args[5:10], torch.tensor([12]), 16, args[11], 4, 64, 4, 64, 2, 4, False)
    o, _ = torch.ops.quantmla.mla_decode(*decode_args)
    assert torch.allclose(o, mla_decode_ref(*args)[0], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (mode='reduce-overhead') need a CUDA device")
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_cuda_graph_decode_matches_eager(model_type):
    """GPU: generate's own compile path (inductor, reduce-overhead, fullgraph) on the default static cache, bf16,
    Triton kernels: the eager QuantMLACache's logits within bf16 rounding (inductor fuses the norms), one graph
    across steps and two calls."""
    ids, mask = _prompt()
    ids, mask = ids.cuda(), mask.cuda()
    q = dict(content_bits=4, rope_bits=4, sink_tokens=2, recent_tokens=4, transform="none")
    eager = apply_quantmla(tiny_mla_model(model_type, num_hidden_layers=1, dtype=torch.bfloat16).cuda(),
                           QuantMLAConfig(**q, advanced={"static_cache": False}))
    ref = eager.generate(ids, **_gen_kwargs(mask, 8))
    model = apply_quantmla(tiny_mla_model(model_type, num_hidden_layers=1, dtype=torch.bfloat16).cuda(),
                           QuantMLAConfig(**q))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        out = model.generate(ids, **_gen_kwargs(mask, 8), compile_config=CompileConfig(fullgraph=True))
        assert isinstance(model._quantmla_static_cache, StaticQuantMLACache)
        same = (out.sequences == ref.sequences).all(0)
        steps = int(same[ids.shape[1]:].float().cumprod(0).sum())  # steps before the first differing token
        assert steps >= 1
        for a, b in list(zip(out.logits, ref.logits))[:steps]:
            assert_close("logits", b.float(), a.float(), 3e-2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
