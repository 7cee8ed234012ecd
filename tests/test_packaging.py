"""The Triton kernels ship inside the package and never shadow Hugging Face's top-level `kernels` module."""

import os
import subprocess
import sys
from pathlib import Path

import quantmla_hf.kernels

REPO = Path(__file__).resolve().parents[1]


def test_kernels_are_installed_as_a_subpackage():
    assert Path(quantmla_hf.kernels.__file__).resolve().parent == REPO / "kernels"


def test_no_top_level_kernels_module_from_this_repository(tmp_path):
    """The installation exposes no top-level `kernels` of ours (asked from another folder: `python -m pytest` run in
    the repository puts its root, and so the source folder `kernels/`, on the path of this process)."""
    code = ("import importlib.util; s = importlib.util.find_spec('kernels'); "
            "print('' if s is None else (s.origin or next(iter(s.submodule_search_locations))))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    if found:  # Hugging Face's kernel-hub package may be installed; it must not be ours
        origin = Path(found).resolve()
        assert REPO / "kernels" not in (origin, origin.parent)
