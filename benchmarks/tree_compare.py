"""Another tree's decode beside this one's, in one process, and times taken in turns summarised as intervals.

- `load_baseline_decode(path, package)`: the decode operation of an older tree (`git archive REV | tar -x -C DIR`)
  imported beside this tree's, under a package name of its own (several trees side by side): its `mla_decode_static`
  (and `mla_decode_paged`, where it has one) with this tree's signature.
- `routed_decode(baseline)`: a context in which this tree's model decode (`quantmla_hf.ops.decode`) calls the older
  tree's contiguous decode instead of its own; the rest of the model (projections, cache writes, generate) is this
  tree's.
- `summarize_rounds(times)`: per-round times of methods timed in turns -> each mean with its 95% interval and each
  ratio to the first method with its interval.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

import quantmla_hf.format
import quantmla_hf.ops.decode as decode_module
from quantmla_hf.evaluation.intervals import t_interval

BASELINE_PACKAGE = "quantmla_baseline"


@dataclass
class BaselineDecode:
    """An older tree's decode: `static(q_lat, q_rot, content, rope, fmt, sink_c, sink_r, recent_c, recent_r,
    left_padding, length, capacity, scaling, **kw)` as this tree's `backends.mla_decode_static` (through that tree's
    own dispatch), `paged` as `backends.mla_decode_paged` or None. `calls` counts the contiguous calls."""

    static_op: Callable
    fast: types.ModuleType | None = None
    paged: Callable | None = None
    calls: int = field(default=0)

    def static(self, q_lat, q_rot, content, rope, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length,
               capacity, scaling, **kw):
        self.calls += 1
        op = self.static_op
        if self.fast is not None and self.fast.fast_supported(fmt, q_lat.dtype, q_lat.device, sink_c.dtype):
            op = self.fast.mla_decode_static
        return op(q_lat, q_rot, content, rope, fmt, sink_c, sink_r, recent_c, recent_r, left_padding, length,
                  capacity, scaling, **kw)


def load_baseline_decode(path: str, package: str = BASELINE_PACKAGE) -> BaselineDecode:
    """The decode operation of the tree at `path`: its `kernels/` imported as the package `package.kernels` (their
    own relative imports; `quantmla_hf.format` is this tree's, the same byte layout) and its `mla_decode_static` from
    where that tree keeps the operation: `quantmla_hf/ops/backends.py` (this layout), `quantmla_hf/decode.py` (the
    flat package before it), or, in trees that kept the operation in `kernels/`, as their `ops.py` chose it:
    `kernels/mla_decode_fast.py` where its `fast_supported` says so, else `kernels/mla_decode.py`. Each tree loaded
    beside another takes a package name of its own: a name that holds another tree already is refused (its modules
    would be that tree's)."""
    if not os.path.isdir(os.path.join(path, "kernels")):
        raise SystemExit(f"--baseline-path {path!r} has no kernels/ folder: pass the root of an extracted tree "
                         "(mkdir -p before && git archive REV | tar -x -C before)")
    source = os.path.join(os.path.abspath(path), "quantmla_hf")
    loaded = sys.modules.get(package)
    if loaded is not None and loaded.__path__ != [source]:
        raise ValueError(f"{package!r} already holds the tree at {os.path.dirname(loaded.__path__[0])!r}: load "
                         f"{path!r} under another package name")
    root = types.ModuleType(package)
    root.__path__ = [source]
    sys.modules[package] = root
    sys.modules[package + ".format"] = quantmla_hf.format
    folder = os.path.join(path, "kernels")
    init = os.path.join(folder, "__init__.py")  # absent from this layout on: a namespace package
    if os.path.exists(init):
        spec = importlib.util.spec_from_file_location(package + ".kernels", init,
                                                      submodule_search_locations=[folder])
    else:
        spec = importlib.machinery.ModuleSpec(package + ".kernels", None, is_package=True)
        spec.submodule_search_locations = [folder]
    kernels = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kernels
    if spec.loader is not None:
        spec.loader.exec_module(kernels)
    module = next((m for m, f in ((".ops.backends", "ops/backends.py"), (".decode", "decode.py"))
                   if os.path.exists(os.path.join(path, "quantmla_hf", f))), None)
    in_package = module is not None
    if module == ".ops.backends":  # its package, without running the tree's quantmla_hf/ops/__init__ imports
        ops = types.ModuleType(package + ".ops")
        ops.__path__ = [os.path.join(path, "quantmla_hf", "ops")]
        sys.modules[ops.__name__] = ops
    op = importlib.import_module(package + (module if in_package else ".kernels.mla_decode"))
    fast = None  # trees before the one decode module: `mla_decode_fast` took the cases its `fast_supported` named
    if not in_package and os.path.exists(os.path.join(path, "kernels", "mla_decode_fast.py")):
        fast = importlib.import_module(package + ".kernels.mla_decode_fast")
    return BaselineDecode(op.mla_decode_static, fast, getattr(op, "mla_decode_paged", None))


class _RoutedBackends(types.SimpleNamespace):
    """This tree's `backends` module with `mla_decode_static` taken from a `BaselineDecode`."""

    def __init__(self, own: types.ModuleType, baseline: BaselineDecode):
        super().__init__(mla_decode_static=baseline.static)
        self._own = own

    def __getattr__(self, name):
        return getattr(self._own, name)


@contextlib.contextmanager
def routed_decode(baseline: BaselineDecode | None):
    """Inside, the model's contiguous decode (`quantmla_hf.ops.decode.decode_contiguous`, eager and captured steps)
    runs `baseline.static`; None leaves this tree's. Graphs captured inside keep the kernels they recorded: release
    them when leaving (`quantmla_hf.generation.graphs.release_decode_graphs`)."""
    if baseline is None:
        yield
        return
    own = decode_module.backends
    if own is None:
        raise RuntimeError("the decode kernels need Triton, which is not installed: there is no decode to route")
    decode_module.backends = _RoutedBackends(own, baseline)
    try:
        yield
    finally:
        decode_module.backends = own


def summarize_rounds(times: dict, target: float | None = None) -> tuple[list[dict], str | None]:
    """Per-round times `{method: [ms per round]}` (the methods timed in turns, the first the reference) ->
    per method `{method, ms, ratio}`: the mean time with its Student-t 95% interval, and the mean of the per-round
    ratios to the first method with its interval (an interval holding 1 is a tie); and, given `target` (ms), where
    the first method stands: "met" (its interval below the target), "missed" (above), or a tie (it holds it)."""
    names = list(times)
    ref = torch.tensor(times[names[0]], dtype=torch.float64)
    rows = []
    for k in names:
        ms = torch.tensor(times[k], dtype=torch.float64)
        if ms.shape != ref.shape:
            raise ValueError(f"every method needs one time per round: {k} has {ms.numel()}, {names[0]} {ref.numel()}")
        rows.append(dict(method=k, ms=t_interval(ms), ratio=t_interval(ms / ref)))
    if target is None:
        return rows, None
    m = rows[0]["ms"]
    return rows, "met" if m.high < target else ("missed" if m.low > target else "tie (the interval holds it)")


def ratio_word(ratio) -> str:
    """"faster", "slower" or "tie" for a ratio interval new / old."""
    return "faster" if ratio.high < 1 else ("slower" if ratio.low > 1 else "tie")
