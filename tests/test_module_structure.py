"""Imports go one way (config/format at the bottom, then kernels, cache, attention, integration, quantizer, CLI), at
the top of each module: an import inside a function is kept only for a dependency that an installation may lack."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "quantmla_hf"

# Imported inside functions, each for a stated reason (a prefix of the imported module's name).
OPTIONAL_IMPORTS = {
    "torch.distributed.tensor": "torch builds without distributed support",
    "matplotlib": "optional plotting of the analysis",
    ".main": "optimum-cli imports every registered module to list its commands: torch loads only when one runs",
    "transformers.cli.serving": "the serve extra (fastapi, uvicorn, openai)", "uvicorn": "the serve extra",
    "..serving.server": "the serve extra",
    ".loader": "transformers' server from 5.25 (its ModelLoader), with the serve extra",
}


def _imports(path: Path):
    """(module, inside a function) for every import of `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), id(node) in local
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in local


def _modules():
    return sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))


def test_integration_never_imports_the_quantizer():
    modules = [m for m, _ in _imports(PACKAGE / "integration.py")]
    assert not [m for m in modules if m.endswith("quantizer")], modules


def test_no_imports_inside_functions_without_a_reason():
    found = [
        (str(path.relative_to(ROOT)), module)
        for path in _modules()
        for module, local in _imports(path)
        if local and not any(module == p or module.startswith(p + ".") for p in OPTIONAL_IMPORTS)
    ]
    assert not found, found


def test_kernels_import_nothing_above_the_format():
    """kernels/ sits below the cache and attention: it reads the format definitions and nothing else of the package."""
    above = [
        (path.name, module)
        for path in sorted((ROOT / "kernels").glob("*.py"))
        for module, _ in _imports(path)
        if module.startswith("quantmla_hf") and module not in ("quantmla_hf.format",)
    ]
    assert not above, above


# The package's parts from the bottom up: a module imports only from its own part and the parts below it.
LAYERS = (
    ("format", "config", "mla", "log", "hadamard", "distributed", "embedded", "tiny_models", "_source_kernels"),
    ("kernels",),
    ("ops",),
    ("cache",),
    ("attention",),
    ("generation",),
    ("saving",),
    ("calibration",),
    ("evaluation", "serving"),
    ("hooks",),
    ("integration",),
    ("quantizer",),
    ("cli", "optimum_register", "__init__"),
)
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("").parts
    return rel[0] if rel[0] != "__init__" else "__init__"


def _target_part(path: Path, module: str) -> str | None:
    """The part of the package `module` (as imported in `path`, relative or absolute) lies in, or None outside it."""
    if module.startswith("quantmla_hf"):
        parts = module.split(".")[1:]
    elif module.startswith("."):
        level = len(module) - len(module.lstrip("."))
        here = list(path.relative_to(PACKAGE).with_suffix("").parts)
        base = here[:-1][: len(here) - level] if level > 1 else here[:-1]
        parts = base + [p for p in module.lstrip(".").split(".") if p]
    else:
        return None
    return parts[0] if parts else None


def test_imports_go_one_way_through_the_package():
    """No part imports one above it (and so no circle between parts): format and config at the bottom, then kernels,
    ops, the caches, attention, generation, saving, calibration, evaluation and serving, the hooks, the integration,
    the quantizer, the command line."""
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "assets" in path.parts:
            continue
        part = _part(path)
        for module, _ in _imports(path):
            target = _target_part(path, module)
            if module in (".", "..") or target is None or target == part:
                continue
            if LEVEL[target] > LEVEL[part]:
                upward.append((str(path.relative_to(ROOT)), module))
    assert not upward, upward
    assert set(LEVEL) >= {_part(p) for p in PACKAGE.rglob("*.py") if "assets" not in p.parts}
