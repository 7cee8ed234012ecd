"""QuantMLA: 4- and 2-bit KV cache for MLA models in Hugging Face Transformers."""

from . import _source_kernels  # noqa: F401  (first: quantmla_hf.kernels where an editable install cannot map it)
from .attention.interface import register_attention
from .attention.state import ATTN_IMPLEMENTATION, install_cache_hooks
from .cache.growing import QuantMLACache, QuantMLALayer
from .cache.static import StaticQuantMLACache, StaticQuantMLALayer
from .config import AdvancedOptions, QuantMLAConfig
from .format import CacheFormat, PathFormat
from .mla import MLADims, mla_dims

register_attention()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AdvancedOptions",
    "CacheFormat",
    "MLADims",
    "PathFormat",
    "QuantMLACache",
    "QuantMLAConfig",
    "QuantMLALayer",
    "StaticQuantMLACache",
    "StaticQuantMLALayer",
    "install_cache_hooks",
    "mla_dims",
]

from .evaluation.analysis import analyze  # noqa: E402
from .integration import build_cache  # noqa: E402
from .quantizer import QuantMLAHfQuantizer, apply_quantmla, quantize, register_quantmla  # noqa: E402

register_quantmla()
__all__ += ["QuantMLAHfQuantizer", "analyze", "apply_quantmla", "build_cache", "quantize", "register_quantmla"]
