"""Calibrating models whose attention weights accelerate keeps offloaded (on CPU or disk, `meta` in the module).

While one attention module is calibrated its offloaded submodules are materialised on their execution device
(accelerate's `align_module_device`); the fused values are then written back into the offload map that the
hooks load from, so the next forward runs the fused weights.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Callable

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from accelerate.utils.offload import OffloadedWeightsLoader, PrefixedDataset


def _offloaded_submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if has_offloaded_params(m)]


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module`'s computation runs: its weights' device, or its accelerate hook's execution device."""
    device = module.weight.device
    hook = getattr(module, "_hf_hook", None)
    if device.type == "meta" and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    return device


def _offload_store(module: torch.nn.Module, name: str) -> tuple[dict, str]:
    """The dict the hook of `module` loads parameter `name` from, and its key there."""
    store, key = module._hf_hook.weights_map, name
    while isinstance(store, PrefixedDataset):
        store, key = store.dataset, store.prefix + key
    # An OffloadedWeightsLoader serves its in-memory state_dict before the files on disk.
    return (store.state_dict if isinstance(store, OffloadedWeightsLoader) else store), key


@contextmanager
def materialized(module: torch.nn.Module, write_back: Callable[[torch.nn.Module], bool] | None = None):
    """Within the block every offloaded parameter of `module` is real, loaded once (forwards inside the block do
    not reload it); on a normal exit the values of the submodules `write_back` accepts (all by default: the fused
    ones) are written back to the offload maps before the hooks release them again.

    Calibration holds one decoder layer materialised while it captures the layer's attention inputs and runs the
    layer on the windows, writing back only its attention modules: the layer's weights cross to the GPU once.
    """
    subs = _offloaded_submodules(module)
    if not subs:
        yield
        return
    with ExitStack() as stack:
        for sub in subs:
            stack.enter_context(align_module_device(sub))
            # Forwards inside the block (the calibration replays) must not reload the weights from the map.
            sub._hf_hook.offload = False
            stack.callback(setattr, sub._hf_hook, "offload", True)
        yield
        for sub in subs:
            if write_back is not None and not write_back(sub):
                continue
            for name, param in sub.named_parameters(recurse=False):
                store, key = _offload_store(sub, name)
                store[key] = param.detach().to("cpu")
