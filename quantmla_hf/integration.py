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
import inspect
import os
import tempfile
import types

import torch
import transformers
from huggingface_hub import CommitOperationAdd, HfApi
from packaging import version
from transformers import AutoTokenizer
from transformers.masking_utils import create_masks_for_generate
from transformers.utils import logging

from .attention import ATTN_IMPLEMENTATION
from .cache import QuantMLACache, cache_argument
from .calibration import calibrate
from .calibration.defaults import calibration_data_or_default, resolve_transform
from .calibration_check import (
    check_calibration_inputs,
    read_calibration_text,
)
from .config import QuantMLAConfig
from .decode_graphs import compiled_call, masks_for_generate
from .hooks import _pre_forward, install_cache_hooks, mla_attention_modules
from .log import get_logger
from .mla import MLADims, mla_dims
from .model_card import has_own_card, hub_id_of, write_model_card
from .paged.continuous_api import install_continuous_batching, uninstall_continuous_batching
from .speculative import check_draft_verification, mark_verifications
from .staged_output import staged_directory, write_errors
from .static_generate import generation_cache, plan_for_given_cache, static_cache_wanted
from .static_generate import model_qconfig as _model_qconfig

logger = get_logger(__name__)

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
    progress, checkpoint_dir: by default `qconfig.calibration_checkpoint_dir`, so `from_pretrained` resumes too) go to
    `quantmla_hf.calibration.calibrate`.
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
               "checkpoint_dir": qconfig.calibration_checkpoint_dir, **(calibration_options or {})}
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
    _install_generation_default(model)
    install_continuous_batching(model)
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
    for module in model.modules():  # the model and its base model both carry the hook (`install_cache_hooks`)
        for key, hook in list(module._forward_pre_hooks.items()):
            if hook is _pre_forward:
                del module._forward_pre_hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
        module.__dict__.pop("_quantmla_state", None)
    uninstall_continuous_batching(model)
    attn = model.__dict__.pop("_quantmla_stock_attn", None)
    for name in ("_prepare_cache_for_generation", "get_compiled_call", "create_masks_for_generate",
                 "_get_candidate_generator", "_quantmla_graph_step", "_quantmla_decode_plan", "_quantmla_cache_pool",
                 "_quantmla_static_cache", "save_pretrained", "push_to_hub", "half", "float", "bfloat16",
                 "_quantmla_generation_default", "_quantmla_model_card"):
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


def check_static_cache_length(model, generation_config, args: tuple, kwargs: dict) -> None:
    """Refuse a `generate` call whose static cache would be preallocated past the model's position range.

    A `StaticQuantMLACache` reserves `max_length` positions up front (prompt + `max_new_tokens`); a huge
    `max_new_tokens` would allocate far beyond anything the model can attend to, and be killed for memory.
    `args`/`kwargs` are those of `_prepare_cache_for_generation` (generation_mode, batch_size, max_cache_length).
    """
    if not static_cache_wanted(model, _model_qconfig(model), generation_config):
        return
    needed = int(kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length))
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise ValueError(
            f"the static QuantMLA cache would preallocate {needed} positions (prompt + max_new_tokens), more than "
            f"this model's max_position_embeddings={limit}; lower max_new_tokens to at most {limit} minus the prompt "
            "length, or use QuantMLAConfig(static_cache=False) for a cache that grows"
        )


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
        self.__dict__.pop("_quantmla_graph_step", None)  # the previous call's step object: its masks are not ours
        ours = None
        if (
            model_kwargs.get(GENERATE_CACHE_KWARG) is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
        ):
            check_static_cache_length(self, generation_config, args, kwargs)
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
    # A model class's own mask builder (a method or a staticmethod), else transformers' function.
    own_masks = inspect.getattr_static(type(model), "create_masks_for_generate", None)

    def _create_masks_for_generate(self, **kwargs):
        # generate's per-step 4D mask: skipped for steps a CUDA graph replays (decode_graphs.masks_for_generate).
        stock = own_masks.__get__(self, type(self)) if own_masks is not None else create_masks_for_generate
        return masks_for_generate(self, stock, **kwargs)

    model.create_masks_for_generate = types.MethodType(_create_masks_for_generate, model)
    stock_candidates = model._get_candidate_generator

    @functools.wraps(stock_candidates)
    def _get_candidate_generator(self, *args, **kwargs):
        # Assisted generation and prompt lookup: refuse what cannot equal greedy decoding, and mark every verification
        # forward's drafts on the cache (quantmla_hf.speculative).
        call = inspect.signature(stock_candidates).bind(*args, **kwargs).arguments
        cache = cache_argument(call.get("model_kwargs") or {})
        if isinstance(cache, QuantMLACache):
            check_draft_verification(self, cache, call["generation_config"])
            return mark_verifications(stock_candidates(*args, **kwargs), cache)
        return stock_candidates(*args, **kwargs)

    model._get_candidate_generator = types.MethodType(_get_candidate_generator, model)
    model._quantmla_generation_default = True


# `save_pretrained(..., push_to_hub=True, **kwargs)` arguments that go to the Hub upload, not to the save.
HUB_SAVE_KWARGS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision")


def upload_saved_files(api: HfApi, repo_id: str, folder, files: list[str], commit_message: str, **commit_kwargs):
    """One commit to `repo_id` of exactly `files` (paths relative to `folder`, as `StagedOutput.files` lists what a
    save wrote); other files in `folder` are never read. Returns huggingface_hub's `CommitInfo`."""
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(folder, rel)) for rel in files]
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message, **commit_kwargs)


def _install_model_card(model) -> None:
    """`save_pretrained` also writes the QuantMLA model card; `push_to_hub` uploads it (instead of a generic one)."""
    if getattr(model, "_quantmla_model_card", False):
        return
    stock_save = model.save_pretrained

    @functools.wraps(stock_save)
    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, overwrite: bool = True, **kwargs):
        """transformers' `save_pretrained`, written atomically (`quantmla_hf.staged_output`), with the QuantMLA card.

        A checkpoint already in the folder is replaced whole, as transformers' `save_pretrained` replaces it (its
        common tests save twice into one folder); `overwrite=False` refuses it instead (`OutputError`), which the
        CLI does unless `--overwrite`. With `push_to_hub=True` exactly the files this save wrote are uploaded (what
        `push_to_hub` uploads), never other files lying in the folder.
        """
        hub_kwargs = {k: kwargs.pop(k) for k in HUB_SAVE_KWARGS if k in kwargs}
        if not kwargs.get("is_main_process", True):
            return stock_save(save_directory, *args, **kwargs)
        repo_id = None
        if push_to_hub:
            api = HfApi(token=kwargs.get("token"))
            repo_id = hub_kwargs.pop("repo_id", None) or os.path.basename(os.path.normpath(save_directory))
            repo_id = api.create_repo(repo_id, private=hub_kwargs.pop("private", None), exist_ok=True).repo_id
        with staged_directory(save_directory, overwrite=overwrite) as staged:
            out = stock_save(staged.path, *args, **kwargs)
            if not has_own_card(staged.destination):
                write_model_card(self, staged.path, repo_id=repo_id)
        if not push_to_hub:
            return out
        # transformers would upload its generic card; upload this save's files, with ours, and nothing else.
        return upload_saved_files(api, repo_id, staged.destination, staged.files,
                                  hub_kwargs.pop("commit_message", None) or "Upload QuantMLA model", **hub_kwargs)

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                    private: bool | None = None, token=None, revision: str | None = None, create_pr: bool = False,
                    max_shard_size="50GB", tags: list[str] | None = None, base_model: str | None = None,
                    eval_results: dict | None = None, measured_tokens: int = 4096):
        """Upload the quantized checkpoint and its QuantMLA model card to `repo_id` (on `HF_ENDPOINT`).

        Takes every argument of transformers' `push_to_hub` (passed on to the Hub as it would) and the model card's
        `base_model`, `eval_results`, `measured_tokens` (see `quantmla_hf.model_card.render_model_card`).
        """
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            with write_errors(tmp, "Free space there or set TMPDIR to another folder"):
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
