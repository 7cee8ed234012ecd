"""Imports go one way: config/format at the bottom, then kernels, cache, attention, integration, quantizer, CLI."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quantmla_hf"

# Imports inside functions that stay, each for a stated reason.
ALLOWED_LOCAL_IMPORTS = {
    ("cli.py", ".analysis"),  # the dual-path analysis is optional in an installation: its absence is reported
    ("cli.py", ".calibration"),  # (same guarded block)
    ("integration.py", ".static_generate"),  # the generate hook's own import (static_generate reads integration)
    ("optimum_cli.py", "optimum.commands.base"),  # optimum is an optional dependency
    # optimum-cli imports every registered module to list its commands: torch and transformers load only when run
    ("optimum_cli.py", ".cli"),
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


def test_integration_never_imports_the_quantizer():
    modules = [m for m, _ in _imports(PACKAGE / "integration.py")]
    assert not [m for m in modules if m.endswith("quantizer")], modules


def test_no_imports_inside_functions_without_a_reason():
    owned = ("integration.py", "quantizer.py", "config.py", "cli.py", "demo.py", "calibration_check.py",
             "model_card.py", "optimum_cli.py", "staged_output.py", "chunk_attention.py")
    found = [(name, module) for name in owned for module, local in _imports(PACKAGE / name)
             if local and (name, module) not in ALLOWED_LOCAL_IMPORTS]
    assert not found, found
