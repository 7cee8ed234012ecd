"""`QuantMLAConfig`: what a user asks of the QuantMLA KV cache, validated on construction."""

from __future__ import annotations

import copy
import difflib
import inspect
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = "quantmla"

CONTENT_BITS = (2, 4, 8, 16)
ROPE_BITS = (4, 8, 16)
TRANSFORMS = ("auto", "learned", "hadamard", "smooth", "none")
KERNELS = ("auto", "triton", "torch")
# Version of the `quantization_config` layout this library writes (the `format_version` key of config.json). A
# config without the key predates versioning and is read as version 1; a higher version is refused (newer library).
FORMAT_VERSION = 1
# Options that only shape the cache and the decode at run time: a loaded checkpoint takes every one given in a
# `QuantMLAConfig` passed to `from_pretrained` (its weights hold only the fused transform, which none of them changes).
# The other options describe the weights (transform, calibrated) or how they were made (calibration_*, seed) and come
# from the checkpoint.
CACHE_OPTIONS = (
    "content_bits", "rope_bits", "group_size", "sink_tokens", "recent_tokens", "kernel", "cache_block_size",
    "static_cache", "decode_graphs",
)


# Keys the library itself writes into a config (they round-trip through config.json). Anything else given to the
# constructor, `from_dict` or `update` is a typo or a key of another quantizer and is refused with the closest name.
# A module that records a new key in `QuantMLAConfig.extra` must list it here, or a saved checkpoint will not reload.
LIBRARY_KEYS = frozenset({
    "base_model",  # Hub id of the unquantized model (model card)
    "calibration",  # the calibration record (quantmla_hf.calibration)
    "calibration_source",  # where the calibration text came from (file name or "N texts given in memory")
    "eval",  # perplexity results written by `quantmla eval --json`/the model card
    "measured_bytes_per_token",  # a measured cache footprint
    "tokenizer",  # name or path of the tokenizer for calibration text
})


def _check_choice(name: str, value: Any, accepted: tuple) -> None:
    # 4.0 == 4 and True == 1: a number of the wrong type is refused, not silently taken for an integer.
    if value not in accepted or type(value) is not type(accepted[0]):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_format_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"quantization_config has format_version {version!r}, which no quantmla-hf release writes; "
                         "the config was edited or damaged: restore config.json from the checkpoint's source")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"this checkpoint's quantization_config has format_version {version}, written by a newer quantmla-hf; "
            f"this installation reads format_version <= {FORMAT_VERSION}: pip install -U quantmla-hf"
        )


def _closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


class QuantMLAConfig(QuantizationConfigMixin):
    """Configuration of the QuantMLA KV cache and of the transforms that make it accurate.

    Args:
        content_bits: bits per element of the cached content latent `c` (`[d_c]` per token): 2, 4, 8 or 16.
            16 keeps the latent unquantized in the dtype the model computes in (the BF16-latent baseline).
        rope_bits: bits per element of the cached post-RoPE key `k_R` (`[d_R]` per token): 4, 8 or 16.
        group_size: elements sharing one scale and zero point (per token, asymmetric). A path narrower than
            the group (MiniCPM3's d_R = 32) is one group. Must divide d_c and d_R otherwise.
        sink_tokens: the first real tokens of each sequence kept in the model dtype beside their packed copy.
        recent_tokens: the most recent tokens kept in the model dtype beside their packed copy.
        transform: how the latent is prepared for quantization: "auto" (default: "learned" when the calibration
            data, or the default text when none is given, is large enough to beat RTN, else "none", said in the
            log), "learned" (QuantMLA: learned rotation and scale, fused offline), "hadamard" (QuaRot-style),
            "smooth" (SmoothQuant-style scaling) or "none" (RTN).
        kernel: "triton" for the Triton kernels, "torch" for the PyTorch reference, "auto" for Triton on CUDA
            and PyTorch elsewhere.
        calibration_data: text used to learn the transforms: a list of strings, a path to a text file, or
            `None` (then "learned" and "smooth" learn from the package's default text, read with the model's
            tokenizer: `quantmla_hf.calibration.defaults`).
        calibration_samples: number of calibration sequences (the last ~10% are held out for checkpoint selection).
        calibration_seq_len: tokens per calibration sequence.
        calibration_steps: optimisation steps per layer and path.
        calibration_lr: learning rate of the transform parameters.
        seed: seed for sampling calibration windows and initialising transforms.
        calibrated: set by the library once the transform has been learned and fused into the weights; a
            checkpoint saved with `calibrated=True` loads without calibration.
        cache_block_size: tokens per allocation block of the packed cache (storage grows by whole blocks).
        static_cache: the cache `generate` builds: True for a `StaticQuantMLACache` preallocated for the call's
            maximum length (compiled decode, one CUDA graph per step), False for the growing `QuantMLACache`,
            "auto" (default) for the static one only when the call passes a `compile_config` on one CUDA device.
        decode_graphs: whether plain `generate()` replays its decode steps from CUDA graphs (static cache, no
            compiler; `quantmla_hf.generation.graphs`): "auto" (default) on one CUDA device where the call can be
            captured, True to insist (an error where it cannot be used), False for eager decode.
        calibration_checkpoint_dir: a folder where calibration keeps the transforms of each finished decoder layer
            (`quantmla_hf.calibration.checkpoint`): a calibration killed or interrupted and started again with the same
            folder, model, text and options resumes after the last finished layer. A local path, never written to
            config.json.

    The config remembers which options were given (`explicit_options`): passed beside an already quantized checkpoint,
    every cache option given applies, one equal to its default too.
    """

    def __new__(cls, *args, **kwargs):
        # The options given are read from the call itself: a value equal to the default is still a request (it
        # overrides a checkpoint's value), which the values alone cannot tell.
        self = super().__new__(cls)
        try:
            given = _SIGNATURE.bind(self, *args, **kwargs).arguments
        except TypeError:
            given = {}  # __init__ raises the error
        object.__setattr__(self, "_explicit", frozenset(k for k in given if k in FIELDS))
        return self

    def __init__(
        self,
        content_bits: int = 4,
        rope_bits: int = 4,
        group_size: int = 64,
        sink_tokens: int = 4,
        recent_tokens: int = 128,
        transform: str = "auto",
        kernel: str = "auto",
        calibration_data: str | list[str] | None = None,
        calibration_samples: int = 64,
        calibration_seq_len: int = 512,
        calibration_steps: int = 100,
        calibration_lr: float = 5e-3,
        seed: int = 0,
        calibrated: bool = False,
        cache_block_size: int = 256,
        static_cache: bool | str = "auto",
        decode_graphs: bool | str = "auto",
        calibration_checkpoint_dir: str | None = None,
        **kwargs,
    ):
        object.__setattr__(self, "_validating", False)
        self.quant_method = QUANT_METHOD
        _check_format_version(kwargs.pop("format_version", 1))
        unknown = [k for k in kwargs if k != "quant_method" and k not in LIBRARY_KEYS]
        if unknown:
            key = unknown[0]
            raise ValueError(
                f"QuantMLAConfig has no option {key!r}{_closest(key, FIELDS)} (options: {', '.join(FIELDS)})"
            )
        if kwargs.get("quant_method", QUANT_METHOD) != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r} for a QuantMLAConfig, got {kwargs['quant_method']!r}")
        self.content_bits = content_bits
        self.rope_bits = rope_bits
        self.group_size = group_size
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.transform = transform
        self.kernel = kernel
        self.calibration_data = calibration_data
        self.calibration_samples = calibration_samples
        self.calibration_seq_len = calibration_seq_len
        self.calibration_steps = calibration_steps
        self.calibration_lr = calibration_lr
        self.seed = seed
        self.calibrated = calibrated
        self.cache_block_size = cache_block_size
        self.static_cache = static_cache
        self.decode_graphs = decode_graphs
        self.calibration_checkpoint_dir = calibration_checkpoint_dir
        # Keys written by the library after calibration (e.g. the measured cache footprint) round-trip untouched.
        self.extra = {k: v for k, v in kwargs.items() if k != "quant_method"}
        self.post_init()
        object.__setattr__(self, "_validating", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Every assignment after construction is validated; an unknown public name is refused."""
        if not getattr(self, "_validating", False) or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name not in FIELDS and name not in ("extra", "quant_method"):
            raise AttributeError(f"QuantMLAConfig has no option {name!r}{_closest(name, FIELDS)}")
        self._assign({name: value})

    def _assign(self, values: dict[str, Any]) -> None:
        """Set `values` together and validate; on a bad value every field keeps its previous value (and nothing is
        remembered as given)."""
        old = {k: getattr(self, k) for k in values}
        for k, v in values.items():
            object.__setattr__(self, k, v)
        try:
            self.post_init()
        except ValueError:
            for k, v in old.items():
                object.__setattr__(self, k, v)
            raise
        object.__setattr__(self, "_explicit", self._explicit | {k for k in values if k in FIELDS})

    @property
    def explicit_options(self) -> frozenset[str]:
        """The options given to the constructor, `update` or by assignment, whatever their value (a config read with
        `from_dict` was given every key of the dict). A copy remembers them; a saved config does not."""
        return self._explicit

    def update(self, **kwargs) -> dict[str, Any]:
        """Set several options at once, validated together; an unknown option is an error (not silently returned).

        Returns an empty dict (the unused options, kept for the `QuantizationConfigMixin.update` signature).
        """
        unknown = [k for k in kwargs if k not in FIELDS]
        if unknown:
            raise ValueError(f"QuantMLAConfig has no option {unknown[0]!r}{_closest(unknown[0], FIELDS)}")
        self._assign(kwargs)
        return {}

    def copy(self) -> "QuantMLAConfig":
        """An independent copy (calibration text, record and extra keys copied; a tokenizer object shared)."""
        new = copy.copy(self)
        object.__setattr__(new, "calibration_data", copy.deepcopy(self.calibration_data))
        object.__setattr__(new, "extra", {
            k: (v if k == "tokenizer" and not isinstance(v, str) else copy.deepcopy(v)) for k, v in self.extra.items()
        })
        return new

    def post_init(self) -> None:
        """Validate every field; errors name the bad value and the accepted ones."""
        _check_choice("content_bits", self.content_bits, CONTENT_BITS)
        _check_choice("rope_bits", self.rope_bits, ROPE_BITS)
        _check_int("group_size", self.group_size, 1)
        if self.group_size & (self.group_size - 1) or self.group_size < 8:
            raise ValueError(f"group_size must be a power of two >= 8 (64 is the default), got {self.group_size}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("recent_tokens", self.recent_tokens, 0)
        _check_choice("transform", self.transform, TRANSFORMS)
        _check_choice("kernel", self.kernel, KERNELS)
        if self.calibration_data is not None and not isinstance(self.calibration_data, (str, list, tuple)):
            raise ValueError(
                "calibration_data must be a path to a text file or a list of strings, "
                f"got {type(self.calibration_data).__name__}"
            )
        if isinstance(self.calibration_data, (list, tuple)) and not all(
            isinstance(t, str) for t in self.calibration_data
        ):
            raise ValueError("calibration_data given as a list must hold strings only")
        _check_int("calibration_samples", self.calibration_samples, 2)
        _check_int("calibration_seq_len", self.calibration_seq_len, 8)
        _check_int("calibration_steps", self.calibration_steps, 0)
        if isinstance(self.calibration_lr, bool) or not isinstance(self.calibration_lr, (int, float)) or not (
            self.calibration_lr > 0
        ):
            raise ValueError(f"calibration_lr must be a positive number, got {self.calibration_lr!r}")
        _check_int("seed", self.seed, 0)
        if self.calibration_checkpoint_dir is not None and not (
            isinstance(self.calibration_checkpoint_dir, str) and self.calibration_checkpoint_dir
        ):
            raise ValueError("calibration_checkpoint_dir must be a folder path (a non-empty string) or None, got "
                             f"{self.calibration_checkpoint_dir!r}")
        _check_int("cache_block_size", self.cache_block_size, 1)
        if self.static_cache not in ("auto", True, False) or isinstance(self.static_cache, int) and not isinstance(
            self.static_cache, bool
        ):
            raise ValueError(f"static_cache must be 'auto', True or False, got {self.static_cache!r}")
        if not (self.decode_graphs == "auto" or isinstance(self.decode_graphs, bool)):
            raise ValueError(f"decode_graphs must be 'auto', True or False, got {self.decode_graphs!r}")
        if self.static_cache is True and self.recent_tokens < 1:
            raise ValueError(
                "static_cache=True needs recent_tokens >= 1 (each compiled decode step is written through the recent "
                "window), got recent_tokens=0; keep recent_tokens >= 1 or use static_cache='auto' or False"
            )
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"calibrated must be True or False, got {self.calibrated!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")

    @property
    def name(self) -> str:
        """Short name of the cache precision, e.g. "C4R4"."""
        return f"C{self.content_bits}R{self.rope_bits}"

    @property
    def needs_calibration(self) -> bool:
        """True when a data-dependent transform still has to be learned and fused."""
        return self.transform in ("learned", "smooth") and not self.calibrated

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs):
        """The config of a dict (config.json's `quantization_config`); remembers which keys the dict held, so a
        checkpoint's config can be checked for completeness (`check_checkpoint_config`)."""
        config = cls(**config_dict)
        object.__setattr__(config, "_loaded_keys", frozenset(config_dict))
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k)}
        for k, v in kwargs.items():
            if hasattr(config, k):
                setattr(config, k, v)
        return (config, unused) if return_unused_kwargs else config

    def get_loading_attributes(self) -> dict[str, Any]:
        """What this config, passed to `from_pretrained` for an already quantized checkpoint, sets in the checkpoint's
        config (transformers' loading attributes): every cache option given here (`explicit_options`), also one equal
        to its default. The weight options given here cannot change weights already saved: `weight_conflicts` names
        each one that differs from the checkpoint (the quantizer warns)."""
        return {k: getattr(self, k) for k in CACHE_OPTIONS if k in self._explicit}

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quant_method": self.quant_method,
            "format_version": FORMAT_VERSION,
            "content_bits": self.content_bits,
            "rope_bits": self.rope_bits,
            "group_size": self.group_size,
            "sink_tokens": self.sink_tokens,
            "recent_tokens": self.recent_tokens,
            "transform": self.transform,
            "kernel": self.kernel,
            # Calibration text can be large, and a local path means nothing elsewhere: a saved checkpoint keeps the
            # path only while calibration is still to run; once calibrated, `calibration_source` says what was used.
            "calibration_data": (
                self.calibration_data if isinstance(self.calibration_data, str) and not self.calibrated else None
            ),
            "calibration_samples": self.calibration_samples,
            "calibration_seq_len": self.calibration_seq_len,
            "calibration_steps": self.calibration_steps,
            "calibration_lr": self.calibration_lr,
            "seed": self.seed,
            "calibrated": self.calibrated,
            "cache_block_size": self.cache_block_size,
            "static_cache": self.static_cache,
            "decode_graphs": self.decode_graphs,
        }
        out.update(copy.deepcopy(self.extra))
        return out

    def __iter__(self):
        """`dict(config)`, which transformers may call on a quantization config: the serialized fields only."""
        yield from self.to_dict().items()

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style read of a serialized field. transformers reads a model config's `quantization_config` with
        `.get` (it expects config.json's dict) also when the config object of a loaded QuantMLA model is passed back,
        as in `AutoModel.from_pretrained(path, config=model.config)`."""
        return self.to_dict().get(key, default)

    def __repr__(self) -> str:
        """Short: the cache name and the options that differ from the defaults; extra keys by name only."""
        parts = [self.name]
        for k in FIELDS:
            if k in ("content_bits", "rope_bits"):
                continue
            if k == "transform":
                parts.append(f"transform={self.transform!r}")
                continue
            v = getattr(self, k)
            if k == "calibration_data" and isinstance(v, (list, tuple)):
                v = f"<{len(v)} texts>"
                parts.append(f"{k}={v}")
            elif v != _DEFAULTS[k]:
                parts.append(f"{k}={v!r}")
        if self.extra:
            parts.append(f"extra=[{', '.join(sorted(self.extra))}]")
        return f"QuantMLAConfig({', '.join(parts)})"


# Keys every quantization_config written by quantmla-hf holds; a checkpoint's config without one was edited.
REQUIRED_CHECKPOINT_KEYS = ("content_bits", "rope_bits", "group_size", "transform", "calibrated")


def check_checkpoint_config(config: QuantMLAConfig) -> list[str]:
    """Refuse a `quantization_config` read from a checkpoint that could start work or read local files.

    A downloaded config.json must not choose files on this machine or make loading calibrate: calibration data
    named in it, or a transform it claims but whose weights were never calibrated, are refused with the fix.
    Keys a checkpoint always holds must be present (else the weights' transform is unknown). Returns one sentence
    per weight option passed to `from_pretrained` that differs from this checkpoint (`weight_conflicts`, handed
    over by the merge that `quantmla_hf.quantizer.register_quantmla` wraps; read once).
    """
    loaded = getattr(config, "_loaded_keys", None)
    if loaded is not None:
        missing = [k for k in REQUIRED_CHECKPOINT_KEYS if k not in loaded]
        if missing:
            raise ValueError(
                f"this checkpoint's quantization_config lacks {', '.join(missing)}, which quantmla-hf always writes: "
                "config.json was edited or truncated, and without them the transform held by the weights is unknown. "
                "Restore config.json from where the checkpoint came from, or quantize the unquantized model again"
            )
    # A config object handed back from a live calibrated model (from_pretrained(path, config=model.config)) may still
    # hold the text it was calibrated with, unused from then on; a config read from config.json may hold nothing.
    if config.calibration_data is not None and (loaded is not None or not config.calibrated):
        named = config.calibration_data if isinstance(config.calibration_data, str) else "a list of texts"
        raise ValueError(
            f"this checkpoint's quantization_config names calibration data ({named!r}); a loaded checkpoint never "
            "reads local files or calibrates. Delete calibration_data from its config.json, or calibrate yourself: "
            "from_pretrained(UNQUANTIZED_MODEL, quantization_config=QuantMLAConfig(calibration_data=...))"
        )
    if config.transform != "none" and not config.calibrated:
        raise ValueError(
            f"this checkpoint's quantization_config claims transform={config.transform!r} with calibrated=false: its "
            "weights hold no fused transform, and loading it would calibrate, which a loaded checkpoint never does. "
            "Quantize the unquantized model yourself (quantmla_hf.quantize(model, QuantMLAConfig(transform="
            f"{config.transform!r}), calibration_data=...)), or set transform to \"none\" in config.json if its weights "
            "are the stock ones"
        )
    conflicts = vars(config).pop("_weight_conflicts", {})
    return [f"{k}={_short(given)} (the checkpoint has {_short(saved)})" for k, (given, saved) in conflicts.items()]


def weight_conflicts(requested: QuantMLAConfig, checkpoint: QuantMLAConfig) -> dict[str, tuple[Any, Any]]:
    """The weight options given in `requested` (its `explicit_options` outside `CACHE_OPTIONS`) that differ from
    `checkpoint`'s, as name -> (requested value, checkpoint's value): a quantized checkpoint's weights hold its
    transform, so none of them can apply to it."""
    given = [k for k in FIELDS if k in requested.explicit_options and k not in CACHE_OPTIONS]
    return {k: (getattr(requested, k), getattr(checkpoint, k)) for k in given
            if getattr(requested, k) != getattr(checkpoint, k)}


def _short(value: Any) -> str:
    return f"<{len(value)} texts>" if isinstance(value, (list, tuple)) else repr(value)


FIELDS = (
    "content_bits", "rope_bits", "group_size", "sink_tokens", "recent_tokens", "transform", "kernel",
    "calibration_data", "calibration_samples", "calibration_seq_len", "calibration_steps", "calibration_lr", "seed",
    "calibrated", "cache_block_size", "static_cache", "decode_graphs", "calibration_checkpoint_dir",
)
_SIGNATURE = inspect.signature(QuantMLAConfig.__init__)
_DEFAULTS = {name: p.default for name, p in _SIGNATURE.parameters.items() if name in FIELDS}
