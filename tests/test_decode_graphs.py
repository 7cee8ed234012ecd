"""The CUDA-graph decode path of plain `generate()`: its decisions, sizes, pools and capture-safe checks, on the CPU.

CUDA graphs need a GPU; here `HostReplayStep` stands in for the capture alone: its "graph" re-runs the recorded
forward on the static inputs and writes the recorded output tensors, touching the cache's device counters only (a
replayed graph runs no Python). Everything else is the library's: the plan, the checks made once on the host, the
warm-ups that must leave no trace, the static input copies, the host-side lengths, growth and re-capture.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.generation import CompileConfig, GenerationConfig

import quantmla_hf.generation.graphs as dg
from quantmla_hf import QuantMLACache, QuantMLAConfig, StaticQuantMLACache, apply_quantmla
from quantmla_hf.cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from quantmla_hf.cache.static import cache_length_bucket
from quantmla_hf.generation.plan import first_cache_length
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_mla_model


def _qconfig(**advanced):
    return QuantMLAConfig(content_bits=4, rope_bits=4, transform="none", recent_tokens=8, sink_tokens=2,
                          advanced=advanced)


def _model(layers=2, **kw):
    torch.manual_seed(0)
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=layers).float().eval()
    return apply_quantmla(model, _qconfig(**kw))


class HostReplay:
    """Replays a recorded forward on the host: same static inputs, results written into the recorded output."""

    def __init__(self, model, inputs, output):
        self.model, self.inputs, self.output = model, inputs, output
        self.cache = inputs[GENERATE_CACHE_KWARG]

    def replay(self):
        host = [layer._host_length for layer in self.cache.layers]
        with self.cache.host_checked_steps():
            out = self.model(**self.inputs)
        for layer, n in zip(self.cache.layers, host):  # a graph runs no Python: only device counters move
            layer._host_length = n
        self.output.logits.copy_(out.logits)


class HostReplayStep(dg.DecodeGraphStep):
    device_type = "cpu"

    def _warm_up(self, cache, inputs, n):
        for _ in range(dg.WARMUP_STEPS):
            self.model(**inputs)
            cache.set_host_length(n)

    def _record(self, inputs):
        output = self.model(**inputs)  # executes (a capture would not): the step object must rewind the cache
        return HostReplay(self.model, inputs, output), output, 1000


@pytest.fixture
def host_graphs(monkeypatch):
    """Plain generate() on the CPU takes the graph path: a one-GPU device map, the hardware check of
    transformers' compile path passed, steps replayed by `HostReplayStep`."""
    monkeypatch.setattr(dg, "DecodeGraphStep", HostReplayStep)

    def enable(model):
        model.hf_device_map = {"": 0}
        def hardware_ok(model_kwargs, generation_config):  # transformers' check, less its device-type clause
            return not generation_config.disable_compile

        monkeypatch.setattr(model, "_valid_auto_compile_criteria", hardware_ok, raising=False)
        return model

    return enable


# ------------------------------------------------------------------------------------------------ sizes
def test_cache_length_bucket_rule():
    assert [cache_length_bucket(n) for n in (1, 256, 257, 4096, 4162, 4353, 32834, 100_000)] == [
        256, 256, 512, 4096, 4352, 4608, 34816, 102400]
    for n in range(1, 300_000, 977):
        b = cache_length_bucket(n)
        assert b >= n and (n < 4096 or (b - n) / n <= 1 / 16)
        assert cache_length_bucket(b) == b
    with pytest.raises(ValueError, match="positive number of positions"):
        cache_length_bucket(0)


def test_first_cache_length_does_not_preallocate_a_huge_max_length():
    # 4K prompt, max_new_tokens=100_000: 8192 positions first, not 104K.
    assert first_cache_length(4096 + 100_000, 4096, growable=True) == 8192
    assert first_cache_length(4096 + 66, 4096, growable=True) == 4352  # a short generation: all of it at once
    assert first_cache_length(32768 + 66, 32768, growable=True) == 34816
    assert first_cache_length(100, None, growable=True) == 256
    assert first_cache_length(104_096, None, growable=True) == 4096  # prompt unknown: the prefill grows it
    assert first_cache_length(104_096, 4096, growable=False) == cache_length_bucket(104_096)  # compiled: no growth


def test_static_cache_grows_in_place_and_decodes_as_the_growing_cache():
    """A cache built small with a larger length_limit grows during an eager generation (before the step's mask is
    built: the mask has the new length); the tokens are those of the growing cache; past the limit it says what to
    do."""
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30, do_sample=False,
               pad_token_id=0)
    ref = model.generate(ids, **gen, **{GENERATE_CACHE_KWARG: QuantMLACache(config=model.config)})
    static = StaticQuantMLACache(config=model.config, max_cache_len=16, length_limit=10 + 30)
    out = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: static})
    assert torch.equal(out, ref)
    assert static.max_cache_len == 40 and static.buffers_version == 1  # 16 -> min(limit, bucket(32))
    assert static.host_length() == 39
    with pytest.raises(ValueError, match="length_limit"):
        static.grow_for(41)


# ------------------------------------------------------------------------------------------------ decisions
def test_decode_graphs_option_is_validated_and_saved():
    for choice in ("auto", True, False):
        saved = QuantMLAConfig(advanced={"decode_graphs": choice}).to_dict()
        assert QuantMLAConfig.from_dict(saved).advanced.decode_graphs == choice
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="advanced.decode_graphs must be 'auto', True or False"):
            QuantMLAConfig(advanced={"decode_graphs": bad})


def test_plan_decode_decisions():
    model = _model()
    greedy = GenerationConfig(max_new_tokens=4)
    assert dg.plan_decode(model, _qconfig(), greedy, "greedy_search") == dg.DecodePlan(False)  # CPU: silent
    with pytest.raises(ValueError, match="advanced decode_graphs=True cannot be honoured: the model is on the CPU"):
        dg.plan_decode(model, _qconfig(decode_graphs=True), greedy, "greedy_search")
    model.hf_device_map = {"": 0}  # one GPU
    assert dg.plan_decode(model, _qconfig(), greedy, "greedy_search") == dg.DecodePlan(True)
    assert dg.plan_decode(model, _qconfig(), greedy, "sample").graphs
    assert dg.plan_decode(model, _qconfig(decode_graphs=False), greedy, "sample") == dg.DecodePlan(False)
    compiled = GenerationConfig(compile_config=CompileConfig())
    assert dg.plan_decode(model, _qconfig(), compiled, "sample") == dg.DecodePlan(False)  # inductor chosen
    assert dg.plan_decode(model, _qconfig(), GenerationConfig(disable_compile=True), "sample") == dg.DecodePlan(False)
    beam = dg.plan_decode(model, _qconfig(), greedy, "beam_search")
    assert not beam.graphs and "beam search reorders the cache" in beam.reason
    assisted = dg.plan_decode(model, _qconfig(), greedy, "assisted_generation")
    assert "assisted generation" in assisted.reason
    weights = dg.plan_decode(model, _qconfig(), GenerationConfig(output_attentions=True), "greedy_search")
    assert "attention weights" in weights.reason
    no_static = dg.plan_decode(model, _qconfig(static_cache=False), greedy, "sample")
    assert "advanced static_cache=False" in no_static.reason
    assert "recent_tokens is 0" in dg.plan_decode(
        model, QuantMLAConfig(transform="none", recent_tokens=0), greedy, "sample").reason
    model.hf_device_map = {"": 0, "model.layers.1": 1}  # two GPUs: one graph per device segment
    assert dg.plan_decode(model, _qconfig(), greedy, "sample") == dg.DecodePlan(True)
    model.hf_device_map = {"": 0, "model.layers.1": "cpu"}
    with pytest.raises(ValueError, match="model.layers.1 is offloaded to cpu"):
        dg.plan_decode(model, _qconfig(decode_graphs=True), greedy, "sample")
    model.hf_device_map = {"": 0}
    model.set_attn_implementation("sdpa")
    assert "'sdpa', not 'quantmla'" in dg.plan_decode(model, _qconfig(), greedy, "sample").reason


def test_uncapturable_reasons():
    model = _model()
    cache = StaticQuantMLACache(config=model.config, max_cache_len=64)
    ids = torch.zeros(1, 1, dtype=torch.long)
    kw = GENERATE_CACHE_KWARG
    assert dg.uncapturable((), {"input_ids": ids}, "cpu") == ""  # no cache: an ordinary forward
    assert "not a StaticQuantMLACache" in dg.uncapturable((), {"input_ids": ids, kw: QuantMLACache(config=model.config)})
    assert dg.uncapturable((), {"input_ids": ids, kw: cache}, "cpu") == ""  # empty cache: the prefill
    model(input_ids=torch.zeros(1, 5, dtype=torch.long), **{kw: cache})
    assert dg.uncapturable((), {"input_ids": ids, kw: cache}, "cpu") is None
    assert dg.uncapturable((), {"input_ids": torch.zeros(1, 9, dtype=torch.long), kw: cache}, "cpu") == ""
    assert "not a cuda device" in dg.uncapturable((), {"input_ids": ids, kw: cache})
    assert "hidden states" in dg.uncapturable((), {"input_ids": ids, kw: cache, "output_hidden_states": True}, "cpu")
    assert "4D bool" in dg.uncapturable((), {"input_ids": ids, kw: cache, "attention_mask": torch.ones(1, 6)}, "cpu")
    assert "positional" in dg.uncapturable((ids,), {kw: cache}, "cpu")
    assert "'extra' is a dict" in dg.uncapturable((), {"input_ids": ids, kw: cache, "extra": {}}, "cpu")


def test_graph_pool_is_lru_with_a_count_and_byte_cap():
    pool = dg.GraphPool(max_entries=3, max_bytes=100)
    assert pool.put("a", "A", 10) == [] and pool.put("b", "B", 10) == [] and pool.put("c", "C", 10) == []
    assert pool.get("a") == "A"  # a is now the most recent
    assert pool.put("d", "D", 10) == ["B"]  # count cap: the least recently used goes
    assert list(pool.entries) == ["c", "a", "d"]
    assert pool.put("e", "E", 85) == ["C", "A"]  # byte cap: 10 + 10 + 85 > 100
    assert pool.put("f", "F", 500) == ["D", "E"]  # never the entry just put, even over the cap
    assert len(pool) == 1 and pool.nbytes() == 500


# ------------------------------------------------------------------------------------------------ replayed steps
def test_plain_generate_replays_steps_with_the_eager_tokens(host_graphs, caplog):
    """Greedy and seeded sampling through the graph path give the tokens of the eager static path (left padding,
    a streamer, return_dict_in_generate); one capture per shape, none on the next call."""
    model = host_graphs(_model())
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    gen = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)

    def eager(**kw):
        cache = StaticQuantMLACache(config=model.config, max_cache_len=64)
        return model.generate(ids, **gen, **kw, disable_compile=True, **{GENERATE_CACHE_KWARG: cache})

    ref = eager(do_sample=False)
    stats = dg.graph_stats(model)
    from transformers import TextStreamer

    class Tokens(TextStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value)

        def end(self):
            pass

    streamer = Tokens()
    out = model.generate(ids, **gen, do_sample=False, return_dict_in_generate=True, streamer=streamer)
    assert torch.equal(out.sequences, ref)
    assert isinstance(generated_cache(out), StaticQuantMLACache)
    assert stats.captures == 1 and stats.replays == 7 and stats.eager_steps == 0
    assert len(streamer.seen) == 9
    assert torch.equal(model.generate(ids, **gen, do_sample=False), ref)
    assert stats.captures == 1 and stats.replays == 14  # same shape: the graph is replayed, not captured again
    torch.manual_seed(11)
    sampled = model.generate(ids, **gen, do_sample=True, top_k=20)
    torch.manual_seed(11)
    assert torch.equal(sampled, eager(do_sample=True, top_k=20))
    with caplog.at_level(logging.WARNING):
        beams = model.generate(ids, **gen, num_beams=2, do_sample=False)
    assert beams.shape == ref.shape and "beam search reorders the cache every step" in caplog.text


def test_replayed_steps_reuse_the_captured_mask(host_graphs, monkeypatch):
    """generate's per-step 4D mask is built for the prefill and the first decode step of each call only: later
    steps of a replayed cache get the captured step's mask tensor; the tokens (left padding) are the eager ones."""
    import quantmla_hf.hooks as hooks

    calls = {"all": 0, "stock": 0}

    def counting(model, stock, **kwargs):
        def stock_counted(**kw):
            calls["stock"] += 1
            return stock(**kw)

        calls["all"] += 1
        return dg.masks_for_generate(model, stock_counted, **kwargs)

    monkeypatch.setattr(hooks, "masks_for_generate", counting)
    model = host_graphs(_model())
    ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    gen = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    cache = StaticQuantMLACache(config=model.config, max_cache_len=64)
    ref = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: cache})
    calls.update(all=0, stock=0)
    for _ in range(2):  # the second call reuses the model's cache and graph: its first decode step checks again
        assert torch.equal(model.generate(ids, **gen), ref)
    assert calls == {"all": 16, "stock": 4}
    assert dg.graph_stats(model).replays == 14
    # no padding (later transformers releases drop an all-ones mask: the step gets None)
    gen["attention_mask"] = torch.ones_like(ids)
    cache = StaticQuantMLACache(config=model.config, max_cache_len=64)
    ref = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: cache})
    calls.update(all=0, stock=0)
    assert torch.equal(model.generate(ids, **gen), ref)
    assert calls == {"all": 8, "stock": 2}
    # the hook is a method of the model it was installed on: a deep copy asks its own step objects
    import copy

    twin = copy.deepcopy(model)
    assert twin.create_masks_for_generate.__self__ is twin and model.create_masks_for_generate.__self__ is model


def test_replayed_steps_grow_and_recapture(host_graphs):
    """A cache that must grow during a replayed generation grows before the step's mask is built, captures the
    step again for its new buffers, and gives the eager static path's tokens."""
    model = host_graphs(_model())
    ids = torch.randint(1, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(7))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40, do_sample=False,
               pad_token_id=0)
    eager = StaticQuantMLACache(config=model.config, max_cache_len=16, length_limit=49)
    ref = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: eager})
    cache = StaticQuantMLACache(config=model.config, max_cache_len=16, length_limit=49)
    out = model.generate(ids, **gen, **{GENERATE_CACHE_KWARG: cache})
    assert torch.equal(out, ref)
    assert cache.max_cache_len == 49 and cache.buffers_version == 1
    stats = dg.graph_stats(model)
    assert stats.captures == 2 and stats.replays == 39  # one graph per buffer set, every decode step replayed


def test_a_mask_the_kernels_cannot_apply_runs_eagerly(host_graphs, caplog):
    """A 2D mask with a hole (not left padding): checked once on the host, the generation decodes eagerly (and
    says so), with the eager tokens."""
    model = host_graphs(_model())
    ids = torch.randint(1, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    gen = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    cache = StaticQuantMLACache(config=model.config, max_cache_len=64)
    ref = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: cache})
    with caplog.at_level(logging.WARNING):
        out = model.generate(ids, **gen)
    assert torch.equal(out, ref)
    assert "not left padding + causal" in caplog.text
    assert dg.graph_stats(model).captures == 0 and dg.graph_stats(model).eager_steps >= 5


def test_host_checked_steps_skip_only_the_synchronising_checks():
    """Inside host_checked_steps a step neither reads the mask nor checks the room left (its caller did); outside,
    an eager step still refuses to write past a cache that cannot grow."""
    model = _model(layers=1)
    cache = StaticQuantMLACache(config=model.config, max_cache_len=8)
    kw = {GENERATE_CACHE_KWARG: cache}
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match="length_limit|is full|max_cache_len"):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), **kw)
    assert all(not layer.host_checked for layer in cache.layers)
    with cache.host_checked_steps():
        assert all(layer.host_checked for layer in cache.layers)
    assert all(not layer.host_checked for layer in cache.layers)
