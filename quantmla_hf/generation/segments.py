"""A decode step of a model spread over CUDA devices, captured as one CUDA graph per device segment.

A CUDA graph is captured from one stream of one device. A model dispatched with an accelerate device map
(`from_pretrained(..., device_map=...)`) computes each module on its own device: accelerate's hooks move a module's
inputs there before its forward. Its decode step is therefore cut into segments: the decoder's units in the order the
forward calls them (`decoder_units`: embedding, rotary embedding, decoder layers, final norm, head), one segment per
contiguous run of units on one device (`plan_segments`; a map that goes back and forth between devices gives one
segment per run).

`capture_segments` runs the step once under capture. Segment k is captured on its device, from a stream of its own,
into its own graph; a forward pre-hook on each unit switches to the unit's segment (ending the capture of the previous
one) and replaces every tensor argument that lives on another device (the previous segment's hidden states, the
position embeddings, the mask, the step's inputs) by a buffer on the segment's device, allocated in the capture. A
replay (`SegmentedGraph.replay`) then copies each such source into its buffer and replays the segment's graph,
segment after segment: the copies run between the graphs, outside them, on the devices' current streams (a copy
between devices orders itself after the source device's work and before the destination's), without the host waiting.
accelerate's copy of the outputs back to the input device is left out of the capture: the logits stay on the last
segment's device (`generate` moves them itself).

A model on one CUDA device (or one tensor-parallel rank) is the one-segment case: one graph, no hooks, no copies.
Offloaded units (accelerate's CPU or disk offload: weights loaded onto the execution device by every forward) cannot
be replayed: `plan_segments` says why and the decode runs eagerly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """A contiguous run of decoder units (module names, in call order) computed on one device."""

    device: str
    units: tuple[str, ...]


@dataclass(frozen=True)
class SegmentPlan:
    """How a decode step is captured: `segments` in call order, or none with `reason` saying why (no reason: the
    model is on the CPU, nothing to capture)."""

    segments: tuple[Segment, ...] = ()
    reason: str | None = None


def map_device(value) -> str:
    """A device-map value as a device name: 0 -> "cuda:0", "cuda" -> "cuda:0", "cpu" and "disk" unchanged."""
    if isinstance(value, int):
        return f"cuda:{value}"
    if str(value) == "disk":
        return "disk"
    device = torch.device(value)
    return f"{device.type}:{device.index or 0}" if device.type != "cpu" else "cpu"


def devices_of(name: str, device_map: dict) -> set[str]:
    """Devices `device_map` gives module `name` and its submodules: the entry of its longest prefix ("" covers
    everything) and every entry inside it; empty when nothing covers it."""
    covering = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    found = {map_device(device_map[max(covering, key=len)])} if covering else set()
    return found | {map_device(v) for k, v in device_map.items() if k.startswith(name + ".")}


def plan_segments(device_map: dict, units: list[str]) -> SegmentPlan:
    """Cut `units` (module names in call order) into runs on one CUDA device each, from `device_map` (accelerate's:
    module name -> device index, "cuda:i", "cpu" or "disk")."""
    where = {unit: devices_of(unit, device_map) for unit in units}
    missing = [u for u, d in where.items() if not d]
    if missing:
        return SegmentPlan(reason=f"{missing[0]} has no device in the model's device map ({device_map})")
    every = set().union(*where.values())
    if every == {"cpu"}:
        return SegmentPlan()  # a CPU model
    # Disk is always offloaded; the CPU is where a model with no GPU in its map runs, offloaded beside a GPU.
    for off in ("disk", "cpu"):
        unit = next((u for u, devices in where.items() if off in devices), None)
        if unit is not None and (off == "disk" or any(d.startswith("cuda") for d in every)):
            return SegmentPlan(reason=(
                f"{unit} is offloaded to {off} (accelerate loads offloaded weights onto the execution device in "
                "every forward, which a replayed CUDA graph would not do); put every layer on a GPU for replayed steps"
            ))
    for unit, devices in where.items():
        other = sorted(d for d in devices if not d.startswith("cuda"))
        if other:
            return SegmentPlan(reason=f"{unit} is on {other[0]}, not a CUDA device")
        if len(devices) > 1:
            return SegmentPlan(reason=f"{unit} is itself split across devices ({', '.join(sorted(devices))})")
    segments = []
    for unit in units:
        (device,) = where[unit]
        if segments and segments[-1].device == device:
            segments[-1] = Segment(device, segments[-1].units + (unit,))
        else:
            segments.append(Segment(device, (unit,)))
    return SegmentPlan(tuple(segments))


def decoder_units(model) -> list[tuple[str, torch.nn.Module]] | None:
    """(name, module) of the units a decoder-only model's forward calls in order: embedding, rotary embedding (when
    the model has one), decoder layers, final norm, head. None when the model does not have that layout."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed, norm = getattr(base, "embed_tokens", None), getattr(base, "norm", None)
    layers = getattr(base, "layers", None)
    if any(m is None for m in (base, head, embed, norm, layers)):
        return None
    rotary = getattr(base, "rotary_emb", None)
    parts = [embed, *([rotary] if rotary is not None else []), *layers, norm, head]
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    if not all(id(m) in names for m in parts):
        return None
    return [(names[id(m)], m) for m in parts]


def model_segment_plan(model) -> SegmentPlan:
    """`plan_segments` for `model`, from its `hf_device_map` (accelerate) or, without one, `model.device` (one device,
    or one tensor-parallel rank: one segment)."""
    device_map = getattr(model, "hf_device_map", None) or {"": model.device}
    devices = {map_device(d) for d in device_map.values()}
    if len(devices) == 1:
        return plan_segments({"": next(iter(devices))}, ["the model"])
    units = decoder_units(model)
    if units is None:
        return SegmentPlan(reason=(
            f"the model is spread over {sorted(devices)} but its decoder does not have the embed_tokens / layers / "
            "norm / head layout the segments are cut from"
        ))
    device_map = dict(device_map)
    for name, module in units:  # a unit the map leaves out (no weights of its own): where its buffers are
        if not devices_of(name, device_map):
            tensor = next(iter([*module.parameters(), *module.buffers()]), None)
            if tensor is not None:
                device_map[name] = tensor.device
    return plan_segments(device_map, [name for name, _ in units])


# ------------------------------------------------------------------------------------------------ capture, replay
class SegmentedGraph:
    """The CUDA graphs of one captured step, one per segment in call order, each with the copies that feed it:
    `parts: [(graph, [(buffer, source), ...]), ...]`."""

    def __init__(self, parts: list):
        self.parts = parts

    def replay(self) -> None:
        for graph, copies in self.parts:
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=True)
            graph.replay()


class _Capture:
    """The state of one segmented capture: the segment being captured and each segment's graph and hand-offs."""

    def __init__(self, segments: tuple[Segment, ...]):
        self.segments = segments
        self.graphs: list = [None] * len(segments)
        self.copies: list[list] = [[] for _ in segments]
        self.buffers: list[dict] = [{} for _ in segments]
        self.active: int | None = None
        self.context: contextlib.ExitStack | None = None

    def enter(self, k: int) -> None:
        if self.active == k:
            return
        if self.active is not None and k < self.active:
            raise RuntimeError(
                f"the forward went back from segment {self.active} ({self.segments[self.active].device}) to segment "
                f"{k} ({self.segments[k].device}): its modules are not called in the order segments are cut from"
            )
        self.end()
        device = torch.device(self.segments[k].device)
        graph = torch.cuda.CUDAGraph()
        context = contextlib.ExitStack()
        context.enter_context(torch.cuda.device(device))
        context.enter_context(torch.cuda.graph(graph, stream=torch.cuda.Stream(device)))
        self.graphs[k], self.context, self.active = graph, context, k

    def end(self) -> None:
        context, self.context = self.context, None
        if context is not None:
            context.close()

    def hand_off(self, k: int, value):
        """`value` (an argument of a unit of segment k) with every tensor on another device replaced by segment k's
        buffer for it; the copy into the buffer is recorded for the replay (nothing runs during a capture)."""
        if isinstance(value, torch.Tensor):
            device = torch.device(self.segments[k].device)
            if value.device == device:
                return value
            key = (value.device, value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
            buffer = self.buffers[k].get(key)
            if buffer is None:
                buffer = self.buffers[k][key] = torch.empty(value.shape, dtype=value.dtype, device=device)
                self.copies[k].append((buffer, value))
            return buffer
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self.hand_off(k, v) for v in value)
        if isinstance(value, list):
            return [self.hand_off(k, v) for v in value]
        if isinstance(value, dict):
            return {name: self.hand_off(k, v) for name, v in value.items()}
        return value


@contextlib.contextmanager
def outputs_left_in_place(model):
    """Inside, accelerate's hook on `model` leaves the outputs on the device that computed them (`io_same_device`
    off): their copy back to the input device would cross devices inside the last segment's capture."""
    hook = getattr(model, "_hf_hook", None)
    hooks = [h for h in getattr(hook, "hooks", [hook]) if getattr(h, "io_same_device", False)]
    for h in hooks:
        h.io_same_device = False
    try:
        yield
    finally:
        for h in hooks:
            h.io_same_device = True


def capture_segments(model, segments: tuple[Segment, ...], inputs: dict):
    """Capture `model(**inputs)` into one graph per segment of `segments` (see the module docstring). Returns (graph,
    output, bytes): the `SegmentedGraph`, the forward's output (its tensors are the graphs'), and the growth of the
    reserved memory on the segments' devices (the graphs' pools). A `RuntimeError` when it cannot be captured."""
    first = torch.device(segments[0].device)
    elsewhere = [name for name, v in inputs.items() if isinstance(v, torch.Tensor) and v.device != first]
    if elsewhere:
        raise RuntimeError(f"the step's {elsewhere[0]} is on {inputs[elsewhere[0]].device}, not on {first}, where "
                           "the first segment is computed")
    devices = sorted({s.device for s in segments})
    reserved = {d: torch.cuda.memory_reserved(d) for d in devices}
    capture = _Capture(segments)
    handles = []
    if len(segments) > 1:
        units = dict(decoder_units(model))
        for k, segment in enumerate(segments):
            for name in segment.units:
                def pre_hook(module, args, kwargs, k=k):
                    capture.enter(k)
                    return capture.hand_off(k, args), capture.hand_off(k, kwargs)

                handles.append(units[name].register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
    try:
        with outputs_left_in_place(model):
            capture.enter(0)
            output = model(**inputs)
            capture.end()
    except BaseException:
        with contextlib.suppress(RuntimeError):  # a capture the error invalidated cannot end cleanly: keep the error
            capture.end()
        raise
    finally:
        for handle in handles:
            handle.remove()
    parts = [(g, copies) for g, copies in zip(capture.graphs, capture.copies) if g is not None]
    nbytes = sum(torch.cuda.memory_reserved(d) - reserved[d] for d in devices)
    return SegmentedGraph(parts), output, nbytes
