"""Capture the inputs of every attention layer in ONE forward pass for the dual-path analysis (CPU-time saver).

`quantmla_hf.evaluation.analysis.analyze` calls `capture_inputs(model, module, ids, batch)` once per layer, which runs the model
from the embeddings up to that layer: L(L+1)/2 layer-forwards, 465 for SmolLM2's 30 layers. The analysis changes no
weight, so `one_pass_capture()` runs the model once, keeps every layer's inputs and serves them; it patches the
analysis' call site for the duration of a `with` block. (Calibration itself runs layer by layer, one layer-forward
per layer, and needs no patch.)
"""

from __future__ import annotations

import contextlib

import torch

from quantmla_hf.evaluation import analysis
from quantmla_hf.calibration import capture
from quantmla_hf.attention.state import mla_attention_modules


@contextlib.contextmanager
def one_pass_capture():
    store: dict = {}

    def capture_all(model, module, token_ids, batch_size, dtype=torch.float32):
        key = (id(model), token_ids.data_ptr(), tuple(token_ids.shape), batch_size)
        if key not in store:
            store.clear()  # one model / calibration set at a time (memory)
            hidden, first = {}, {}
            modules = mla_attention_modules(model)

            def hook_for(m):
                def hook(mod, args, kwargs):
                    h = args[0] if args else kwargs["hidden_states"]
                    hidden.setdefault(id(m), []).append(h.detach().to(dtype))
                    if id(m) not in first:  # as capture.capture_inputs keeps them
                        kw = {k: v for k, v in kwargs.items()
                              if k not in ("cache", "past_key_values", "hidden_states", "use_cache")}
                        first[id(m)] = dict(args=tuple(args[1:]), kwargs=kw, in_kwargs=not args, batch=h.shape[0])
                return hook

            handles = [m.register_forward_pre_hook(hook_for(m), with_kwargs=True) for m in modules]
            try:
                with torch.no_grad():
                    for i in range(0, token_ids.shape[0], batch_size):
                        model(input_ids=token_ids[i : i + batch_size], use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            store[key] = {mid: (torch.cat(hidden[mid], 0), first[mid]) for mid in hidden}
        h, f = store[key][id(module)]
        device = capture.module_device(module)
        return capture.CapturedInputs(
            hidden=h.to(device), args=capture._to(f["args"], device, dtype),
            kwargs={k: capture._to(v, device, dtype) for k, v in f["kwargs"].items()}, batch_size=f["batch"],
            cache_kwarg=capture.cache_kwarg_name(module), hidden_in_kwargs=f["in_kwargs"])

    saved = analysis.capture_inputs
    analysis.capture_inputs = capture_all
    try:
        yield
    finally:
        analysis.capture_inputs = saved
