"""`QuantMLAHfQuantizer`: the `from_pretrained` entry point of QuantMLA, registered under quant_method "quantmla".

QuantMLA quantizes the KV cache, not the weights: loading keeps every tensor of the checkpoint as it is (a
calibrated checkpoint already holds the fused transform under the original tensor names). The quantizer checks
the model before any weight is read, and once the weights are in place hands the model to
`quantmla_hf.integration.prepare_model` (calibration when needed, cache hooks, attention swap, generate default).
"""

from __future__ import annotations

import importlib.util

from transformers.quantizers.base import HfQuantizer

from .config import QuantMLAConfig
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

    def validate_environment(self, *args, **kwargs) -> None:
        missing = [name for name in ("torch", "accelerate", "safetensors") if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"QuantMLA needs {', '.join(missing)}: {INSTALL_HINT}")
        if not isinstance(self.quantization_config, QuantMLAConfig):
            raise TypeError(
                f"quant_method 'quantmla' needs a QuantMLAConfig, got {type(self.quantization_config).__name__}"
            )

    def _process_model_before_weight_loading(self, model, **kwargs):
        # Fails on the skeleton (meta device), before any weight is read, for a model that is not MLA or for
        # calibration inputs that could not be used (no text, a missing/binary file, too few tokens).
        from .calibration_check import check_calibration_inputs
        from .integration import _resolve_tokenizer

        mla_dims(model.config)
        # A transform cannot be fused into weights split across processes: refuse before they are read.
        from .distributed import check_load_not_sharded_for_calibration

        qconfig = self.quantization_config
        check_load_not_sharded_for_calibration(model.config, qconfig.transform, qconfig.calibrated)
        check_calibration_inputs(qconfig, tokenizer=lambda: _resolve_tokenizer(model, qconfig, None))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from .integration import prepare_model

        return prepare_model(model, self.quantization_config, pre_quantized=self.pre_quantized)

    def _dequantize(self, model, dtype=None):
        """`model.dequantize()`: a stock model of its family (DynamicCache, stock attention, plain checkpoint).

        The KV cache is the only thing QuantMLA quantizes; the weights (with any calibrated transform fused into
        them, computing the original function) stay as they are.
        """
        from .integration import unprepare_model

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
        # answers with CUDA-graph steps or torch.compile (quantmla_hf.decode_graphs.compiled_call).
        return True


def register_quantmla() -> None:
    """Register `QuantMLAConfig` and `QuantMLAHfQuantizer` under "quantmla" with transformers (idempotent)."""
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    from .config import QUANT_METHOD

    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not QuantMLAConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a stale class from a reloaded module
        register_quantization_config(QUANT_METHOD)(QuantMLAConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not QuantMLAHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(QuantMLAHfQuantizer)
