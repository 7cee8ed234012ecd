"""Model surgery behind `QuantMLAHfQuantizer`: check the model is MLA, learn/fuse the transform, connect the cache.

Everything here works on a loaded `PreTrainedModel` (weights materialized), so it serves both
`from_pretrained(..., quantization_config=QuantMLAConfig(...))` and `apply_quantmla(model, config)` on a model
built in memory. After `prepare_model`:

- the MLA attention modules share the `QuantMLACache` of the forward in flight (`hooks.install_cache_hooks`);
- the attention implementation is "quantmla" (latent-space decode straight from the packed cache);
- `generate()` (and therefore `pipeline("text-generation")`) builds a `QuantMLACache` from the model's
  quantization config when the caller passes no cache and asks for no `cache_implementation`;
- `save_pretrained` also writes a model card (README.md) rendered from `model_cards/quantmla_model_card.md`
  unless the directory already has one, and `push_to_hub` uploads that card instead of transformers' generic one.
"""

from __future__ import annotations

import functools
import os
import tempfile
import types

import torch
import transformers
from packaging import version

from .attention import ATTN_IMPLEMENTATION
from .cache import QuantMLACache
from .calibration_check import CALIBRATION_HINT, check_calibration_inputs  # noqa: F401  (CALIBRATION_HINT re-exported)
from .config import QuantMLAConfig
from .decode_graphs import compiled_call
from .hooks import install_cache_hooks, mla_attention_modules
from .mla import MLADims, mla_dims
from .static_generate import generation_cache, plan_for_given_cache
from .static_generate import model_qconfig as _model_qconfig

# transformers 5.17 passes the cache to forward as `past_key_values`; 5.18 renamed it `cache`.
GENERATE_CACHE_KWARG = (
    "past_key_values" if version.parse(transformers.__version__).release < (5, 18) else "cache"
)


def generated_cache(output):
    """The cache of a `generate(..., return_dict_in_generate=True)` output (`cache` from 5.18, else `past_key_values`)."""
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
    qconfig = quantization_config or _model_qconfig(model)
    return QuantMLACache(config=model.config.get_text_config(decoder=True), quantization_config=qconfig)


def _resolve_tokenizer(model, qconfig: QuantMLAConfig, tokenizer):
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
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load a tokenizer from {source!r} for calibration ({err}); pass "
            "QuantMLAConfig(..., tokenizer='name-or-path') with a tokenizer that matches the model"
        ) from err


def _load_calibration():
    try:
        from .calibration import quantize
    except ImportError as err:
        raise ImportError(
            "this QuantMLA transform is learned/fused by quantmla_hf.calibration.quantize, which is not available in "
            f"this installation ({err}); use transform='none' or reinstall quantmla-hf"
        ) from err
    return quantize


def calibrate_if_needed(model, qconfig: QuantMLAConfig, calibration_data=None, tokenizer=None,
                        calibration_options: dict | None = None) -> None:
    """Learn and fuse the transform that `qconfig` asks for, once (sets `qconfig.calibrated`).

    "none" needs nothing; "hadamard" is data-free; "learned" and "smooth" need calibration text, from
    `calibration_data` or `qconfig.calibration_data`, or they fail with an error saying how to provide it.
    `qconfig` is the model's own copy (never the object a caller passed). `calibration_options` (batch_size,
    progress) go to `quantmla_hf.calibration.quantize`.
    """
    if qconfig.transform == "none" or qconfig.calibrated:
        return
    data = calibration_data if calibration_data is not None else qconfig.calibration_data
    if data is not None and isinstance(data, (str, os.PathLike, list, tuple)):
        tokenizer = _resolve_tokenizer(model, qconfig, tokenizer)
    check_calibration_inputs(qconfig, data, tokenizer)
    quantize = _load_calibration()
    quantize(model, qconfig, data, tokenizer=tokenizer, **(calibration_options or {}))
    qconfig.calibrated = True
    if data is not None and "calibration_source" not in qconfig.extra:
        qconfig.extra["calibration_source"] = _calibration_source(data)
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
    name = getattr(model.config, "name_or_path", "") or ""
    if not pre_quantized and "base_model" not in qconfig.extra and name.count("/") == 1 and not os.path.exists(name):
        qconfig.extra["base_model"] = name  # a Hub id: the model card's base_model
    calibrate_if_needed(model, qconfig, calibration_data, tokenizer, calibration_options)
    model.config.quantization_config = qconfig
    install_cache_hooks(model)
    if not hasattr(model, "_quantmla_stock_attn"):
        model._quantmla_stock_attn = model.config._attn_implementation  # what `dequantize` goes back to
    _install_attention(model)
    _install_generation_default(model)
    _install_model_card(model)
    _allow_dtype_casts(model)
    return model


def _allow_dtype_casts(model) -> None:
    """`.half()`/`.float()`/`.bfloat16()` work as `.to(dtype)` does: the weights are ordinary tensors (transformers
    refuses them for every quantized model, since most quantize the weights)."""
    for name in ("half", "float", "bfloat16"):
        setattr(model, name, types.MethodType(getattr(torch.nn.Module, name), model))


def unprepare_model(model, dtype=None):
    """Undo `prepare_model`: a stock model (DynamicCache, stock attention, plain save_pretrained/push_to_hub).

    The weights stay as they are: with a fused transform they compute the same function as the original
    checkpoint's (under different values), so the result is an ordinary model of its family. `dtype` casts it.
    """
    from .hooks import _pre_forward

    for module in model.modules():  # the model and its base model both carry the hook (`install_cache_hooks`)
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is _pre_forward:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        module.__dict__.pop("_quantmla_state", None)
    attn = model.__dict__.pop("_quantmla_stock_attn", None)
    for name in ("_prepare_cache_for_generation", "get_compiled_call", "_quantmla_decode_plan", "_quantmla_cache_pool",
                 "_quantmla_static_cache", "save_pretrained", "push_to_hub", "half", "float", "bfloat16",
                 "_quantmla_generation_default", "_quantmla_model_card"):
        model.__dict__.pop(name, None)
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(attn if attn and attn != ATTN_IMPLEMENTATION else "sdpa")
    if dtype is not None:
        model.to(dtype)
    return model


def _refuse_second_transform(model, qconfig: QuantMLAConfig) -> None:
    """A model whose weights already hold a fused transform must not get a second one on top."""
    current = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(current, dict):
        current = QuantMLAConfig.from_dict(current) if current.get("quant_method") == "quantmla" else None
    if not isinstance(current, QuantMLAConfig) or current.transform == "none" or not current.calibrated:
        return
    if qconfig.transform != "none" and not qconfig.calibrated:
        raise ValueError(
            f"this model is already quantized with QuantMLA ({current.name}, transform={current.transform!r} fused "
            "into its weights); applying a second uncalibrated config would fuse another transform on top. "
            "quantmla_hf.quantize(model, config, data) does the whole job in one call (its config is "
            "model.config.quantization_config); start again from the unquantized model to change the cache format. "
            "The calibration step alone is quantmla_hf.calibration.quantize"
        )


def apply_quantmla(model, quantization_config: QuantMLAConfig | dict | None = None, calibration_data=None,
                   tokenizer=None, **calibration_options):
    """Quantize the KV cache of an MLA model already in memory, as `from_pretrained(quantization_config=...)` would.

    Args:
        model: a transformers MLA causal LM (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, LongCat-Flash, MiniCPM3).
        quantization_config: the `QuantMLAConfig` (default C4R4 with the learned transform). It is copied: the
            model's own config (`model.config.quantization_config`) records the calibration; the object passed in
            stays as it was, so it can configure further models.
        calibration_data: text for a learned/smooth transform (list of strings, a text file path, or token ids
            `[N, T]`); overrides `quantization_config.calibration_data`.
        tokenizer: tokenizer for the calibration text (default: the one saved with the model's checkpoint).
        calibration_options: `batch_size`, `progress` of `quantmla_hf.calibration.quantize`.

    Returns the same model, quantized: `generate` uses the packed cache, `save_pretrained` writes a QuantMLA
    checkpoint (`quantization_config` in config.json) and `push_to_hub` uploads one.
    """
    from .quantizer import QuantMLAHfQuantizer

    qconfig = quantization_config if quantization_config is not None else QuantMLAConfig()
    if isinstance(qconfig, dict):
        qconfig = QuantMLAConfig.from_dict(qconfig)
    if not isinstance(qconfig, QuantMLAConfig):
        raise TypeError(f"quantization_config must be a QuantMLAConfig or its dict, got {type(qconfig).__name__}")
    if qconfig.transform != "none" and not qconfig.calibrated:
        # Sharded weights cannot take a fused transform whatever they already hold: say how to do it instead.
        from .distributed import check_not_sharded_for_calibration

        check_not_sharded_for_calibration(model, qconfig.transform)
    _refuse_second_transform(model, qconfig)
    quantizer = QuantMLAHfQuantizer(qconfig, pre_quantized=False)  # holds its own copy of the config
    prepare_model(model, quantizer.quantization_config, calibration_data, tokenizer,
                  calibration_options=calibration_options)
    model.hf_quantizer = quantizer
    model.is_quantized = True
    model.quantization_method = quantizer.quantization_config.quant_method
    return model


def quantize(model, quantization_config: QuantMLAConfig | dict | None = None, calibration_data=None, tokenizer=None,
             **calibration_options):
    """Quantize `model` end to end: calibrate and fuse the transform, connect the packed cache; returns the model.

    The one-call verb (what `quantmla_hf.quantize` is): the same as `apply_quantmla`. The result generates with the
    packed cache and `save_pretrained`/`push_to_hub` write a QuantMLA checkpoint; the tokenizer for calibration
    text is the checkpoint's own unless given. `quantization_config` is not changed (a copy records the
    calibration). Calibration alone, without connecting the cache, is `quantmla_hf.calibration.quantize`.

    Example:
        >>> model = quantmla_hf.quantize(model, QuantMLAConfig(content_bits=4), calibration_data="calib.txt")
        >>> model.save_pretrained("out")
    """
    return apply_quantmla(model, quantization_config, calibration_data, tokenizer, **calibration_options)


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


def _install_generation_default(model) -> None:
    """Make `generate` build a `QuantMLACache` when the caller gives no cache and no `cache_implementation`.

    Only on models that can generate (a causal LM head): a base model or a classification head has no cache to
    choose (and no `_prepare_cache_for_generation`), so nothing is installed on it.

    `GenerationMixin._prepare_cache_for_generation` is where every transformers release from 5.17 on decides the
    cache of a `generate` call (5.17 stores it under `past_key_values`, later releases under `cache`). This wraps
    the model's bound method: a cache the caller passes, `use_cache=False` and an explicit `cache_implementation`
    all go through untouched; otherwise the QuantMLA cache is placed where the stock code looks for a user cache.
    """
    if getattr(model, "_quantmla_generation_default", False) or not model.can_generate():
        return
    stock = model._prepare_cache_for_generation

    @functools.wraps(stock)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        ours = None
        if (
            model_kwargs.get(GENERATE_CACHE_KWARG) is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
        ):
            # A static cache (decode steps from CUDA graphs, or compiled) or the growing one: static_generate decides.
            ours = model_kwargs[GENERATE_CACHE_KWARG] = generation_cache(
                self, generation_config, model_kwargs, args, kwargs
            )
        else:
            # A cache the caller passes: CUDA graphs for a StaticQuantMLACache where the call allows them.
            self._quantmla_decode_plan = plan_for_given_cache(self, generation_config, model_kwargs, args, kwargs)
        out = stock(generation_config, model_kwargs, *args, **kwargs)
        if ours is not None:
            # The stock code marks any cache it finds as the caller's, which only changes when generate may stop
            # early without syncing; ours is generate's own, as a DynamicCache would be.
            ours._is_user_defined = False
        return out

    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    stock_compiled_call = model.get_compiled_call

    @functools.wraps(stock_compiled_call)
    def get_compiled_call(self, compile_config):
        # The decode forward generate uses for a compileable cache: a CUDA-graph step or transformers' torch.compile.
        return compiled_call(self, stock_compiled_call, compile_config)

    model.get_compiled_call = types.MethodType(get_compiled_call, model)
    model._quantmla_generation_default = True


# `save_pretrained(..., push_to_hub=True, **kwargs)` arguments that go to the Hub upload, not to the save.
HUB_SAVE_KWARGS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision")


def _install_model_card(model) -> None:
    """`save_pretrained` also writes the QuantMLA model card; `push_to_hub` uploads it (instead of a generic one)."""
    if getattr(model, "_quantmla_model_card", False):
        return
    stock_save = model.save_pretrained

    @functools.wraps(stock_save)
    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        hub_kwargs = {k: kwargs.pop(k) for k in HUB_SAVE_KWARGS if k in kwargs}
        out = stock_save(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return out
        from .model_card import write_model_card

        write_model_card(self, save_directory)
        if push_to_hub:
            # transformers would upload its generic card; upload the directory with ours instead.
            from huggingface_hub import HfApi

            token = kwargs.get("token")
            api = HfApi(token=token)
            repo_id = hub_kwargs.pop("repo_id", None) or os.path.basename(os.path.normpath(save_directory))
            repo_id = api.create_repo(repo_id, private=hub_kwargs.pop("private", None), exist_ok=True).repo_id
            write_model_card(self, save_directory, repo_id=repo_id)
            return api.upload_folder(
                repo_id=repo_id, folder_path=save_directory,
                commit_message=hub_kwargs.pop("commit_message", None) or "Upload QuantMLA model", **hub_kwargs,
            )
        return out

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                    private: bool | None = None, token=None, revision: str | None = None, create_pr: bool = False,
                    max_shard_size="50GB", tags: list[str] | None = None, base_model: str | None = None,
                    eval_results: dict | None = None, measured_tokens: int = 4096):
        """Upload the quantized checkpoint and its QuantMLA model card to `repo_id` (on `HF_ENDPOINT`).

        Takes every argument of transformers' `push_to_hub` (passed on to the Hub as it would) and the model card's
        `base_model`, `eval_results`, `measured_tokens` (see `quantmla_hf.model_card.render_model_card`).
        """
        from huggingface_hub import HfApi

        from .model_card import write_model_card

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            stock_save(tmp, max_shard_size=max_shard_size)
            write_model_card(self, tmp, overwrite=True, repo_id=repo_id, tags=tags, base_model=base_model,
                             eval_results=eval_results, measured_tokens=measured_tokens)
            return api.upload_folder(
                repo_id=repo_id, folder_path=tmp, commit_message=commit_message or "Upload QuantMLA model",
                commit_description=commit_description, revision=revision, create_pr=create_pr,
            )

    model.save_pretrained = types.MethodType(save_pretrained, model)
    model.push_to_hub = types.MethodType(push_to_hub, model)
    model._quantmla_model_card = True
