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
