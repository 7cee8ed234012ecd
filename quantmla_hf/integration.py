"""Model surgery behind `QuantMLAHfQuantizer`: check the model is MLA, learn/fuse the transform, connect the cache.

Everything here works on a loaded `PreTrainedModel` (weights materialized), so it serves both
`from_pretrained(..., quantization_config=QuantMLAConfig(...))` and `apply_quantmla(model, config)` on a model
built in memory. After `prepare_model`:

- the MLA attention modules share the `QuantMLACache` of the forward in flight (`attention.state.install_cache_hooks`);
- the attention implementation is "quantmla" (latent-space decode straight from the packed cache);
- the model's class is its QuantMLA class (`hooks`): `generate()` (and therefore `pipeline("text-generation")`)
  builds a QuantMLA cache when the caller passes no cache and asks for no `cache_implementation`, continuous
  batching runs on the paged cache, and `save_pretrained`/`push_to_hub` write the QuantMLA model card.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoTokenizer
from transformers.utils import logging

from .attention.state import ATTN_IMPLEMENTATION, _pre_forward, install_cache_hooks, mla_attention_modules
from .cache.growing import QuantMLACache
from .calibration import calibrate
from .calibration.checks import check_calibration_inputs, read_calibration_text
from .calibration.defaults import calibration_data_or_default, resolve_transform
from .config import QuantMLAConfig
from .generation.plan import model_qconfig
from .hooks import attach, detach
from .log import get_logger
from .mla import MLADims, mla_dims
from .saving.model_card import hub_id_of

logger = get_logger(__name__)


def generated_cache(output):
    """The cache of a `generate(..., return_dict_in_generate=True)` output (`cache` from 5.24, else `past_key_values`)."""
    return output.get("cache", None) if output.get("cache", None) is not None else output.get("past_key_values", None)


def check_mla_model(model: torch.nn.Module) -> MLADims:
    """The MLA widths of `model`, or a `ValueError` naming what makes it unsupported."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no `config`; QuantMLA applies to transformers PreTrainedModels")
    dims = mla_dims(config)
    modules = mla_attention_modules(model)
    if len(modules) != dims.num_cache_layers:
        raise ValueError(
            f"the {dims.model_type!r} config announces {dims.num_cache_layers} MLA cache layers but the model has "
            f"{len(modules)} MLA attention modules (with kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj)"
        )
    return dims


def build_cache(model: torch.nn.Module, quantization_config: QuantMLAConfig | None = None) -> QuantMLACache:
    """A fresh `QuantMLACache` for `model`, from `quantization_config` or the model's own quantization config."""
    qconfig = quantization_config or model_qconfig(model)
    return QuantMLACache(config=model.config.get_text_config(decoder=True), quantization_config=qconfig)


def resolve_tokenizer(model, qconfig: QuantMLAConfig, tokenizer):
    """The tokenizer for calibration: the one given, `qconfig.extra['tokenizer']`, or the checkpoint's own."""
    tokenizer = tokenizer if tokenizer is not None else qconfig.extra.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    source = tokenizer or getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None)
    if not source:
        raise ValueError(
            "calibration text needs a tokenizer, and this model was not loaded from a checkpoint that has one; "
            "pass QuantMLAConfig(..., tokenizer='name-or-path') or apply_quantmla(model, config, tokenizer=tokenizer)"
        )
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a tokenizer from {source!r} for calibration ({err}); pass "
            "QuantMLAConfig(..., tokenizer='name-or-path') with a tokenizer that matches the model"
        ) from err


def resolve_auto_transform(qconfig: QuantMLAConfig, data=None, tokenizer=None) -> None:
    """Replace `transform="auto"` in `qconfig` by what it picks for `data` (logged with the reason, as the CLI says).

    "learned" with enough calibration tokens (the package's default text when `data` is None), else "none"
    (`quantmla_hf.calibration.defaults.resolve_transform`). A checkpoint's config never comes here with "auto"
    (the resolved name is saved, and a loaded "auto" is refused). `tokenizer` may be a callable returning one; a
    model without a tokenizer cannot count text, and "auto" is then RTN.
    """
    if qconfig.transform != "auto":
        return
    if isinstance(data, (str, os.PathLike)):
        data = [read_calibration_text(data)]  # a missing, binary or non-UTF-8 file: named, with the option
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        try:
            tokenizer = tokenizer()
        except ValueError:
            if data is not None:
                raise  # text was given: counting it needs the tokenizer the message names
            tokenizer = None
    transform, why = resolve_transform("auto", data, tokenizer)
    logger.warning(why)
    qconfig.transform = transform


def calibrate_if_needed(model, qconfig: QuantMLAConfig, calibration_data=None, tokenizer=None,
                        calibration_options: dict | None = None) -> None:
    """Learn and fuse the transform that `qconfig` asks for, once (sets `qconfig.calibrated`).

    "none" needs nothing; "hadamard" is data-free; "learned" and "smooth" learn from `calibration_data`, else
    `qconfig.calibration_data`, else the package's default text (`calibration.defaults`), tokenized with the
    model's tokenizer.
    `qconfig` is the model's own copy (never the object a caller passed). `calibration_options` (batch_size,
    progress, checkpoint_dir: by default `qconfig.advanced.calibration_checkpoint_dir`, so `from_pretrained` resumes
    too) go to `quantmla_hf.calibration.calibrate`.
    """
    data = calibration_data if calibration_data is not None else qconfig.calibration_data
    if qconfig.transform == "auto":
        resolve_auto_transform(qconfig, data, lambda: resolve_tokenizer(model, qconfig, tokenizer))
    if qconfig.transform == "none" or qconfig.calibrated:
        return
    data, default_source = calibration_data_or_default(qconfig.transform, data)
    if data is not None and isinstance(data, (str, os.PathLike, list, tuple)):
        tokenizer = resolve_tokenizer(model, qconfig, tokenizer)
    check_calibration_inputs(qconfig, data, tokenizer)
    # The calibration bar follows transformers.utils.logging.disable_progress_bar() unless the caller decides.
    options = {"progress": logging.is_progress_bar_enabled(),
               "checkpoint_dir": qconfig.advanced.calibration_checkpoint_dir, **(calibration_options or {})}
    calibrate(model, qconfig, data, tokenizer=tokenizer, **options)
    qconfig.calibrated = True
    if data is not None and "calibration_source" not in qconfig.extra:
        qconfig.extra["calibration_source"] = default_source or _calibration_source(data)
    if not isinstance(qconfig.extra.get("tokenizer"), (str, type(None))):
        del qconfig.extra["tokenizer"]  # a tokenizer object cannot go into config.json


def _calibration_source(data) -> str:
    """What a saved config and model card say about the calibration data: a file's name (not its local path)."""
    if isinstance(data, (str, os.PathLike)):
        return f"text file {os.path.basename(os.fspath(data))}"
    if isinstance(data, torch.Tensor):
        return f"{data.shape[0]} windows of token ids given in memory"
    return f"{len(data)} texts given in memory"


def prepare_model(model, qconfig: QuantMLAConfig, calibration_data=None, tokenizer=None, pre_quantized: bool = False,
                  calibration_options: dict | None = None):
    """Make a loaded MLA `model` use the QuantMLA cache described by `qconfig` (in place; returns `model`).

    `qconfig` becomes the model's own config (pass a copy: it is marked calibrated and records the calibration).
    `pre_quantized` says the checkpoint already carried this config (then its name is not the base model).
    """
    check_mla_model(model)
    base_model = hub_id_of(model)
    if not pre_quantized and "base_model" not in qconfig.extra and base_model:
        qconfig.extra["base_model"] = base_model  # the model card's base_model
    calibrate_if_needed(model, qconfig, calibration_data, tokenizer, calibration_options)
    model.config.quantization_config = qconfig
    install_cache_hooks(model)
    if not hasattr(model, "_quantmla_stock_attn"):
        model._quantmla_stock_attn = model.config._attn_implementation  # what `dequantize` goes back to
    _install_attention(model)
    attach(model)
    return model


def unprepare_model(model, dtype=None):
    """Undo `prepare_model`: a stock model (DynamicCache, stock attention, plain save_pretrained/push_to_hub).

    The weights stay as they are: with a fused transform they compute the same function as the original
    checkpoint's (under different values), so the result is an ordinary model of its family. `dtype` casts it.
    """
    for module in model.modules():  # the model and its base model both carry the hook (`install_cache_hooks`)
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is _pre_forward:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        module.__dict__.pop("_quantmla_state", None)
    detach(model)
    attn = model.__dict__.pop("_quantmla_stock_attn", None)
    for name in ("_quantmla_graph_step", "_quantmla_decode_plan", "_quantmla_cache_pool", "_quantmla_static_cache"):
        model.__dict__.pop(name, None)
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(attn if attn and attn != ATTN_IMPLEMENTATION else "sdpa")
    if dtype is not None:
        model.to(dtype)
    return model


# Attention implementations QuantMLA replaces: transformers' automatic default ("sdpa", what `from_pretrained` and
# `from_config` pick when the caller names none; an explicit "sdpa" cannot be told apart from it) and none at all.
REPLACED_ATTN_IMPLEMENTATIONS = (None, "sdpa")


def _install_attention(model) -> None:
    """Switch `model` to the "quantmla" attention unless the caller chose another implementation.

    `from_pretrained(..., attn_implementation="eager")` (or flex/flash/a hub kernel) is honoured and reported as
    such: the QuantMLA cache works under any implementation (its `update` returns the history stock attention
    expects); only "quantmla" also decodes in the latent space. "sdpa" is transformers' default and is replaced;
    `model.set_attn_implementation("sdpa")` afterwards switches to it (the cache follows at the next forward).
    """
    current = model.config._attn_implementation
    if current in REPLACED_ATTN_IMPLEMENTATIONS or current == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
