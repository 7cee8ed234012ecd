"""Decode steps of a model under a device map: one CUDA graph per device segment (`quantmla_hf.generation.segments`).

On the CPU: how device maps (accelerate's dicts) are cut into segments, that the cut follows the order in which every
family's forward calls its units, the replay order of segments and hand-off copies, accelerate's output copy left out
of a capture, and what `plan_decode` says for offloaded layers. With one GPU: a step captured as two segments on the
same device replays the eager tokens. With two GPUs: contiguous and interleaved maps over both.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from transformers import AutoModelForCausalLM
from transformers.generation import GenerationConfig

import quantmla_hf.generation.graphs as dg
import quantmla_hf.generation.segments as gs
from quantmla_hf import QuantMLAConfig, StaticQuantMLACache, apply_quantmla
from quantmla_hf.cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import TINY_FAMILIES, tiny_mla_model

LAYERS = 4
UNITS = ["model.embed_tokens", "model.rotary_emb", *[f"model.layers.{i}" for i in range(LAYERS)], "model.norm",
         "lm_head"]


def _cut(plan: gs.SegmentPlan) -> list[tuple[str, list[str]]]:
    return [(s.device, list(s.units)) for s in plan.segments]


# ------------------------------------------------------------------------------------------------ the cut
def test_contiguous_maps_give_one_segment_per_device():
    by_module = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                 "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    by_block = {"model.embed_tokens": "cuda:0", "model.rotary_emb": torch.device("cuda", 0), "model.layers": 1,
                "model.norm": "cuda:1", "lm_head": 1}
    expected = [("cuda:0", UNITS[:4]), ("cuda:1", UNITS[4:])]
    assert _cut(gs.plan_segments(by_module, UNITS)) == expected
    assert _cut(gs.plan_segments({**by_block, "model.layers.0": 0, "model.layers.1": 0}, UNITS)) == expected
    assert _cut(gs.plan_segments({"": 0}, UNITS)) == [("cuda:0", UNITS)]
    assert _cut(gs.plan_segments({"": "cuda"}, UNITS)) == [("cuda:0", UNITS)]
    assert gs.plan_segments(by_module, UNITS).reason is None


def test_interleaved_maps_give_one_segment_per_run():
    device_map = {"": 0, "model.layers.1": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 0}
    assert _cut(gs.plan_segments(device_map, UNITS)) == [
        ("cuda:0", UNITS[:3]), ("cuda:1", ["model.layers.1"]), ("cuda:0", ["model.layers.2"]),
        ("cuda:1", ["model.layers.3", "model.norm"]), ("cuda:0", ["lm_head"])]


def test_offloaded_or_unknown_placements_run_eagerly_saying_why():
    plan = gs.plan_segments({"": 0, "model.layers.2": "cpu"}, UNITS)
    assert plan.segments == () and plan.reason.startswith("model.layers.2 is offloaded to cpu")
    assert "in every forward" in plan.reason
    assert gs.plan_segments({"": 1, "model.layers.3": "disk"}, UNITS).reason.startswith(
        "model.layers.3 is offloaded to disk")
    assert gs.plan_segments({"": "cpu", "model.layers.1": "disk"}, UNITS).reason.startswith(
        "model.layers.1 is offloaded to disk")
    assert gs.plan_segments({"": "cpu"}, UNITS) == gs.SegmentPlan()  # a CPU model: nothing to capture, no reason
    split = gs.plan_segments({"": 0, "model.layers.1.mlp": 1}, UNITS)
    assert split.reason == "model.layers.1 is itself split across devices (cuda:0, cuda:1)"
    assert gs.plan_segments({"model.layers.0": 0}, UNITS).reason.startswith(
        "model.embed_tokens has no device in the model's device map")
    assert gs.plan_segments({"": "mps"}, UNITS).reason == "model.embed_tokens is on mps:0, not a CUDA device"


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_units_are_listed_in_the_order_the_forward_calls_them(family):
    """Segments are cut from `decoder_units`' order: it must be the order every family's forward calls them in."""
    model = tiny_mla_model(family)
    units = gs.decoder_units(model)
    called = []
    handles = [m.register_forward_pre_hook(lambda m, a, name=name: called.append(name)) for name, m in units]
    model(torch.randint(0, 128, (1, 5)))
    for h in handles:
        h.remove()
    assert called == [name for name, _ in units]
    assert called[0].endswith("embed_tokens") and called[-1] == "lm_head"


def test_model_plan_reads_the_device_map_and_fills_units_it_leaves_out():
    model = tiny_mla_model("deepseek_v3", num_hidden_layers=LAYERS)
    assert gs.model_segment_plan(model) == gs.SegmentPlan()  # on the CPU, no device map
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                           "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    plan = gs.model_segment_plan(model)  # rotary_emb is not in the map: where its buffer is (the CPU here)
    assert plan.reason.startswith("model.rotary_emb is offloaded to cpu")
    model.hf_device_map["model.rotary_emb"] = 0
    assert _cut(gs.model_segment_plan(model)) == [("cuda:0", UNITS[:4]), ("cuda:1", UNITS[4:])]
    model.hf_device_map = {"": 0}
    assert [s.device for s in gs.model_segment_plan(model).segments] == ["cuda:0"]


def test_plan_decode_replays_device_maps_and_says_why_offloaded_ones_run_eagerly():
    model = apply_quantmla(tiny_mla_model("deepseek_v3", num_hidden_layers=LAYERS),
                           QuantMLAConfig(content_bits=4, rope_bits=4, transform="none", recent_tokens=8))
    qconfig, greedy = model.config.quantization_config, GenerationConfig(max_new_tokens=4)
    model.hf_device_map = {"": 0, "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    assert dg.plan_decode(model, qconfig, greedy, "greedy_search") == dg.DecodePlan(True)
    model.hf_device_map["model.layers.3"] = "disk"
    plan = dg.plan_decode(model, qconfig, greedy, "greedy_search")
    assert not plan.graphs and plan.reason.startswith("model.layers.3 is offloaded to disk")


# ------------------------------------------------------------------------------------------------ replay, hooks
class _Recorded:
    """Stands in for a segment's CUDA graph: `replay` runs `step` (what the graph would do to its buffers)."""

    def __init__(self, step):
        self.step = step

    def replay(self):
        self.step()


def test_replay_copies_each_segments_sources_just_before_its_graph():
    """Segment 1 reads a buffer fed from segment 0's output: the copy must run after graph 0 and before graph 1,
    every replay."""
    out0, buf1, out1 = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    counter = [0.0]

    def graph0():
        counter[0] += 1
        out0.fill_(counter[0])

    graph = gs.SegmentedGraph([(_Recorded(graph0), []), (_Recorded(lambda: out1.copy_(buf1 * 10)), [(buf1, out0)])])
    for n in (1, 2):
        graph.replay()
        assert torch.equal(out1, torch.full((3,), 10.0 * n))


def test_accelerate_output_copy_is_left_out_of_a_capture_only():
    model = tiny_mla_model("deepseek_v3")
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True))
    with gs.outputs_left_in_place(model):
        assert model._hf_hook.io_same_device is False
    assert model._hf_hook.io_same_device is True
    with gs.outputs_left_in_place(tiny_mla_model("deepseek_v3")):  # no accelerate hook: nothing to do
        pass


# ------------------------------------------------------------------------------------------------ on GPUs
@pytest.fixture
def gpu_model(tmp_path):
    """`gpu_model(device_map)`: a tiny float32 deepseek_v3 checkpoint of LAYERS layers loaded with that map, C4R4
    with windows small enough that decode steps read the packed planes."""
    path = tmp_path / "ckpt"
    tiny_mla_model("deepseek_v3", seed=3, num_hidden_layers=LAYERS).save_pretrained(path)
    qconfig = QuantMLAConfig(content_bits=4, rope_bits=4, transform="none", sink_tokens=2, recent_tokens=16,
                             group_size=16)
    return lambda device_map: AutoModelForCausalLM.from_pretrained(path, device_map=device_map,
                                                                   quantization_config=qconfig)


def _eager_and_replayed(model) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Greedy tokens `[2, 24]` of a left-padded batch-2 prompt: eager static steps, then replayed ones (and the
    captured step of the replayed generation)."""
    ids = torch.randint(2, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids, mask = ids.to(model.device), mask.to(model.device)
    gen = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    static = StaticQuantMLACache(config=model.config, max_cache_len=64)
    eager = model.generate(ids, **gen, disable_compile=True, **{GENERATE_CACHE_KWARG: static})
    out = model.generate(ids, **gen, return_dict_in_generate=True)
    (step,) = dg.graphs_of(generated_cache(out)).entries.values()
    return eager, out.sequences, step


def _map(devices: list) -> dict:
    """Layer i on `devices[i]`; embedding and rotary with the first layer, norm and head with the last."""
    return {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[-1],
            "lm_head": devices[-1], **{f"model.layers.{i}": d for i, d in enumerate(devices)}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_two_segments_on_one_gpu_replay_the_eager_tokens(gpu_model, monkeypatch):
    """The segmented capture on one GPU: a device map spelling cuda:0 two ways makes accelerate hook the model (its
    output copy included) and the plan is cut in two at layer 2 on that device. The replay runs two graphs, the
    second reading the first's hidden states, and gives the eager tokens."""
    model = gpu_model(_map([0, 0, "cuda:0", "cuda:0"]))
    assert hasattr(model, "_hf_hook"), "accelerate did not dispatch the model: the test needs its hooks"
    assert [s.device for s in gs.model_segment_plan(model).segments] == ["cuda:0"]
    units = tuple(name for name, _ in gs.decoder_units(model))
    cut = units.index("model.layers.2")
    two = gs.SegmentPlan((gs.Segment("cuda:0", units[:cut]), gs.Segment("cuda:0", units[cut:])))
    monkeypatch.setattr(dg, "model_segment_plan", lambda m: two)
    eager, replayed, step = _eager_and_replayed(model)
    assert torch.equal(replayed, eager)
    assert len(step.graph.parts) == 2 and all(not copies for _, copies in step.graph.parts)  # same device
    assert dg.graph_stats(model).captures == 1 and dg.graph_stats(model).replays == 23


TWO_GPU_MAPS = {
    "contiguous": _map([0, 0, 1, 1]),
    "interleaved": _map([0, 1, 0, 1]),
    "embedding-apart": {**_map([1, 1, 0, 0]), "model.embed_tokens": 0, "model.rotary_emb": 0},
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", sorted(TWO_GPU_MAPS))
def test_device_map_over_two_gpus_replays_the_eager_tokens(gpu_model, name):
    """One graph per contiguous run of units on one GPU, the hidden states (and position embeddings, mask, step
    inputs) copied between them: the eager tokens; a second call reuses the pooled cache and its graphs."""
    model = gpu_model(TWO_GPU_MAPS[name])
    eager, replayed, step = _eager_and_replayed(model)
    assert torch.equal(replayed, eager)
    plan = gs.model_segment_plan(model)
    assert len(step.graph.parts) == len(plan.segments) >= 2
    assert all(copies for _, copies in step.graph.parts[1:])  # every later segment is fed from another device
    captures = dg.graph_stats(model).captures
    assert torch.equal(_eager_and_replayed(model)[1], eager)
    assert dg.graph_stats(model).captures == captures
