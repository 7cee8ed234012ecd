"""`QuantMLAHfQuantizer`: the `from_pretrained` entry point of QuantMLA, registered under quant_method "quantmla".

QuantMLA quantizes the KV cache, not the weights: loading keeps every tensor of the checkpoint as it is (a
calibrated checkpoint already holds the fused transform under the original tensor names). The quantizer checks
the model before any weight is read, and once the weights are in place hands the model to
`quantmla_hf.integration.prepare_model` (calibration when needed, cache hooks, attention swap, the QuantMLA class
of `quantmla_hf.hooks`).
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings

import torch
import transformers.quantizers.auto as transformers_quantizers_auto
from transformers.quantizers.auto import AutoHfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging as transformers_logging

from .calibration.checks import check_calibration_inputs
from .config import QUANT_METHOD, QuantMLAConfig, check_checkpoint_config, weight_conflicts
from .distributed import check_load_not_sharded_for_calibration, check_not_sharded_for_calibration
from .integration import prepare_model, resolve_auto_transform, resolve_tokenizer, unprepare_model
from .mla import mla_dims

INSTALL_HINT = "pip install 'quantmla-hf' (it pulls torch, transformers>=5.17,<6, accelerate and safetensors)"


class QuantMLAHfQuantizer(HfQuantizer):
    """Loads MLA checkpoints with a packed low-bit KV cache (`QuantMLAConfig`)."""

    # Calibration, when the transform needs it, runs at load time from the text given in the config.
    requires_calibration = False
    # The model's own modules and parameters stay; only the cache, the attention function and (after calibration)
    # the values of a few weights change.
    requires_parameters_quantization = False
    quantization_config: QuantMLAConfig

    def __init__(self, quantization_config: QuantMLAConfig, **kwargs):
        # The caller's config is never changed: calibration marks this quantizer's own copy (a config reused for a
        # second model must calibrate that model too).
        if isinstance(quantization_config, dict):
            quantization_config = QuantMLAConfig.from_dict(quantization_config)
        elif isinstance(quantization_config, QuantMLAConfig):
            quantization_config = quantization_config.copy()
        super().__init__(quantization_config, **kwargs)
        # Read before the weights are (`_process_model_before_weight_loading`), checked after.
        self._expected_shapes: dict[str, tuple] = {}
        self._ignore_mismatched_sizes = False
        if self.pre_quantized:
            ignored = check_checkpoint_config(self.quantization_config)
            if ignored:
                warnings.warn(
                    "this checkpoint is already quantized; options of the QuantMLAConfig passed to from_pretrained "
                    f"that describe its weights cannot change them and are ignored: {'; '.join(ignored)}. Every cache "
                    "option given (bits, group_size, sink/recent tokens, and the advanced kernel, cache_block_size, "
                    "static_cache, decode_graphs) does apply",
                    UserWarning, stacklevel=2,
                )

    def validate_environment(self, *args, **kwargs) -> None:
        missing = [name for name in ("torch", "accelerate", "safetensors") if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"QuantMLA needs {', '.join(missing)}: {INSTALL_HINT}")
        if not isinstance(self.quantization_config, QuantMLAConfig):
            raise TypeError(
                f"quant_method 'quantmla' needs a QuantMLAConfig, got {type(self.quantization_config).__name__}; pass "
                "from_pretrained(..., quantization_config=QuantMLAConfig(...)) or its dict"
            )

    def _process_model_before_weight_loading(self, model, **kwargs):
        # Fails on the skeleton (meta device), before any weight is read, for a model that is not MLA or for
        # calibration inputs that could not be used (no text, a missing/binary file, too few tokens).
        mla_dims(model.config)
        qconfig = self.quantization_config
        tokenizer = lambda: resolve_tokenizer(model, qconfig, None)  # noqa: E731  (loaded only when text is counted)
        resolve_auto_transform(qconfig, qconfig.calibration_data, tokenizer)
        # A transform cannot be fused into weights split across processes: refuse before they are read.
        check_load_not_sharded_for_calibration(model.config, qconfig.transform, qconfig.calibrated)
        check_calibration_inputs(qconfig, tokenizer=tokenizer)
        self._expected_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self._ignore_mismatched_sizes = _from_pretrained_argument("ignore_mismatched_sizes", False)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        check_loaded_shapes(model, self._expected_shapes, self._ignore_mismatched_sizes)
        return prepare_model(model, self.quantization_config, pre_quantized=self.pre_quantized)

    def _dequantize(self, model, dtype=None):
        """`model.dequantize()`: a stock model of its family (DynamicCache, stock attention, plain checkpoint).

        The KV cache is the only thing QuantMLA quantizes; the weights (with any calibrated transform fused into
        them, computing the original function) stay as they are.
        """
        return unprepare_model(model, dtype)

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # The weights are ordinary tensors; training never touches the KV cache.
        return True

    @property
    def is_compileable(self) -> bool:
        # generate asks for a compiled decode step only with a compileable cache (the static QuantMLA cache): the model
        # answers with CUDA-graph steps or torch.compile (quantmla_hf.generation.graphs.compiled_call).
        return True


def _from_pretrained_argument(name: str, default):
    """The value of `from_pretrained`'s argument `name` in the call that is loading the model now (its frame is a
    few levels up the stack of the quantizer's hooks); `default` outside such a call."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "from_pretrained" and name in frame.f_locals:
                return frame.f_locals[name]
            frame = frame.f_back
        return default
    finally:
        del frame


def check_loaded_shapes(model, expected: dict, ignore_mismatched_sizes: bool) -> None:
    """Parameters whose loaded shape differs from the model's own (`expected`: name -> shape, read before loading).

    Some transformers releases skip their size check whenever a quantizer loads the model and keep the checkpoint's
    tensor (e.g. a classification head of 2 labels in a model built for 42); QuantMLA quantizes no weight, so the
    check is the stock one: an error naming the tensors and the fix, or, with `ignore_mismatched_sizes=True`, the
    tensor made anew at the model's shape and initialised as the model initialises it. Nothing to do where the
    release checks itself. Sharded (tensor-parallel) loads are left to transformers.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return
    wrong = [(name, tuple(p.shape), expected[name]) for name, p in model.named_parameters()
             if name in expected and tuple(p.shape) != expected[name]]
    if not wrong:
        return
    listed = "; ".join(f"{name}: checkpoint {list(got)}, model {list(want)}" for name, got, want in wrong)
    if not ignore_mismatched_sizes:
        raise RuntimeError(f"the checkpoint's tensors do not match this model's shapes ({listed}); pass "
                           "ignore_mismatched_sizes=True to from_pretrained to initialise them anew, or load the "
                           "model with the config it was saved with")
    for name, _, want in wrong:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, param_name)
        setattr(module, param_name, torch.nn.Parameter(torch.empty(want, dtype=old.dtype, device=old.device),
                                                       requires_grad=old.requires_grad))
        model._init_weights(module)
    # Where a stock load reports it: transformers' loading logger, at its verbosity.
    transformers_logging.get_logger("transformers.modeling_utils").warning(
        f"Reinit due to size mismatch, initialised anew at the model's shapes: {listed}")


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
            "The calibration step alone is quantmla_hf.calibration.calibrate"
        )


def apply_quantmla(model, quantization_config: QuantMLAConfig | dict | None = None, calibration_data=None,
                   tokenizer=None, **calibration_options):
    """Quantize the KV cache of an MLA model already in memory, as `from_pretrained(quantization_config=...)` would.

    Args:
        model: a transformers MLA causal LM (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, LongCat-Flash, MiniCPM3).
        quantization_config: the `QuantMLAConfig` (default C4R4, transform="auto"). It is copied: the
            model's own config (`model.config.quantization_config`) records the calibration; the object passed in
            stays as it was, so it can configure further models.
        calibration_data: text for a learned/smooth transform (list of strings, a text file path, or token ids
            `[N, T]`); overrides `quantization_config.calibration_data`.
        tokenizer: tokenizer for the calibration text (default: the one saved with the model's checkpoint).
        calibration_options: `batch_size`, `progress` of `quantmla_hf.calibration.calibrate`.

    Returns the same model, quantized: `generate` uses the packed cache, `save_pretrained` writes a QuantMLA
    checkpoint (`quantization_config` in config.json) and `push_to_hub` uploads one.
    """
    qconfig = quantization_config if quantization_config is not None else QuantMLAConfig()
    if isinstance(qconfig, dict):
        qconfig = QuantMLAConfig.from_dict(qconfig)
    if not isinstance(qconfig, QuantMLAConfig):
        raise TypeError(f"quantization_config must be a QuantMLAConfig or its dict, got {type(qconfig).__name__}")
    if qconfig.transform != "none" and not qconfig.calibrated:
        # Sharded weights cannot take a fused transform whatever they already hold: say how to do it instead.
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
    calibration). Calibration alone, without connecting the cache, is `quantmla_hf.calibration.calibrate`.

    Example:
        >>> model = quantmla_hf.quantize(model, QuantMLAConfig(content_bits=4), calibration_data="calib.txt")
        >>> model.save_pretrained("out")
    """
    return apply_quantmla(model, quantization_config, calibration_data, tokenizer, **calibration_options)


def _merge_with_weight_conflicts(merge):
    """transformers' `AutoHfQuantizer.merge_quantization_configs` (the function `merge`), which also hands the
    quantizer the weight options of the config passed to `from_pretrained` that the checkpoint cannot take.

    transformers sets the passed config's loading attributes (`QuantMLAConfig.get_loading_attributes`: its cache
    options, an advanced one as "advanced.kernel") on the checkpoint's config and names them in its note; the weight
    options given travel on the merged config object instead (`_weight_conflicts`, read by `check_checkpoint_config`),
    so no private name reaches that note.
    """
    def merge_quantization_configs(cls, quantization_config, quantization_config_from_args):
        merged = merge(cls, quantization_config, quantization_config_from_args)
        if isinstance(merged, QuantMLAConfig):
            given = quantization_config_from_args
            conflicts = weight_conflicts(given, merged) if isinstance(given, QuantMLAConfig) else {}
            object.__setattr__(merged, "_weight_conflicts", conflicts)
        return merged

    merge_quantization_configs.quantmla_wraps = merge
    return classmethod(merge_quantization_configs)


def register_quantmla() -> None:
    """Register `QuantMLAConfig` and `QuantMLAHfQuantizer` under "quantmla" with transformers (idempotent)."""
    mapping = transformers_quantizers_auto
    AUTO_QUANTIZATION_CONFIG_MAPPING = mapping.AUTO_QUANTIZATION_CONFIG_MAPPING
    AUTO_QUANTIZER_MAPPING = mapping.AUTO_QUANTIZER_MAPPING
    # A QuantMLAConfig passed to from_pretrained for a QuantMLA checkpoint brings its cache options
    # (QuantMLAConfig.get_loading_attributes), as GPTQ/AWQ configs bring their loading attributes; the merge also
    # hands over the weight options given, to be named when they differ from the checkpoint.
    kinds = mapping.LOADING_ATTRIBUTES_CONFIG_TYPES
    mapping.LOADING_ATTRIBUTES_CONFIG_TYPES = (*(k for k in kinds if k.__name__ != "QuantMLAConfig"), QuantMLAConfig)
    merge = vars(AutoHfQuantizer)["merge_quantization_configs"].__func__
    merge = getattr(merge, "quantmla_wraps", merge)  # wrap transformers' own, once, also after a module reload
    AutoHfQuantizer.merge_quantization_configs = _merge_with_weight_conflicts(merge)
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not QuantMLAConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a stale class from a reloaded module
        register_quantization_config(QUANT_METHOD)(QuantMLAConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not QuantMLAHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(QuantMLAHfQuantizer)
