"""The Triton kernels ship inside the package and never shadow Hugging Face's top-level `kernels` module."""

import importlib.util
from pathlib import Path

import quantmla_hf.kernels

REPO = Path(__file__).resolve().parents[1]


def test_kernels_are_installed_as_a_subpackage():
    assert Path(quantmla_hf.kernels.__file__).resolve().parent == REPO / "kernels"


def test_no_top_level_kernels_module_from_this_repository():
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # Hugging Face's kernel-hub package may be installed; it must not be ours
        origin = Path(spec.origin or next(iter(spec.submodule_search_locations))).resolve()
        assert REPO / "kernels" not in (origin, origin.parent)
