"""`QuantMLAConfig`: what a user asks of the QuantMLA KV cache, validated on construction.

Two levels. The options most users set are keywords of `QuantMLAConfig`: bits, group size, sink/recent tokens,
transform and calibration data. The rarely needed ones form one nested group, `AdvancedOptions`, passed as
`advanced={"kernel": "torch", "calibration_steps": 50}` (or an `AdvancedOptions`): the kernel choice, the cache's
allocation block, the static cache and decode graphs of `generate`, the calibration recipe and seed, and a folder for
resumable calibration. An option of the group is named "advanced.<name>" wherever options are listed by name
(`explicit_options`, `get_loading_attributes`, `weight_conflicts`).

The saved layout (config.json's `quantization_config`) carries `format_version`: version 2 (`FORMAT_VERSION`) nests
the group under "advanced"; version 1 (the group's options at the top level; a config without the key is version 1
too) is read and migrated on load; a higher version is refused (written by a newer library).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

QUANT_METHOD = "quantmla"

CONTENT_BITS = (2, 4, 8, 16)
ROPE_BITS = (4, 8, 16)
TRANSFORMS = ("auto", "learned", "hadamard", "smooth", "none")
KERNELS = ("auto", "triton", "torch")
# Version of the `quantization_config` layout this library writes (the `format_version` key of config.json): 2 nests
# the advanced options under "advanced"; 1 (or no key) kept them at the top level and is migrated when read.
FORMAT_VERSION = 2


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


def _check_auto_or_bool(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or isinstance(value, str) and value == "auto"):
        raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")


def _check_format_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"quantization_config has format_version {version!r}, which no quantmla-hf release writes; "
                         "the config was edited or damaged: restore config.json from the checkpoint's source")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"this checkpoint's quantization_config has format_version {version}, written by a newer quantmla-hf; "
            f"this installation reads format_version <= {FORMAT_VERSION}: pip install -U quantmla-hf"
        )


@dataclasses.dataclass(kw_only=True)
class AdvancedOptions:
    """The rarely needed options of a `QuantMLAConfig` (its `advanced` group), each validated on construction.

    Read-only once made: change options through the config, `config.advanced = {"kernel": "torch"}` or
    `config.update(advanced={...})`, which set the options named and keep the others.

    Cache and decode at run time (a quantized checkpoint takes each one given beside it in `from_pretrained`):
        kernel: "triton" for the Triton kernels, "torch" for the PyTorch reference, "auto" (default) for Triton on
            CUDA and PyTorch elsewhere.
        cache_block_size: tokens per allocation block of the packed cache (storage grows by whole blocks).
        static_cache: the cache `generate` builds: True for a `StaticQuantMLACache` preallocated for the call's
            maximum length (compiled decode, one CUDA graph per step), False for the growing `QuantMLACache`,
            "auto" (default) for the static one only when the call passes a `compile_config` on one CUDA device.
        decode_graphs: whether plain `generate()` replays its decode steps from CUDA graphs (static cache, no
            compiler; `quantmla_hf.generation.graphs`): "auto" (default) on one CUDA device where the call can be
            captured, True to insist (an error where it cannot be used), False for eager decode.

    Calibration recipe (how a learned or smooth transform is made; a quantized checkpoint keeps its own):
        calibration_samples: number of calibration sequences (the last ~10% are held out for checkpoint selection).
        calibration_seq_len: tokens per calibration sequence.
        calibration_steps: optimisation steps per layer and path.
        calibration_lr: learning rate of the transform parameters.
        seed: seed for sampling calibration windows and initialising transforms.
        calibration_checkpoint_dir: a folder where calibration keeps the transforms of each finished decoder layer
            (`quantmla_hf.calibration.checkpoint`): a calibration killed or interrupted and started again with the
            same folder, model, text and options resumes after the last finished layer. A local path, never written
            to config.json.
    """

    kernel: str = "auto"
    cache_block_size: int = 256
    static_cache: bool | str = "auto"
    decode_graphs: bool | str = "auto"
    calibration_samples: int = 64
    calibration_seq_len: int = 512
    calibration_steps: int = 100
    calibration_lr: float = 5e-3
    seed: int = 0
    calibration_checkpoint_dir: str | None = None

    def __new__(cls, *args, **kwargs):
        # The options given are remembered (a value equal to the default is still a request); an unknown name is
        # refused here with the closest one, before the generated __init__ would raise a bare TypeError.
        unknown = [k for k in kwargs if k not in ADVANCED_FIELDS]
        if unknown:
            raise ValueError(f"advanced options have no {unknown[0]!r}{_closest(unknown[0])} "
                             f"(advanced options: {', '.join(ADVANCED_FIELDS)})")
        self = super().__new__(cls)
        object.__setattr__(self, "_given", frozenset(kwargs))
        return self

    def __post_init__(self) -> None:
        _check_choice("advanced.kernel", self.kernel, KERNELS)
        _check_int("advanced.cache_block_size", self.cache_block_size, 1)
        _check_auto_or_bool("advanced.static_cache", self.static_cache)
        _check_auto_or_bool("advanced.decode_graphs", self.decode_graphs)
        _check_int("advanced.calibration_samples", self.calibration_samples, 2)
        _check_int("advanced.calibration_seq_len", self.calibration_seq_len, 8)
        _check_int("advanced.calibration_steps", self.calibration_steps, 0)
        lr = self.calibration_lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"advanced.calibration_lr must be a positive number, got {lr!r}")
        _check_int("advanced.seed", self.seed, 0)
        folder = self.calibration_checkpoint_dir
        if folder is not None and not (isinstance(folder, str) and folder):
            raise ValueError("advanced.calibration_checkpoint_dir must be a folder path (a non-empty string) or None, "
                             f"got {folder!r}")
        object.__setattr__(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed"):
            raise AttributeError(
                f"advanced options are read-only; set {name} through the config: "
                f"config.advanced = {{{name!r}: {value!r}}} (the other advanced options keep their values)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"advanced options are read-only; {name} cannot be deleted")

    def with_options(self, values: dict[str, Any]) -> "AdvancedOptions":
        """A new group with `values` (name -> value) set and every other option kept; validated."""
        return AdvancedOptions(**{**self.as_dict(), **values})

    def as_dict(self) -> dict[str, Any]:
        """Every option, name -> value."""
        return {name: getattr(self, name) for name in ADVANCED_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """The saved options (config.json's "advanced"): every one but `calibration_checkpoint_dir`, a local path."""
        return {k: v for k, v in self.as_dict().items() if k != "calibration_checkpoint_dir"}


ADVANCED_FIELDS = tuple(f.name for f in dataclasses.fields(AdvancedOptions))
_ADVANCED_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AdvancedOptions)}
# The top-level options, in the constructor's order (`calibrated` is set by the library: see QuantMLAConfig).
TOP_FIELDS = ("content_bits", "rope_bits", "group_size", "sink_tokens", "recent_tokens", "transform",
              "calibration_data", "calibrated")
# Every option by name: the top-level ones, then the advanced group's as "advanced.<name>".
OPTIONS = (*TOP_FIELDS, *(f"advanced.{name}" for name in ADVANCED_FIELDS))
# Options that only shape the cache and the decode at run time: a loaded checkpoint takes every one given in a
# `QuantMLAConfig` passed to `from_pretrained` (its weights hold only the fused transform, which none of them changes).
# The other options describe the weights (transform, calibrated) or how they were made (the calibration recipe) and
# come from the checkpoint.
CACHE_OPTIONS = (
    "content_bits", "rope_bits", "group_size", "sink_tokens", "recent_tokens", "advanced.kernel",
    "advanced.cache_block_size", "advanced.static_cache", "advanced.decode_graphs",
)


def _closest(name: str) -> str:
    """"; did you mean ...?" with the closest option, spelled as it is given (an advanced one inside `advanced`)."""
    match = difflib.get_close_matches(name, [*TOP_FIELDS, *ADVANCED_FIELDS], n=1, cutoff=0.5)
    if not match:
        return ""
    return f"; did you mean {match[0]!r}?" if match[0] in TOP_FIELDS else \
        f"; did you mean advanced={{{match[0]!r}: ...}}?"


def _advanced_spelling(name: str, value: Any, call: str) -> str:
    """How `name=value`, an advanced option given at the top level, is given: the message that refuses it."""
    return (f"{name} is an advanced option: {call}(advanced={{{name!r}: {value!r}}}) "
            "(see QuantMLAConfig's advanced group, quantmla_hf.config.AdvancedOptions)")


def _given_advanced(value: Any) -> frozenset[str]:
    """The names of the advanced options that `value` (a dict, an `AdvancedOptions` or None) gives."""
    if isinstance(value, AdvancedOptions):
        return value._given
    return frozenset(value) if isinstance(value, dict) else frozenset()


def _advanced_group(value: Any, current: AdvancedOptions | None = None) -> AdvancedOptions:
    """The group `value` stands for: an `AdvancedOptions` as it is, a dict's options set on `current` (default: the
    defaults), None the defaults."""
    if isinstance(value, AdvancedOptions):
        return value
    if value is None:
        return AdvancedOptions()
    if isinstance(value, dict):
        return (current or AdvancedOptions()).with_options(value)
    raise ValueError(f"advanced must be a dict of advanced options (e.g. {{'kernel': 'torch'}}), an AdvancedOptions "
                     f"or None, got {type(value).__name__}")


def _migrate_version_1(saved: dict[str, Any], advanced: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A version-1 config's keys (`saved`, without the top-level options) in the version-2 shape: the advanced
    options it keeps at the top level move into the group. Returns (the other keys, the group's dict or None)."""
    flat = {k: v for k, v in saved.items() if k in ADVANCED_FIELDS}
    if not flat:
        return saved, advanced
    if advanced is not None:
        raise ValueError(f"this quantization_config is format_version 1 but holds both 'advanced' and {sorted(flat)}; "
                         "a version-1 config has no 'advanced' group: restore config.json from the checkpoint's "
                         "source")
    return {k: v for k, v in saved.items() if k not in flat}, flat


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
        calibration_data: text used to learn the transforms: a list of strings, a path to a text file, or
            `None` (then "learned" and "smooth" learn from the package's default text, read with the model's
            tokenizer: `quantmla_hf.calibration.defaults`).
        advanced: the rarely needed options (`AdvancedOptions`: kernel, cache_block_size, static_cache,
            decode_graphs, the calibration recipe, seed, calibration_checkpoint_dir), as a dict of those given,
            e.g. `{"kernel": "torch", "calibration_steps": 50}`, or an `AdvancedOptions`; the others keep their
            defaults. Read back as `config.advanced.kernel`.
        calibrated: set by the library once the transform has been learned and fused into the weights; a
            checkpoint saved with `calibrated=True` loads without calibration.
        library_keys: keys the library writes into a saved config (`LIBRARY_KEYS`: the calibration record, the
            measured footprint, ...), kept in `extra`; `quant_method` and `format_version` of a saved config.

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
        object.__setattr__(self, "_explicit", frozenset(k for k in given if k in TOP_FIELDS))
        return self

    def __init__(
        self,
        content_bits: int = 4,
        rope_bits: int = 4,
        group_size: int = 64,
        sink_tokens: int = 4,
        recent_tokens: int = 128,
        transform: str = "auto",
        calibration_data: str | list[str] | None = None,
        advanced: AdvancedOptions | dict[str, Any] | None = None,
        *,
        calibrated: bool = False,
        **library_keys,
    ):
        object.__setattr__(self, "_validating", False)
        self.quant_method = QUANT_METHOD
        version = library_keys.pop("format_version", FORMAT_VERSION)
        _check_format_version(version)
        if version == 1:
            library_keys, advanced = _migrate_version_1(library_keys, advanced)
        for key, value in library_keys.items():
            if key in ADVANCED_FIELDS:
                raise ValueError(_advanced_spelling(key, value, "QuantMLAConfig"))
            if key != "quant_method" and key not in LIBRARY_KEYS:
                raise ValueError(f"QuantMLAConfig has no option {key!r}{_closest(key)} (options: "
                                 f"{', '.join(TOP_FIELDS)}, advanced={{...}} with {', '.join(ADVANCED_FIELDS)})")
        if library_keys.get("quant_method", QUANT_METHOD) != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r} for a QuantMLAConfig, got "
                             f"{library_keys['quant_method']!r}")
        self.content_bits = content_bits
        self.rope_bits = rope_bits
        self.group_size = group_size
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.transform = transform
        self.calibration_data = calibration_data
        self.advanced = _advanced_group(advanced)
        self.calibrated = calibrated
        # Keys written by the library after calibration (e.g. the measured cache footprint) round-trip untouched.
        self.extra = {k: v for k, v in library_keys.items() if k != "quant_method"}
        self.post_init()
        given = {f"advanced.{name}" for name in _given_advanced(advanced)}
        object.__setattr__(self, "_explicit", self._explicit | given)
        object.__setattr__(self, "_validating", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Every assignment after construction is validated; an unknown public name is refused. `advanced` takes a
        dict of the advanced options to set (the others keep their values) or a whole `AdvancedOptions`;
        "advanced.<name>" (as `setattr(config, "advanced.kernel", "torch")`) sets one of them."""
        if not getattr(self, "_validating", False) or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name.startswith("advanced."):
            self._assign({"advanced": {name.removeprefix("advanced."): value}})
            return
        if name in ADVANCED_FIELDS:
            raise AttributeError(f"{name} is an advanced option: config.advanced = {{{name!r}: {value!r}}}")
        if name not in TOP_FIELDS and name not in ("advanced", "extra", "quant_method"):
            raise AttributeError(f"QuantMLAConfig has no option {name!r}{_closest(name)}")
        self._assign({name: value})

    def __getattr__(self, name: str) -> Any:
        # Only called for a name not found: an advanced option asked of the config says where it is.
        if name in ADVANCED_FIELDS:
            raise AttributeError(f"QuantMLAConfig has no attribute {name!r}: it is an advanced option, read "
                                 f"config.advanced.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _assign(self, values: dict[str, Any]) -> None:
        """Set `values` together and validate; on a bad value every field keeps its previous value (and nothing is
        remembered as given). An "advanced" value is a dict of advanced options to set or an `AdvancedOptions`."""
        given = {k for k in values if k in TOP_FIELDS}
        if "advanced" in values:
            given |= {f"advanced.{k}" for k in _given_advanced(values["advanced"])}
            values = {**values, "advanced": _advanced_group(values["advanced"], self.advanced)}
        old = {k: getattr(self, k) for k in values}
        for k, v in values.items():
            object.__setattr__(self, k, v)
        try:
            self.post_init()
        except ValueError:
            for k, v in old.items():
                object.__setattr__(self, k, v)
            raise
        object.__setattr__(self, "_explicit", self._explicit | given)

    @property
    def explicit_options(self) -> frozenset[str]:
        """The options given to the constructor, `update` or by assignment, whatever their value (a config read with
        `from_dict` was given every key of the dict): top-level names and "advanced.<name>" for the advanced group.
        A copy remembers them; a saved config does not."""
        return self._explicit

    def option(self, name: str) -> Any:
        """The value of the option `name`, a top-level one or "advanced.<name>" (as `OPTIONS` lists them)."""
        if name.startswith("advanced."):
            return getattr(self.advanced, name.removeprefix("advanced."))
        return getattr(self, name)

    def update(self, **kwargs) -> dict[str, Any]:
        """Set several options at once, validated together; an unknown option is an error (not silently returned).
        `advanced={...}` sets the advanced options named and keeps the others.

        Returns an empty dict (the unused options, kept for the `QuantizationConfigMixin.update` signature).
        """
        for key, value in kwargs.items():
            if key in ADVANCED_FIELDS:
                raise ValueError(_advanced_spelling(key, value, "config.update"))
            if key not in TOP_FIELDS and key != "advanced":
                raise ValueError(f"QuantMLAConfig has no option {key!r}{_closest(key)}")
        self._assign(kwargs)
        return {}

    def copy(self) -> "QuantMLAConfig":
        """An independent copy (calibration text, record and extra keys copied; a tokenizer object shared; the
        advanced group, read-only, shared)."""
        new = copy.copy(self)
        object.__setattr__(new, "calibration_data", copy.deepcopy(self.calibration_data))
        object.__setattr__(new, "extra", {
            k: (v if k == "tokenizer" and not isinstance(v, str) else copy.deepcopy(v)) for k, v in self.extra.items()
        })
        return new

    def post_init(self) -> None:
        """Validate every field (the advanced group validates itself when made); errors name the bad value and the
        accepted ones."""
        _check_choice("content_bits", self.content_bits, CONTENT_BITS)
        _check_choice("rope_bits", self.rope_bits, ROPE_BITS)
        _check_int("group_size", self.group_size, 1)
        if self.group_size & (self.group_size - 1) or self.group_size < 8:
            raise ValueError(f"group_size must be a power of two >= 8 (64 is the default), got {self.group_size}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("recent_tokens", self.recent_tokens, 0)
        _check_choice("transform", self.transform, TRANSFORMS)
        if self.calibration_data is not None and not isinstance(self.calibration_data, (str, list, tuple)):
            raise ValueError(
                "calibration_data must be a path to a text file or a list of strings, "
                f"got {type(self.calibration_data).__name__}"
            )
        if isinstance(self.calibration_data, (list, tuple)) and not all(
            isinstance(t, str) for t in self.calibration_data
        ):
            raise ValueError("calibration_data given as a list must hold strings only")
        if not isinstance(self.advanced, AdvancedOptions):
            raise ValueError(f"advanced must be an AdvancedOptions, got {type(self.advanced).__name__}")
        if self.advanced.static_cache is True and self.recent_tokens < 1:
            raise ValueError(
                "advanced static_cache=True needs recent_tokens >= 1 (each compiled decode step is written through the "
                "recent window), got recent_tokens=0; keep recent_tokens >= 1 or use advanced={'static_cache': 'auto'} "
                "or False"
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
        """The config of a dict (config.json's `quantization_config`, of any `format_version` this library reads;
        one without the key is version 1); remembers which keys the dict held, so a checkpoint's config can be
        checked for completeness (`check_checkpoint_config`)."""
        config = cls(**{"format_version": 1, **config_dict})
        object.__setattr__(config, "_loaded_keys", frozenset(config_dict))
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k)}
        for k, v in kwargs.items():
            if hasattr(config, k):
                setattr(config, k, v)
        return (config, unused) if return_unused_kwargs else config

    def get_loading_attributes(self) -> dict[str, Any]:
        """What this config, passed to `from_pretrained` for an already quantized checkpoint, sets in the checkpoint's
        config (transformers' loading attributes, set with `setattr`): every cache option given here
        (`explicit_options`), also one equal to its default, by its name in `OPTIONS` ("advanced.kernel"). The
        weight options given here cannot change weights already saved: `weight_conflicts` names each one that
        differs from the checkpoint (the quantizer warns)."""
        return {k: self.option(k) for k in CACHE_OPTIONS if k in self._explicit}

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
            # Calibration text can be large, and a local path means nothing elsewhere: a saved checkpoint keeps the
            # path only while calibration is still to run; once calibrated, `calibration_source` says what was used.
            "calibration_data": (
                self.calibration_data if isinstance(self.calibration_data, str) and not self.calibrated else None
            ),
            "calibrated": self.calibrated,
            "advanced": self.advanced.to_dict(),
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
        """Short: the cache name, the transform and the options that differ from the defaults; extra keys by name."""
        parts = [self.name, f"transform={self.transform!r}"]
        for k in TOP_FIELDS:
            v = getattr(self, k)
            if k == "calibration_data" and isinstance(v, (list, tuple)):
                parts.append(f"{k}=<{len(v)} texts>")
            elif k not in ("content_bits", "rope_bits", "transform") and v != _DEFAULTS[k]:
                parts.append(f"{k}={v!r}")
        changed = {k: v for k, v in self.advanced.as_dict().items() if v != _ADVANCED_DEFAULTS[k]}
        if changed:
            parts.append(f"advanced={changed!r}")
        if self.extra:
            parts.append(f"extra=[{', '.join(sorted(self.extra))}]")
        return f"QuantMLAConfig({', '.join(parts)})"


def nest_options(options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `QuantMLAConfig` for options named as in `OPTIONS`: {"content_bits": 2,
    "advanced.calibration_steps": 3} -> {"content_bits": 2, "advanced": {"calibration_steps": 3}}."""
    out = {k: v for k, v in options.items() if not k.startswith("advanced.")}
    advanced = {k.removeprefix("advanced."): v for k, v in options.items() if k.startswith("advanced.")}
    return {**out, "advanced": advanced} if advanced else out


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
    `checkpoint`'s, as name (as in `OPTIONS`) -> (requested value, checkpoint's value): a quantized checkpoint's
    weights hold its transform, so none of them can apply to it."""
    given = [k for k in OPTIONS if k in requested.explicit_options and k not in CACHE_OPTIONS]
    return {k: (requested.option(k), checkpoint.option(k)) for k in given
            if requested.option(k) != checkpoint.option(k)}


def _short(value: Any) -> str:
    return f"<{len(value)} texts>" if isinstance(value, (list, tuple)) else repr(value)


_SIGNATURE = inspect.signature(QuantMLAConfig.__init__)
_DEFAULTS = {name: p.default for name, p in _SIGNATURE.parameters.items() if name in TOP_FIELDS}
# The default of every option, by its name in `OPTIONS`.
DEFAULTS = {**_DEFAULTS, **{f"advanced.{k}": v for k, v in _ADVANCED_DEFAULTS.items()}}
